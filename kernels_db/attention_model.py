"""Attention kernel times from measured FlashAttention/FlashInfer latencies (vLLM's prefill and decode).

Two calibrated curves per GPU (``kernels_db/data/lowp_calibration.json``, section ``attention``):

Prefill (FlashAttention varlen forward, causal, bf16): a FLOP-rate curve,
    1. tiles: the kernel computes whole ``TILE x TILE`` (query block x key block) score tiles; a tile is
       computed when any of its pairs is attended (causal, left window, cached prefix). The tile count is
       ``attended_pairs`` in block units, so a 128-token window costs two tiles per query block, twice
       its exact pairs (held out of this rule the windowed rows came out 25-35% fast);
       ``flops = 4 * heads * head_dim * TILE**2 * tiles`` (q@k^T and P@v), ``scores = heads * TILE**2 * tiles``;
    2. waves: the grid is ``ceil(L / TILE)`` query blocks x batch x heads, so the busiest SM runs
       ``ceil(blocks / sms)`` blocks: FLOPs and scores are scaled by ``ceil(blocks/sms) / (blocks/sms)``;
    3. ``t = floor_ns + flops / peak * inv_efficiency(log2 L) + ns_per_score * scores + bytes_factor *
       bytes / bandwidth``: ``1/e`` piecewise linear in ``log2`` of the per-sequence query length; the
       score term is the softmax's exponentials, whose rate does not grow with head dim (the
       FlashAttention-3 paper's point: head dim 64 runs at a lower FLOP rate than 128); bytes are q, out
       and the K/V written into the cache, read at ``bytes_factor`` x datasheet time (K/V re-reads, GQA).
       All by relative least squares, coefficients kept >= their physical bounds.
Decode (paged KV read, one query token per sequence): a bandwidth curve,
    ``t = floor_ns + kv_bytes * inv_efficiency(log2 kv_bytes) / bandwidth``, ``kv_bytes`` = K and V of every
    cached token of every sequence (``kv_heads * head_dim * itemsize`` each) plus q and out.

GPUs without measurements use a measured GPU of the same compute capability, else the median curves
applied to their datasheet peak and bandwidth.

Training SDPA (``scaled_dot_product_attention`` flash / memory-efficient, forward and backward) is priced
from the prefill curve at the sequence length of the call -- extrapolated, since the data holds no
training kernels:
    * forward: the prefill curve, times ``SDPA_RATE_VS_SERVING[cc]`` where PyTorch runs a slower kernel
      than the measured one (FlashAttention-2 in PyTorch vs FlashAttention-3 measured on sm90);
    * backward: 2.5x the forward FLOPs (FlashAttention-2 recomputes ``q@k^T`` and does 4 more matmuls of the
      same size: 5 / 2) at ``BACKWARD_RATE_FRACTION`` of the forward rate;
    * memory-efficient (xformers/cutlass) kernels: ``EFFICIENT_RATE_FRACTION`` of the flash rate.

Example::

    attn = AttentionModel.load()
    t_ns = attn.prefill_ns([512, 512], [0, 0], heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                           device=get_device("h100"))
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from boomfx.core.devices import DeviceSpec, get_device
from boomfx.kernels_db import gpu_model_core as core
from boomfx.kernels_db.gpu_model_core import MemoryParams

LOWP_CALIBRATION_PATH = Path(__file__).parent / "data" / "lowp_calibration.json"

QUERY_BLOCK = 128                       # FlashAttention-2/3 forward query tile (rows per CTA) at head dim 128
TILE = 128                              # score tile edge (query block x key block) the kernels skip or compute
PREFILL_KNOTS_LOG2: tuple[float, ...] = tuple(float(x) for x in range(4, 16))    # L = 16 .. 32768
DECODE_KNOTS_LOG2: tuple[float, ...] = tuple(float(x) for x in range(14, 34, 2))  # 16 KiB .. 8 GiB of KV
# The kernel each measured GPU's curve is fitted on (bf16 KV cache): the one vLLM picks by default there.
PREFILL_KERNELS: Mapping[str, str] = {
    "a100-80gb": "vllm_flash_attn", "h100-sxm": "vllm_flash_attn_fa3", "h200": "vllm_flash_attn_fa3",
    "l40s": "vllm_flash_attn_fa2", "b200": "vllm_flashinfer_trtllmprefill",
}
DECODE_KERNELS: Mapping[str, str] = {
    "a100-80gb": "vllm_flash_attn", "h100-sxm": "vllm_flash_attn_fa3", "h200": "vllm_flash_attn_fa3",
    "l40s": "vllm_flash_attn_fa2", "b200": "vllm_flashinfer_trtllmdecode",
}
BF16_BYTES = 2

# --- training SDPA, extrapolated from the serving kernels (named data with their sources) -------------
# FlashAttention-3 paper (Shah et al. 2024, Fig. 5/6, H100 SXM5, head dim 128, bf16): FA2 forward reaches
# ~330-370 TFLOP/s where FA3 reaches ~600-660: PyTorch's flash SDPA (FA2 code) runs ~0.55x the measured FA3.
SDPA_RATE_VS_SERVING: Mapping[tuple[int, int], float] = {(9, 0): 0.55}
# FlashAttention-2 paper (Dao 2023, Fig. 4-6, A100): the backward pass reaches ~0.75-0.85x the forward's
# FLOP rate (its dQ accumulation and the extra matmuls); 0.8 taken.
BACKWARD_RATE_FRACTION = 0.8
# FLOPs of the backward over the forward: recompute q@k^T, then dV, dP, dQ, dK: 5 matmuls over 2.
BACKWARD_FLOP_RATIO = 2.5
# FlashAttention-2 paper Fig. 4: xformers' cutlass kernel (PyTorch's memory-efficient SDPA) runs at roughly
# 0.6-0.7x FlashAttention-2's forward rate on A100; 0.65 taken.
EFFICIENT_RATE_FRACTION = 0.65


def attended_pairs(q_len: Any, kv_len: Any, causal: bool = True, window_left: Optional[Any] = None) -> np.ndarray:
    """(query, key) pairs attended per sequence and head; queries are the last ``q_len`` of ``kv_len`` positions.

    Query ``i`` (0-based among the new tokens) sits at position ``p + i`` with ``p = kv_len - q_len`` cached
    tokens before it; causal: it sees keys ``0 .. p + i``, i.e. ``p + i + 1`` of them, at most
    ``window_left + 1`` with a left window. Sum over ``i``: with ``w = window_left + 1`` and the
    crossing index ``c = clip(w - p - 1, 0, q_len)`` (queries before ``c`` see all their prefix):
    ``sum_{i<c} (p+i+1) + (q_len - c) * w``. Non-causal: ``q_len * min(kv_len, w)``.
    """
    n = np.asarray(q_len, dtype=np.float64)
    s = np.asarray(kv_len, dtype=np.float64)
    p = s - n
    if not causal:
        return n * (s if window_left is None else np.minimum(s, np.asarray(window_left, dtype=np.float64) + 1))
    full = n * p + n * (n + 1) / 2
    if window_left is None:
        return full
    w = np.asarray(window_left, dtype=np.float64) + 1
    c = np.clip(w - p - 1, 0, n)
    return c * p + c * (c + 1) / 2 + (n - c) * w


def _waves(blocks: np.ndarray, sm_count: int) -> np.ndarray:
    """``ceil(blocks / sms) / (blocks / sms)``: the last wave's idle SMs, as a FLOP multiplier (>= 1)."""
    blocks = np.maximum(np.asarray(blocks, dtype=np.float64), 1.0)
    return np.ceil(blocks / sm_count) / (blocks / sm_count)


@dataclass(frozen=True)
class PrefillParams:
    """The prefill curve (step 3): FLOP-rate curve over log2 L, per-score and per-byte costs."""

    rate: MemoryParams      # floor_ns, log2 L knots, inverse efficiency of the bf16 dense peak
    ns_per_score: float
    bytes_factor: float


@dataclass(frozen=True)
class AttentionCurves:
    """One GPU's fitted prefill (FLOP-rate) and decode (bandwidth) curves."""

    prefill: PrefillParams
    decode: MemoryParams    # floor_ns, log2 KV-bytes knots, inverse efficiency of the bandwidth

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "AttentionCurves":
        def params(x: Mapping[str, Any]) -> MemoryParams:
            return MemoryParams(float(x["floor_ns"]), tuple(x["log2_row_knots"]), tuple(x["inv_efficiency"]))
        p = d["prefill"]
        return AttentionCurves(PrefillParams(params(p["rate"]), float(p["ns_per_score"]), float(p["bytes_factor"])),
                               params(d["decode"]))


@dataclass(frozen=True)
class PrefillWork:
    """Step 1-2 quantities of prefill calls (arrays, one entry per call)."""

    flops: np.ndarray      # tile FLOPs x wave factor
    scores: np.ndarray     # tile score elements x wave factor
    nbytes: np.ndarray     # q + out + K/V written
    seq_len: np.ndarray    # mean new tokens per sequence (the curve's abscissa)


def computed_tiles(q_len: Any, kv_len: Any, causal: bool, window_left: Optional[Any]) -> np.ndarray:
    """Score tiles ``TILE x TILE`` a FlashAttention kernel computes for one sequence and head (step 1)."""
    n = np.ceil(np.asarray(q_len, dtype=np.float64) / TILE)
    s = np.ceil(np.asarray(kv_len, dtype=np.float64) / TILE)
    w = None if window_left is None else np.ceil(np.asarray(window_left, dtype=np.float64) / TILE)
    return attended_pairs(n, s, causal, w)


def prefill_work(q_len: np.ndarray, kv_len: np.ndarray, heads: Any, kv_heads: Any, head_dim: Any,
                 device: DeviceSpec, window_left: Optional[Any] = None, itemsize: int = BF16_BYTES) -> PrefillWork:
    """Prefill work of calls ``[calls, seqs]`` (0-padded) of new / total tokens per sequence."""
    q_len = np.atleast_2d(np.asarray(q_len, dtype=np.float64))
    kv_len = np.atleast_2d(np.asarray(kv_len, dtype=np.float64))
    heads, kv_heads, head_dim = (np.asarray(x, dtype=np.float64) for x in (heads, kv_heads, head_dim))
    tiles = np.where(q_len > 0, computed_tiles(q_len, kv_len, True, window_left), 0.0).sum(axis=-1)
    blocks = np.ceil(q_len / QUERY_BLOCK).sum(axis=-1) * heads
    waves = _waves(blocks, device.sm_count)
    scores = heads * TILE * TILE * tiles * waves
    tokens = q_len.sum(axis=-1)
    nbytes = tokens * (2 * heads + 2 * kv_heads) * head_dim * itemsize
    seqs = np.maximum((q_len > 0).sum(axis=-1), 1)
    return PrefillWork(4.0 * head_dim * scores, scores, nbytes, tokens / seqs)


class AttentionModel:
    """Prefill and decode attention times (ns) from the fitted curves; also the training SDPA kernels."""

    def __init__(self, devices: Mapping[str, AttentionCurves], generic: AttentionCurves,
                 capability: Mapping[str, tuple[int, int]]) -> None:
        self.devices = dict(devices)
        self.generic = generic
        self.capability = dict(capability)

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> "AttentionModel":
        a = doc["attention"]
        return AttentionModel({n: AttentionCurves.from_json(d) for n, d in a["devices"].items()},
                              AttentionCurves.from_json(a["generic"]),
                              {n: tuple(cc) for n, cc in a["capability"].items()})

    @staticmethod
    def load(path: Optional[Path | str] = None) -> "AttentionModel":
        with open(path or LOWP_CALIBRATION_PATH) as fh:
            return AttentionModel.from_json(json.load(fh))

    def curves(self, device: DeviceSpec) -> AttentionCurves:
        if device.name in self.devices:
            return self.devices[device.name]
        same = sorted(n for n, cc in self.capability.items() if cc == device.compute_capability and n in self.devices)
        return self.devices[same[0]] if same else self.generic

    # -- serving: the signature the serving engine calls -----------------------------------------
    def prefill_ns(self, tokens: Sequence[int], context_lens: Sequence[int], heads: int, kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device: DeviceSpec,
                   window_left: Optional[int] = None) -> float:
        """One varlen prefill call: sequence ``i`` adds ``tokens[i]`` new tokens after ``context_lens[i]``
        cached ones (0 = fresh). Causal; ``window_left`` = sliding window (keys before the query)."""
        q = np.asarray(tokens, dtype=np.float64)[None, :]
        kv = q + np.asarray(context_lens, dtype=np.float64)[None, :]
        itemsize = torch.empty((), dtype=dtype).element_size()
        work = prefill_work(q, kv, heads, kv_heads, head_dim, device, window_left, itemsize)
        return float(prefill_time_ns(work, device, self.curves(device).prefill)[0])

    def decode_ns(self, context_lens: Sequence[int], heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: DeviceSpec, kv_dtype: Optional[torch.dtype] = None) -> float:
        """One decode step: each sequence reads ``context_lens[i] + 1`` cached K/V positions."""
        kv_item = torch.empty((), dtype=kv_dtype or dtype).element_size()
        q_item = torch.empty((), dtype=dtype).element_size()
        ctx = np.asarray(context_lens, dtype=np.float64) + 1
        nbytes = float(ctx.sum()) * 2 * kv_heads * head_dim * kv_item + len(ctx) * 2 * heads * head_dim * q_item
        return float(decode_time_ns(np.asarray([nbytes]), device, self.curves(device).decode)[0])

    # -- training SDPA ---------------------------------------------------------------------------
    def sdpa_ns(self, batch_heads: int, q_len: int, kv_len: int, head_dim: int, device: DeviceSpec, *,
                causal: bool, backward: bool, backend: str = "flash", window_left: Optional[int] = None,
                head_dim_v: Optional[int] = None) -> float:
        """A fused SDPA kernel of ``batch_heads`` (batch x query heads) problems (see module doc)."""
        ev = head_dim_v or head_dim
        tiles = float(computed_tiles(q_len, kv_len, causal, window_left))
        blocks = batch_heads * np.ceil(q_len / QUERY_BLOCK)
        waves = float(_waves(np.asarray(blocks), device.sm_count))
        scores = batch_heads * TILE * TILE * tiles * waves
        rate = SDPA_RATE_VS_SERVING.get(device.compute_capability, 1.0)
        if backend == "efficient":
            rate *= EFFICIENT_RATE_FRACTION
        flops = 2.0 * (head_dim + ev) * scores
        if backward:
            flops *= BACKWARD_FLOP_RATIO
            rate *= BACKWARD_RATE_FRACTION
        # q, k, v read and out written once (forward); the backward's dO, grads: twice that, roughly.
        nbytes = batch_heads * (q_len * (head_dim + ev) + kv_len * (head_dim + ev)) * BF16_BYTES * (2 if backward else 1)
        work = PrefillWork(np.asarray([flops / rate]), np.asarray([scores * (2 if backward else 1) / rate]),
                           np.asarray([float(nbytes)]), np.asarray([float(q_len)]))
        return float(prefill_time_ns(work, device, self.curves(device).prefill)[0])


def bf16_peak(device: DeviceSpec) -> float:
    return float(device.peak_for(torch.bfloat16))


def prefill_time_ns(work: PrefillWork, device: DeviceSpec, params: PrefillParams) -> np.ndarray:
    """Step 3."""
    inv = core.inv_efficiency_at(np.log2(np.maximum(work.seq_len, 1.0)), params.rate)
    return (params.rate.floor_ns + work.flops / bf16_peak(device) * 1e9 * inv + params.ns_per_score * work.scores
            + params.bytes_factor * work.nbytes / device.memory_bandwidth_bytes_per_s * 1e9)


def decode_time_ns(nbytes: np.ndarray, device: DeviceSpec, params: MemoryParams) -> np.ndarray:
    inv = core.inv_efficiency_at(np.log2(np.maximum(nbytes, 1.0)), params)
    return params.floor_ns + nbytes / device.memory_bandwidth_bytes_per_s * 1e9 * inv


# ---------------------------------------------------------------------------------------------------
# Fitting (called by fit_lowp_model)
# ---------------------------------------------------------------------------------------------------

def measured_prefill(table: Any, device_name: str) -> tuple[PrefillWork, np.ndarray]:
    """(work, latency) of the bf16-KV rows of the device's default prefill kernel (one call per row)."""
    rows = (table.device == device_name) & (table.kernel == PREFILL_KERNELS[device_name]) & (table.kv_dtype == "bfloat16")
    t = table.where(rows)
    device = get_device(device_name)
    # vLLM's window_size counts the query itself: it attends window_size - 1 earlier keys.
    window = np.where(t.window > 0, t.window - 1, np.maximum(t.tokens, 1.0))
    q = t.tokens * np.ones((1,))
    tiles = computed_tiles(q, q, True, window)
    blocks = t.batch * t.heads * np.ceil(t.tokens / QUERY_BLOCK)
    scores = t.batch * t.heads * TILE * TILE * tiles * _waves(blocks, device.sm_count)
    nbytes = t.batch * t.tokens * (2 * t.heads + 2 * t.kv_heads) * t.head_dim * BF16_BYTES
    return PrefillWork(4.0 * t.head_dim * scores, scores, nbytes, t.tokens), t.latency_ns


def measured_decode(table: Any, device_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(KV + q/out bytes, latency) of the full-attention bf16-KV rows of the device's decode kernel."""
    rows = ((table.device == device_name) & (table.kernel == DECODE_KERNELS[device_name])
            & (table.kv_dtype == "bfloat16") & (table.window == 0))
    t = table.where(rows)
    nbytes = (t.batch * (t.tokens + 1) * 2 * t.kv_heads * t.head_dim * BF16_BYTES
              + t.batch * 2 * t.heads * t.head_dim * BF16_BYTES)
    return nbytes, t.latency_ns


def _fit_curve(x_log2: np.ndarray, work_ns: np.ndarray, extra_ns: np.ndarray, t: np.ndarray,
               knots: Sequence[float]) -> MemoryParams:
    """``t - extra = floor + work * sum_j w_j(x) c_j`` by relative least squares; ``c_j >= 1``."""
    from boomfx.kernels_db.fit_gpu_model import _fill_missing, _relative_lstsq
    target = np.maximum(t - extra_ns, 0.05 * t)
    basis = core.hat_basis(x_log2, knots)
    used = basis.sum(axis=0) > 0
    cols = [np.ones_like(target)] + [basis[:, j] * work_ns for j in range(len(knots)) if used[j]]
    x = _relative_lstsq(cols, target)
    inv = np.full(len(knots), np.nan)
    inv[used] = x[1:]
    inv = np.maximum(_fill_missing(inv), 1.0)
    return MemoryParams(max(float(x[0]), 0.0), tuple(float(k) for k in knots), tuple(float(v) for v in inv))


def _fit_prefill(work: PrefillWork, t: np.ndarray, device: DeviceSpec) -> PrefillParams:
    """Step 3 by relative least squares; a coefficient past its bound (floor, per-score cost >= 0, bytes
    factor >= 1, inverse efficiencies >= 1) is fixed there and the rest refitted."""
    from boomfx.kernels_db.fit_gpu_model import _fill_missing
    knots = PREFILL_KNOTS_LOG2
    basis = core.hat_basis(np.log2(np.maximum(work.seq_len, 1.0)), knots)
    flops_ns = work.flops / bf16_peak(device) * 1e9
    bytes_ns = work.nbytes / device.memory_bandwidth_bytes_per_s * 1e9
    used = [j for j in range(len(knots)) if basis[:, j].sum() > 0]
    cols = {"floor": np.ones_like(t), "score": work.scores, "bytes": bytes_ns}
    cols.update({f"k{j}": basis[:, j] * flops_ns for j in used})
    bounds = {"floor": 0.0, "score": 0.0, "bytes": 1.0, **{f"k{j}": 1.0 for j in used}}
    fixed: dict[str, float] = {}
    for _ in range(len(cols)):
        free = [c for c in cols if c not in fixed]
        rest = t - sum((cols[c] * v for c, v in fixed.items()), np.zeros_like(t))
        x = dict(zip(free, _lstsq_scaled([cols[c] for c in free], rest, t)))
        bad = [c for c in free if x[c] < bounds[c]]
        if not bad:
            break
        worst = min(bad, key=lambda c: x[c] - bounds[c])
        fixed[worst] = bounds[worst]
    values = {**x, **fixed}
    inv = np.full(len(knots), np.nan)
    for j in used:
        inv[j] = values[f"k{j}"]
    inv = np.maximum(_fill_missing(inv), 1.0)
    rate = MemoryParams(float(values["floor"]), tuple(float(k) for k in knots), tuple(float(v) for v in inv))
    return PrefillParams(rate, float(values["score"]), float(values["bytes"]))


def _lstsq_scaled(columns: Sequence[np.ndarray], target: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """argmin sum(((A x - target) / weight)^2): relative to the measured time ``weight``."""
    a = np.stack([c / weight for c in columns], axis=1)
    x, *_ = np.linalg.lstsq(a, target / weight, rcond=None)
    return x


def fit_device_attention(context: Any, generation: Any, device_name: str) -> AttentionCurves:
    device = get_device(device_name)
    work, t = measured_prefill(context, device_name)
    prefill = _fit_prefill(work, t, device)
    kv_bytes, td = measured_decode(generation, device_name)
    decode = _fit_curve(np.log2(kv_bytes), kv_bytes / device.memory_bandwidth_bytes_per_s * 1e9,
                        np.zeros_like(td), td, DECODE_KNOTS_LOG2)
    return AttentionCurves(prefill, decode)


def generic_curves(curves: Sequence[AttentionCurves]) -> AttentionCurves:
    """Median floors, per-score costs and bytes factors, geometric-median inverse efficiencies."""
    def med(ps: Sequence[MemoryParams]) -> MemoryParams:
        inv = np.exp(np.median(np.log(np.array([p.inv_efficiency for p in ps])), axis=0))
        return MemoryParams(float(np.median([p.floor_ns for p in ps])), ps[0].log2_row_knots,
                            tuple(float(v) for v in inv))
    prefill = PrefillParams(med([c.prefill.rate for c in curves]),
                            float(np.median([c.prefill.ns_per_score for c in curves])),
                            float(np.median([c.prefill.bytes_factor for c in curves])))
    return AttentionCurves(prefill, med([c.decode for c in curves]))


def _curves_dict(c: AttentionCurves) -> dict:
    from dataclasses import asdict
    return {"prefill": asdict(c.prefill), "decode": asdict(c.decode)}


def curves_json(devices: Mapping[str, AttentionCurves]) -> dict:
    return {
        "devices": {n: _curves_dict(c) for n, c in devices.items()},
        "generic": _curves_dict(generic_curves(list(devices.values()))),
        "capability": {n: list(get_device(n).compute_capability) for n in devices},
        "kernels": {"prefill": dict(PREFILL_KERNELS), "decode": dict(DECODE_KERNELS)},
    }


def fit_attention(data_dir: Optional[Path | str] = None) -> dict:
    from boomfx.kernels_db.lowp_data import load_attention
    context = load_attention("attention_context.csv", data_dir)
    generation = load_attention("attention_generation.csv", data_dir)
    return curves_json({n: fit_device_attention(context, generation, n) for n in sorted(PREFILL_KERNELS)})



# ---------------------------------------------------------------------------------------------------
# The serving engine's entry points (one shared, lazily loaded model)
# ---------------------------------------------------------------------------------------------------

_DEFAULT_MODEL: Optional[AttentionModel] = None


def default_attention_model() -> AttentionModel:
    """The model of the shipped calibration, loaded once."""
    global _DEFAULT_MODEL
    if _DEFAULT_MODEL is None:
        _DEFAULT_MODEL = AttentionModel.load()
    return _DEFAULT_MODEL


def prefill_attention_ns(tokens: Sequence[int], context_lens: Sequence[int], heads: int, kv_heads: int,
                         head_dim: int, dtype: torch.dtype, device: DeviceSpec,
                         window_left: Optional[int] = None) -> float:
    """ns of one varlen prefill attention call: sequence ``i`` adds ``tokens[i]`` new tokens after
    ``context_lens[i]`` cached ones (causal; ``window_left``: sliding window). See ``AttentionModel.prefill_ns``."""
    return default_attention_model().prefill_ns(tokens, context_lens, heads, kv_heads, head_dim, dtype, device,
                                                window_left)


def decode_attention_ns(context_lens: Sequence[int], heads: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype, device: DeviceSpec, kv_dtype: Optional[torch.dtype] = None) -> float:
    """ns of one paged-KV decode step (one new token per sequence over ``context_lens[i] + 1`` keys)."""
    return default_attention_model().decode_ns(context_lens, heads, kv_heads, head_dim, dtype, device, kv_dtype)
