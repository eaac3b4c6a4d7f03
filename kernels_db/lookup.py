"""Price one kernel call for a device: measured > interpolated > (transferred / model) > roofline.

``KernelPricer(store, device).price(call, cost)`` returns a ``KernelPrice`` whose ``source`` says where
the number came from, so the report can show how much of a prediction each source priced (Habitat's
measured/predicted split):

1. **measured**: the store has this exact key (newest row if several fingerprints have it).
2. **interpolated**: a miss, priced from measured rows of the same *signature* (op, dtypes, layouts,
   flags, non-size arguments; see ``signature``), only inside their hull:
   - Each row is a point of log-size features: (batch, M, K, N) for matmuls, (N, C_in, C_out, H*W)
     for convolutions, (batch*heads, L, S, E) for attention, total tensor bytes for everything else.
   - We interpolate the *achieved throughput* ``work / time`` (work = product of those sizes, i.e.
     FLOPs up to a constant, or bytes), not time, so a small kernel's launch-bound time is not
     stretched over a large one. 1-D: linear in log-log between the two bracketing rows (time then
     lies between theirs). N-D: inverse-distance weights over the ``2*d`` nearest rows in log space.
   - Tile quantization: rows whose M, K, N share the query's divisibility by 8 are preferred when they
     cover it. NB: wave quantization (tiles vs. SMs) is only as visible as the measured grid makes it.
   - The hull is the per-dimension bounding box of the rows in log space, widened by
     ``EXTRAPOLATION_MARGIN`` (x1.25 per dimension); the nearest row must also be within
     ``MAX_NEIGHBOUR_RATIO`` (x4) in every dimension, so no interpolation spans an unmeasured desert.
3. **model** (or "transferred"): an optional ``model(call, device) -> time_ns | None`` hook, e.g. the
   GPU model fitted on public data, consulted before the roofline.
4. **roofline**: ``roofline.roofline_ns`` from the cost formula and the datasheet.

Rows are loaded once at construction and grouped by signature into numpy arrays; results are
memoised by key, so pricing thousands of calls costs one key build (~60 us) each.

Example::

    with Store(path) as store:
        pricer = KernelPricer(store, get_device("cpu"))
    price = pricer.price(call, cost)        # KernelPrice(time_ns=..., source="measured", ...)

Known limitations:
- Ops whose size-like arguments are lists (``view``, ``full``) only get exact hits: the sizes are part of
  their signature.
- Workspace for interpolated rows is the nearest row's, scaled by input bytes (NB: approximate).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from boomfx.core.devices import DeviceSpec
from boomfx.kernels_db.collective_model import COLLECTIVE_OP
from boomfx.kernels_db.device_rows import device_fingerprints, no_rows_warning
from boomfx.kernels_db.host_overheads import HOST_OP
from boomfx.kernels_db.keys import SymbolicKeyError, UnkeyableCallError, kernel_key, op_from_name
from boomfx.kernels_db.roofline import op_class, roofline_ns
from boomfx.kernels_db.cpu_attention_scratch import attention_scratch_bytes
from boomfx.kernels_db.cpu_scratch import convolution_scratch_bytes
from boomfx.kernels_db.price import KernelPrice, PriceSource
from boomfx.kernels_db.schema import BLOCK_OP, DeviceFingerprint, KernelKey, KernelRecord, canonical_json, is_in_step_source
from boomfx.kernels_db.store import Store
from boomfx.passes.costs.registry import Cost, OpCall

aten = torch.ops.aten
EXTRAPOLATION_MARGIN = math.log(1.25)
MAX_NEIGHBOUR_RATIO = 4.0
TimeModel = Callable[[OpCall, DeviceSpec], Optional[float]]


# ---------------------------------------------------------------------------------------------------------
# Features and signatures of keys
# ---------------------------------------------------------------------------------------------------------

_MATMUL_OPERANDS = {
    aten.mm: ("self", "mat2"),
    aten.addmm: ("mat1", "mat2"),
    aten.bmm: ("self", "mat2"),
    aten.baddbmm: ("batch1", "batch2"),
    aten.linear: ("input", "weight"),
}


def _prod(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _layout(t: dict) -> str:
    """'c' contiguous, 't' last two dims swapped, 'b' broadcast (a zero stride), 's' other strided."""
    dims = [(s, st) for s, st in zip(t["shape"], t["stride"]) if s != 1]
    if any(st == 0 for _, st in dims):
        return "b"
    expected = 1
    for size, stride in reversed(dims):
        if stride != expected:
            break
        expected *= size
    else:
        return "c"
    if len(t["shape"]) >= 2:
        swapped = dict(
            t, shape=t["shape"][:-2] + t["shape"][-2:][::-1], stride=t["stride"][:-2] + t["stride"][-2:][::-1]
        )
        if _layout(swapped) == "c":
            return "t"
    return "s"


def _tensor_bytes(t: dict) -> int:
    return _prod(t["shape"]) * torch.empty((), dtype=getattr(torch, t["dtype"]), device="meta").element_size()


@dataclass(frozen=True)
class _Point:
    """A key reduced to what interpolation needs."""

    signature: str
    features: tuple[int, ...]  # positive sizes; interpolation works on their logs
    align: int  # bitmask of (size % 8 == 0) over the features (matmuls only)
    in_bytes: int


def key_point(key: KernelKey) -> _Point:
    data = key.data
    op = op_from_name(data["op"])
    klass = op_class(op)
    tensors = data["tensors"]
    pointwise = torch.Tag.pointwise in op.tags
    operands = _MATMUL_OPERANDS.get(op.overloadpacket)
    extra: list = []

    def slot(value: object) -> object:
        if isinstance(value, dict) and "$t" in value:
            t = tensors[value["$t"]]
            desc = [t["dtype"], _layout(t)]
            if not (pointwise or klass != "memory"):
                desc.append(len(t["shape"]))
            if pointwise:
                desc.append(_prod(t["shape"]) == max(_prod(x["shape"]) for x in tensors))
            return desc
        if isinstance(value, list):
            return [slot(v) for v in value]
        return value

    def arg(name: str) -> dict:
        return tensors[data["args"][name]["$t"]]

    if klass == "matmul" and operands is not None:
        a, b = arg(operands[0])["shape"], arg(operands[1])["shape"]
        if op.overloadpacket is aten.linear:
            feats = (1, _prod(a[:-1]), a[-1], b[0])
        else:
            feats = (_prod(a[:-2]), a[-2], a[-1], b[-1])
    elif klass == "conv" and "weight" in data["args"]:
        x, w = arg("input")["shape"], arg("weight")["shape"]
        feats = (x[0], x[1], w[0], _prod(x[2:]))
        extra = list(w[2:])  # kernel size is structure, not size
    elif klass == "attention" and "query" in data["args"]:
        q, k = arg("query")["shape"], arg("key")["shape"]
        feats = (_prod(q[:-2]), q[-2], k[-2], q[-1])
    else:
        feats = (sum(_tensor_bytes(t) for t in tensors),)
    feats = tuple(max(int(f), 1) for f in feats)
    align = sum(1 << i for i, f in enumerate(feats) if f % 8 == 0) if klass == "matmul" else 0
    sig = canonical_json(
        {
            "op": data["op"],
            "args": slot(data["args"]),
            "context": data["context"],
            "extra": extra,
            "nfeat": len(feats),
        }
    )
    return _Point(sig, feats, align, sum(_tensor_bytes(t) for t in tensors))


# ---------------------------------------------------------------------------------------------------------
# Interpolation over one signature's rows
# ---------------------------------------------------------------------------------------------------------


class _Group:
    """Rows of one signature as arrays: log-features, log achieved throughput, alignment, records."""

    def __init__(self, points: list[_Point], records: list[KernelRecord]) -> None:
        self.records = records
        self.features = [p.features for p in points]
        self.logf = np.log(np.array([p.features for p in points], dtype=np.float64))
        work = np.array([_prod(list(p.features)) for p in points], dtype=np.float64)
        times = np.array([max(r.median_ns, 1e-3) for r in records], dtype=np.float64)
        self.log_thr = np.log(work) - np.log(times)
        self.align = np.array([p.align for p in points])
        self.in_bytes = np.array([p.in_bytes for p in points], dtype=np.float64)

    def interpolate(self, point: _Point) -> tuple[Optional[float], int, str]:
        """(log throughput, index of nearest row, why not) for a query point."""
        q = np.log(np.array(point.features, dtype=np.float64))
        idx = np.nonzero(self.align == point.align)[0]
        if len(idx) < 2 or not _inside(self.logf[idx], q):
            idx = np.arange(len(self.records))
        if not _inside(self.logf[idx], q):
            return None, -1, "outside the measured hull"
        diff = self.logf[idx] - q
        nearest_gap = np.abs(diff).max(axis=1)
        nearest = int(np.argmin(nearest_gap))
        if nearest_gap[nearest] > math.log(MAX_NEIGHBOUR_RATIO):
            return None, -1, f"no measured neighbour within x{MAX_NEIGHBOUR_RATIO:g}"
        if q.shape[0] == 1:
            order = np.argsort(self.logf[idx, 0])
            log_thr = float(np.interp(q[0], self.logf[idx[order], 0], self.log_thr[idx[order]]))
            return log_thr, int(idx[nearest]), ""
        dist2 = (diff**2).sum(axis=1)
        k = min(len(idx), 2 * q.shape[0])
        near = np.argsort(dist2)[:k]
        if dist2[near[0]] < 1e-18:
            return float(self.log_thr[idx[near[0]]]), int(idx[near[0]]), ""
        weights = 1.0 / dist2[near]
        log_thr = float((weights * self.log_thr[idx[near]]).sum() / weights.sum())
        return log_thr, int(idx[nearest]), ""


def _inside(logf: np.ndarray, q: np.ndarray) -> bool:
    lo = logf.min(axis=0) - EXTRAPOLATION_MARGIN
    hi = logf.max(axis=0) + EXTRAPOLATION_MARGIN
    return bool(np.all(q >= lo) and np.all(q <= hi))


# ---------------------------------------------------------------------------------------------------------
# The pricer
# ---------------------------------------------------------------------------------------------------------


class KernelPricer:
    """Prices OpCalls with concrete sizes for one device from a store (or from the roofline alone).

    Args:
        store: an open or closed ``Store`` (read once here), or None for roofline/model only.
        device: the target's ``DeviceSpec`` (roofline peaks, efficiencies, launch/issue times).
        model: optional ``(call, device) -> time_ns or None`` consulted after the database, before roofline.
        model_source: how to label the model's answers ("model" or "transferred").
        fingerprint: only use rows of this fingerprint (default: the rows of every fingerprint measured on
            ``device``, newest per key; other devices' rows in the same file are never used, see
            ``device_rows``).
    """

    def __init__(
        self,
        store: Optional[Store],
        device: DeviceSpec,
        model: Optional[TimeModel] = None,
        model_source: PriceSource = PriceSource.MODEL,
        fingerprint: Optional[DeviceFingerprint] = None,
    ) -> None:
        self.device = device
        self.model = model
        self.model_source = PriceSource(model_source)
        self._exact: dict[str, KernelRecord] = {}
        self.host_records: dict[str, KernelRecord] = {}
        self._memo: dict[tuple[str, Any], KernelPrice] = {}
        self.warnings: list[str] = []    # e.g. "the file holds no rows of this device" (device_rows.py)
        if store is not None:
            with store:
                fingerprints = [fingerprint] if fingerprint is not None else device_fingerprints(store, device)
                records = [rec for fp in fingerprints for rec in store.records(fp)]
                records.sort(key=lambda rec: rec.created_at)
                if fingerprint is None and not records:
                    fallback = "the GPU kernel model and the roofline" if device.kind == "cuda" else "the roofline"
                    warning = no_rows_warning(store, device, fallback)
                    if warning:
                        self.warnings.append(warning)
                for rec in records:  # oldest first: newer rows overwrite
                    if rec.key.op in (BLOCK_OP, COLLECTIVE_OP):  # blocks (blocks_db.py), collectives (collectives.py)
                        continue
                    if rec.key.op == HOST_OP:   # compiled-graph entry costs, not kernels (host_overheads.py)
                        self.host_records[rec.key.key_hash] = rec
                        continue
                    self._exact[rec.key.key_hash] = rec
        by_sig: dict[str, tuple[list[_Point], list[KernelRecord]]] = {}
        for rec in self._exact.values():
            point = key_point(rec.key)
            points, recs = by_sig.setdefault(point.signature, ([], []))
            points.append(point)
            recs.append(rec)
        self._groups = {sig: _Group(p, r) for sig, (p, r) in by_sig.items()}

    def __len__(self) -> int:
        return len(self._exact)

    def price(self, call: OpCall, cost: Cost) -> KernelPrice:
        """Price one call; ``cost`` (bound, no free symbols) is used only by the model-free fallback."""
        try:
            key = kernel_key(call)
        except (UnkeyableCallError, SymbolicKeyError) as exc:
            return self._fallback(call, cost, f"not keyable: {exc}")
        memo_key = (key.key_hash, getattr(self.model, "context_key", None))
        memo = self._memo.get(memo_key)
        if memo is None:
            memo = self._price_key(call, cost, key)
            self._memo[memo_key] = memo
        return memo

    def _price_key(self, call: OpCall, cost: Cost, key: KernelKey) -> KernelPrice:
        rec = self._exact.get(key.key_hash)
        if rec is not None:
            return KernelPrice(
                rec.median_ns,
                self._host_ns(rec),
                rec.workspace_bytes,
                PriceSource.MEASURED_IN_STEP if is_in_step_source(rec.source) else PriceSource.MEASURED,
                f"{rec.source} n={rec.n_runs} p10={rec.p10_ns:.0f} p90={rec.p90_ns:.0f}",
                rec.host_in_time,
            )
        point = key_point(key)
        group = self._groups.get(point.signature)
        if group is None:
            return self._fallback(call, cost, "no measured kernel with this signature")
        log_thr, nearest, why = group.interpolate(point)
        if log_thr is None:
            return self._fallback(call, cost, why)
        work = float(_prod(list(point.features)))
        near = group.records[nearest]
        time_ns = work / math.exp(log_thr)
        workspace = int(round(near.workspace_bytes * point.in_bytes / max(group.in_bytes[nearest], 1.0)))
        nearest_sizes = json.dumps(list(group.features[nearest]))
        detail = f"from {len(group.records)} rows of {key.op}; nearest sizes {nearest_sizes}"
        return KernelPrice(
            time_ns, self._host_ns(near), workspace, PriceSource.INTERPOLATED, detail, near.host_in_time
        )

    def _host_ns(self, rec: KernelRecord) -> float:
        """The row's host issue time; rows imported without one (public GPU data) take the device's."""
        return rec.host_ns if rec.host_ns > 0 else self.device.host_issue_ns

    def _fallback(self, call: OpCall, cost: Cost, why: str) -> KernelPrice:
        # a CPU convolution's oneDNN scratch (kernels_db/cpu_scratch.py) and a CPU flash attention's block
        # buffers (kernels_db/cpu_attention_scratch.py): a database measures them, else modelled
        scratch = (convolution_scratch_bytes(call) + attention_scratch_bytes(call)) if self.device.kind == "cpu" else 0
        if self.model is not None:
            time_ns = self.model(call, self.device)
            if time_ns is not None:
                return KernelPrice(float(time_ns), self.device.host_issue_ns, scratch, self.model_source, why)
        klass = op_class(call.op)
        return KernelPrice(
            roofline_ns(call, cost, self.device, klass),
            self.device.host_issue_ns,
            scratch,
            PriceSource.ROOFLINE,
            f"{klass} roofline ({why})",
        )
