"""This host's CPU as PyTorch runs on it, measured once: what a CPU target is priced with when no kernel
database holds the kernel.

A CPU's datasheet says little about what PyTorch reaches on it: the vector width its kernels use,
turbo and a VM's share of the socket, the intra-op thread count, and the DRAM bandwidth, which nothing
the process can read states. The nominal description (``core/devices.cpu_spec``: AVX2 FMA rate x
cores, 20 GB/s assumed) priced a 2-vCPU AVX-512 host's steps 1.5-3x over. So four microbenchmarks
describe it instead, at torch's current intra-op thread count, wall clock, medians:

- **GEMM rate curve** per dtype (fp32, bf16, fp16): ``[n, n] @ [n, n]`` for n in ``GEMM_SIZES``; a
  CPU GEMM's rate climbs with its size (packing, threading and the microkernel's edges), so a call
  is priced at the rate of its FLOPs on this curve, not at the plateau;
- **attention rate curves**: causal fp32 SDPA forward and backward (the CPU flash kernels, several
  times slower per FLOP than a GEMM: blocked softmax, small tiles) by sequence length;
- **depthwise convolution curve**: 3x3 depthwise ``conv2d`` at three channel counts (far below a GEMM's
  rate per FLOP);
- **dense convolution curves**: oneDNN's 1x1 and 3x3 convolutions forward and backward, 0.1 MFLOP to
  3.7 GFLOP (``_conv_curves``): its direct kernels are not the GEMM (about twice its rate per FLOP on the
  AMD development VM) and a small call pays oneDNN's own ~40 us on top of its FLOPs;
- **pointwise bandwidth curve**: ``a + b`` into a fresh tensor (as eager ops allocate theirs), from
  L1-sized to beyond the last-level cache; a kernel moving B bytes is priced at the rate of B on this
  curve (its working set hits the cache level that size fits);
- **special-function curves**: the time of ``exp``, ``tanh``, ``gelu``, ``silu``, softmax, the norms,
  ... over 4K to 1M elements (on a CPU these are bound by the vector units, not memory, and a small call
  is dominated by its fixed costs), and for the row-wise ones (norms, softmaxes) their rate at row lengths
  64-4096 relative to 256 (each row pays a fixed cost);
- **in-step ratios**: how much slower a kernel runs inside a step than in these loops, by its looped
  time (~2x for a call of a few microseconds, ~1.35x at 40 us, ~1.1x from 130 us here), from a
  calibration step of the probe's own run in ``in_step.py``'s rotation (``in_step_calibration.py``);
- **random-number rates**: elements per second of dropout, ``bernoulli_``, ``randn``, ``rand``,
  ``randint``, ``randperm``: ATen's CPU generator draws them one at a time under its lock (2-5 ns an
  element here at any thread count, 10-60x a pointwise op's bytes), so a training step's dropouts cost
  more than the matmuls around them on a small model;
- **oneDNN's LSTM layer**: per pass (inference, training forward, backward) its cost per step and its
  FLOP rate, solved from a small and a large call (it runs its per-step GEMMs faster than a ``torch.mm``
  of their size: weights packed once, no dispatch between steps);
- **page faults**: PyTorch's CPU tensors come from glibc's malloc, which serves a block of 32 MiB or
  more (``DEFAULT_MMAP_THRESHOLD_MAX``; smaller thresholds rise to the largest block freed) with a
  fresh ``mmap`` every time: each of its pages faults on first write (~1 us per 4 KiB page on the
  2-vCPU VM, 7.7 ms for a 33 MiB ``zeros`` against 0.29 ms for 31 MiB). Measured as a fresh 64 MiB
  ``zeros`` minus refilling the same buffer, per page;
- **dispatch**: a one-element ``aten.add`` (allocating), the per-op floor of eager dispatch (the host
  time of every op); and the floors of composite ops whose one-element call costs several times that
  (``OP_FLOORS``: a convolution on each of ATen's two CPU paths, native and oneDNN, forward and
  backward (``cpu_convolution.py`` says which a call takes), batch norm's statistics, padding's fill and
  copy, SDPA's checks): a call of those ops costs at least its floor.

A step's kernel finds its operands where the step left them: a tensor is reused after about the step's
footprint of other bytes was touched (``kernels_db.measure.step_flush_bytes``, the reuse distance the CPU
collection protocol flushes by). So the GEMM and pointwise curves are measured at several cache flushes
(``FLUSH_LEVELS_MIB``: warm, and after touching 8, 32 and 128 MiB of other data) and a call is priced at
the level of its step's footprint (``footprint_bytes``: warm up to the L2, log-interpolated between
levels, held beyond the last).

Each curve point is the measured time minus the dispatch floor (it is charged once, as the op's host
time). The eager host-cost events (``host_overheads.EAGER_EVENTS``) are measured too, as the defaults of
an analysis whose database lacks them. ~1-2 s in all; cached as JSON in the user cache per CPU model,
thread count and torch version (``profile_path``); ``BOOMFX_HOST_PROBE=off`` keeps the nominal
description (deterministic, for tests that compare against it). A probe taken while other tasks kept
the CPUs busy (Linux's CPU pressure above ``BUSY_PERCENT``) is said so and measured again on the first
run that finds the host quiet.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

PROBE_ENV = "BOOMFX_HOST_PROBE"
# a probe taken while other tasks waited for a CPU this share of the time or more measured the contention,
# not the host: it is said on stderr and replaced by the first probe of a quiet host (``host_profile``).
# Idle, this VM's PSI reads 0.0-0.1%; with the test suite's 4 workers on its 2 vCPUs, 29% (2026-12-06),
# and a probe cached then priced MobileNetV2's step 37% higher (4.06 against 2.97 ms)
BUSY_PERCENT = 10.0
PROFILE_VERSION = 15
FLUSH_LEVELS_MIB = (0, 8, 32, 128)
GEMM_SIZES = (32, 64, 128, 256, 512, 1024)
GEMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GEMM_STOP_NS = 20e6           # a dtype without fast kernels here stops climbing once one call takes this
STREAM_KIB = (16, 128, 1024, 8192, 24576)   # below glibc's largest mmap threshold: reused heap chunks
MMAP_ALWAYS_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX (64-bit): larger blocks are always fresh mmaps
PAGE_BYTES = 4096
SPECIAL_ELEMENTS = 1 << 20    # 4 MiB of fp32
SPECIAL_SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, SPECIAL_ELEMENTS)   # the arithmetic-bound ops' curves
SPECIAL_ROW = 256                 # the row length the row-wise ops' curves are probed at
ROW_LENGTHS = (64, SPECIAL_ROW, 1024, 4096)
ROW_OPS = ("layer_norm", "_softmax", "_log_softmax", "native_layer_norm_backward")
ATTN_BH = 8
ATTN_SEQS = (32, 128, 512, 1024)
DEPTHWISE_CHANNELS = (32, 128, 512)      # [8, C, 28, 28] * [C, 1, 3, 3], groups=C
# [N, C, H, H] * [C, C, k, k] for k = 1, 3: oneDNN's path at every size (a batch above one), 0.1 MFLOP-3.7 GFLOP
CONV_SHAPES = ((2, 16, 8), (4, 32, 16), (4, 32, 32), (4, 64, 32), (8, 128, 28))
CONV_KERNELS = (1, 3)
LSTM_SMALL = (64, 1, 32)                 # (steps, batch, input = hidden width) of the LSTM layer probes
LSTM_LARGE = (16, 64, 256)
SPECIAL_ALIASES = {"native_layer_norm": "layer_norm", "native_batch_norm": "batch_norm",
                   "_native_batch_norm_legit_no_training": "batch_norm", "_native_batch_norm_legit": "batch_norm",
                   "max_pool2d_with_indices": "max_pool2d", "_safe_softmax": "_softmax",
                   "group_norm": "native_group_norm", "batch_norm_backward": "native_batch_norm_backward"}
FLOOR_ALIASES = {"native_layer_norm": "layer_norm", "native_batch_norm": "batch_norm",
                 "_native_batch_norm_legit_no_training": "batch_norm", "_native_batch_norm_legit": "batch_norm",
                 "max_pool2d_with_indices": "max_pool2d", "_adaptive_avg_pool2d": "adaptive_avg_pool2d",
                 "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention"}
# the same random kernels under their other aten names (functional, in-place, ``_like``)
RANDOM_ALIASES = {"bernoulli": "bernoulli_", "randn_like": "randn", "normal": "normal_",
                  "normal_functional": "normal_", "rand_like": "rand", "uniform": "rand", "uniform_": "rand",
                  "randint_like": "randint"}
_MIN_KERNEL_NS = 1.0
Curve = tuple[tuple[float, float], ...]     # ((work, kernel ns), ...) by increasing work
Levels = tuple[tuple[int, Curve], ...]      # ((flush bytes, curve), ...) by increasing flush
Rates = tuple[tuple[float, float], ...]     # ((x, rate), ...) by increasing x


@dataclass(frozen=True)
class HostProfile:
    """Measured rates of this host at ``threads`` intra-op threads (see the module docstring)."""

    threads: int
    cpu: str
    torch_version: str
    dispatch_ns: float
    l2_bytes: int
    gemm: Mapping[str, Levels]           # dtype -> flush level -> (FLOPs, ns) by size
    stream: Levels                       # flush level -> (bytes read + written, ns) by size
    special_elements_per_s: Mapping[str, float]    # aten op name -> elements/s (at SPECIAL_ELEMENTS)
    attention: Rates                     # (keys, FLOP/s) of a causal forward
    attention_backward: Rates
    depthwise_conv: Curve                # (FLOPs, ns) of a 3x3 depthwise convolution
    page_fault_ns: float                 # per 4 KiB page of a fresh mmap, on first write
    op_floors_ns: Mapping[str, float]    # aten op name -> its one-element call (dispatch included)
    host_costs: Mapping[str, float] = field(default_factory=dict)   # host_overheads.EAGER_EVENTS -> ns
    # oneDNN's LSTM layer: pass ("forward", "forward_train", "backward") -> (ns per step, FLOP/s)
    lstm_layer: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # oneDNN's dense convolutions: "forward@1x1", "forward@3x3", "backward@1x1", "backward@3x3" -> (FLOPs,
    # ns) by size, the call's fixed cost included (``conv_curve``)
    conv: Mapping[str, Curve] = field(default_factory=dict)
    # arithmetic-bound ops: aten op name -> (elements, kernel ns) at SPECIAL_SIZES; the row-wise ones' rate at
    # each row length over their rate at SPECIAL_ROW (``CpuKernelModel.special_rate``)
    special_curves: Mapping[str, Curve] = field(default_factory=dict)
    row_factors: Mapping[str, Rates] = field(default_factory=dict)
    # (key hash, looped ns, in-step ns) of each call of the calibration step (``in_step_calibration.py``):
    # how much slower a kernel runs inside a step than looped (the CPU model's in-step ratios)
    in_step: tuple[tuple[str, float, float], ...] = ()
    measured_at: str = ""
    busy_percent: Optional[float] = None   # the host's CPU pressure while measured (cpu_pressure_percent)

    @property
    def measured_busy(self) -> bool:
        return _busy(self.busy_percent)

    def gemm_rate(self, dtype: str, flops: float, footprint_bytes: Optional[float] = None) -> float:
        """FLOP/s of a GEMM of ``flops`` in a step of ``footprint_bytes`` (None: warm; fp32's curves for
        dtypes not probed)."""
        return self._at_level(self.gemm.get(dtype) or self.gemm["float32"], flops, footprint_bytes)

    def stream_rate(self, nbytes: float, footprint_bytes: Optional[float] = None) -> float:
        """Bytes/s of a kernel moving ``nbytes`` (read + written) in a step of ``footprint_bytes``."""
        return self._at_level(self.stream, nbytes, footprint_bytes)

    def attention_rate(self, keys: float, backward: bool) -> float:
        """FLOP/s of a fused SDPA forward (backward) kernel over ``keys`` keys per query (the CPU flash
        kernel's blocks: short sequences run far below long ones, whatever the batch x heads)."""
        return _interp(self.attention_backward if backward else self.attention, keys)

    def _at_level(self, levels: Levels, x: float, footprint: Optional[float]) -> float:
        """The rate at ``x`` on each level's curve, interpolated in log(flush) at the footprint: a footprint
        within the L2 is warm (level 0), beyond the largest level that level's."""
        rates = [(max(flush, self.l2_bytes), _rate_at(curve, x)) for flush, curve in levels]
        if footprint is None or footprint <= rates[0][0] or len(rates) == 1:
            return rates[0][1]
        for (f0, r0), (f1, r1) in zip(rates, rates[1:]):
            if footprint <= f1:
                t = (math.log(footprint) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return r0 + t * (r1 - r0)
        return rates[-1][1]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "version": PROFILE_VERSION}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Optional["HostProfile"]:
        d = json.loads(text)
        if d.pop("version", None) != PROFILE_VERSION:
            return None
        d["gemm"] = {k: _levels(v) for k, v in d["gemm"].items()}
        d["stream"] = _levels(d["stream"])
        for name in ("attention", "attention_backward", "depthwise_conv"):
            d[name] = _curve(d[name])
        d["lstm_layer"] = {k: (float(step), float(rate)) for k, (step, rate) in d.get("lstm_layer", {}).items()}
        d["conv"] = {k: _curve(v) for k, v in d.get("conv", {}).items()}
        d["special_curves"] = {k: _curve(v) for k, v in d.get("special_curves", {}).items()}
        d["row_factors"] = {k: _curve(v) for k, v in d.get("row_factors", {}).items()}
        d["in_step"] = tuple((str(h), float(alone), float(step)) for h, alone, step in d.get("in_step", ()))
        return cls(**d)


def _curve(points: list) -> Curve:
    return tuple((float(x), float(ns)) for x, ns in points)


def _levels(levels: list) -> Levels:
    return tuple((int(flush), _curve(curve)) for flush, curve in levels)


def _rate_at(points: Curve, x: float) -> float:
    """The rate (work / time) at ``x``, linear in log(x) between the probe's points and held at the ends
    (a smaller call runs no faster than the smallest probe, a larger no faster than the largest)."""
    return _interp(tuple((px, px / (ns / 1e9)) for px, ns in points), x)


def _interp(points: Rates, x: float) -> float:
    """``y`` at ``x``: linear in log(x) between points, held beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


def _median_ns(fn: Callable[[], object], reps: int, budget_ns: float = 60e6,
               flush: Optional[torch.Tensor] = None) -> float:
    """Median wall time of ``fn`` after two warm-ups: ``reps`` samples, fewer (at least 3) past ``budget_ns``;
    with ``flush``, that buffer is rewritten before each sample (untimed)."""
    fn()
    fn()
    samples: list[float] = []
    while len(samples) < reps and (len(samples) < 3 or sum(samples) < budget_ns):
        if flush is not None:
            flush.add_(1.0)
        t0 = time.perf_counter_ns()
        fn()
        samples.append(float(time.perf_counter_ns() - t0))
    return statistics.median(samples)


def _flush_buffers() -> list[tuple[int, Optional[torch.Tensor]]]:
    return [(mib << 20, torch.zeros((mib << 20) // 4) if mib else None) for mib in FLUSH_LEVELS_MIB]


def _kernel_ns(total_ns: float, dispatch: float) -> float:
    return max(total_ns - dispatch, _MIN_KERNEL_NS)


def _dispatch_ns() -> float:
    """A one-element ``aten.add.Tensor`` through the dispatcher, allocating its output as eager ops do."""
    x, y = torch.ones(1), torch.ones(1)
    add = torch.ops.aten.add.Tensor
    loops = 200

    def run() -> None:
        for _ in range(loops):
            add(x, y)
    return _median_ns(run, 15) / loops


def _gemm_levels(dtype: torch.dtype, dispatch: float, flushes: list) -> Levels:
    """Up the sizes until one call takes ``GEMM_STOP_NS``; a dtype that stops early (no fast kernels here:
    fp16 on most CPUs) is measured warm only and its larger calls priced at its last rate."""
    levels = []
    for flush_bytes, flush in flushes:
        points = []
        for n in GEMM_SIZES:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            ns = _median_ns(lambda: torch.ops.aten.mm(a, b), 15 if flush is None else 9, flush=flush)
            points.append((2.0 * n ** 3, _kernel_ns(ns, dispatch)))
            if ns > GEMM_STOP_NS:
                break
        levels.append((flush_bytes, tuple(points)))
        if len(points) < len(GEMM_SIZES):
            break
    return tuple(levels)


def _stream_levels(dispatch: float, flushes: list) -> Levels:
    """``a + b`` into a fresh tensor (large outputs are fresh pages the kernel faults in, as in a step)."""
    levels = []
    for flush_bytes, flush in flushes:
        points = []
        for kib in STREAM_KIB:
            a, b = torch.ones(kib * 128), torch.ones(kib * 128)
            ns = _median_ns(lambda: torch.ops.aten.add(a, b), 25 if flush is None else 11, flush=flush)
            points.append((3.0 * a.numel() * 4, _kernel_ns(ns, dispatch)))
        levels.append((flush_bytes, tuple(points)))
    return tuple(levels)


def _image_shape(n: int) -> tuple[int, int, int, int]:
    """The ``[N, 64, H, H]`` image of ``n`` fp32 elements the image ops are probed on (H = 8, 16 or 32)."""
    side = 32 if n >= SPECIAL_ELEMENTS else 16 if n >= 1 << 14 else 8
    return (n // (64 * side * side), 64, side, side)


def _special_calls(n: int, row: int = SPECIAL_ROW) -> dict[str, Callable[[], object]]:
    """The probe's call of each arithmetic-bound op over ``n`` fp32 elements: special functions over a vector,
    softmaxes and layer norms over rows of ``row``, batch norm, group norm and 3x3 max pooling over
    ``_image_shape(n)``."""
    aten = torch.ops.aten
    x = torch.rand(n) - 0.5
    positive = x.abs() + 1.0
    rows = x.view(-1, row)
    ones, zeros = torch.ones(row), torch.zeros(row)
    image = x.view(_image_shape(n))
    batch, channels, hw = image.shape[0], image.shape[1], image.shape[2] * image.shape[3]
    scale, shift = torch.ones(channels), torch.zeros(channels)
    running_mean, running_var = torch.zeros(channels), torch.ones(channels)
    grad_image = torch.rand_like(image)       # a backward reads its gradient and its input: two tensors
    _, group_mean, group_rstd = aten.native_group_norm(image, scale, shift, batch, channels, hw, 8, 1e-5)
    _, row_mean, row_rstd = aten.native_layer_norm(rows, [row], ones, zeros, 1e-5)
    return {
        "exp": lambda: aten.exp(x), "tanh": lambda: aten.tanh(x), "sigmoid": lambda: aten.sigmoid(x),
        "silu": lambda: aten.silu(x), "gelu": lambda: aten.gelu(x), "erf": lambda: aten.erf(x),
        # GELU's tanh approximation (gelu_pytorch_tanh: GPT-BigCode, Gemma, StarCoder2) is another kernel,
        # ~5x slower per element than the erf one here; the backward kernels are bound alike
        "gelu@tanh": lambda: aten.gelu(x, approximate="tanh"), "gelu_backward": lambda: aten.gelu_backward(x, x),
        "gelu_backward@tanh": lambda: aten.gelu_backward(x, x, approximate="tanh"),
        "silu_backward": lambda: aten.silu_backward(x, x),
        "log": lambda: aten.log(positive), "sin": lambda: aten.sin(x), "cos": lambda: aten.cos(x),
        "sqrt": lambda: aten.sqrt(positive), "rsqrt": lambda: aten.rsqrt(positive),
        "_softmax": lambda: aten._softmax(rows, -1, False),
        "_log_softmax": lambda: aten._log_softmax(rows, -1, False),
        "layer_norm": lambda: aten.layer_norm(rows, [row], ones, zeros),
        "batch_norm": lambda: aten.batch_norm(image, scale, shift, scale, shift, False, 0.1, 1e-5, True),
        # in training mode ATen's CPU kernel also collects the batch's statistics: ~10x slower per element
        # here than the eval transform (1.7 against 19.5 G elements/s), the same at every size measured
        "batch_norm@train": lambda: aten.batch_norm(image, scale, shift, running_mean, running_var, True, 0.1,
                                                    1e-5, True),
        "max_pool2d": lambda: aten.max_pool2d(image, [3, 3], [1, 1], [1, 1]),
        # the norms' other CPU kernels bound by their arithmetic, not their bytes (alone here: group norm
        # 9-10, its backward and batch norm's 7-9, layer norm's backward 5-7 G elements/s at every size tried,
        # where their bytes priced them 20-50% under)
        "native_group_norm": lambda: aten.native_group_norm(image, scale, shift, batch, channels, hw, 8, 1e-5),
        "native_group_norm_backward": lambda: aten.native_group_norm_backward(
            grad_image, image, group_mean, group_rstd, scale, batch, channels, hw, 8, [True, True, True]),
        "native_batch_norm_backward": lambda: aten.native_batch_norm_backward(
            grad_image, image, scale, running_mean, running_var, scale, scale, True, 1e-5, [True, True, True]),
        "native_layer_norm_backward": lambda: aten.native_layer_norm_backward(
            grad_image.view(-1, row), rows, [row], row_mean, row_rstd, ones, zeros, [True, True, True])}


def _special_curves(dispatch: float) -> dict[str, Curve]:
    """``{op: ((elements, kernel ns), ...)}`` of every ``_special_calls`` op at ``SPECIAL_SIZES`` elements.
    Why a curve, not one rate: a call's fixed costs (its parallel region, a norm's per-row setup) are a
    large share of a small call's time; priced at the 1M-element rate alone, GELU over 4K elements came out
    -78%, exp over 64K -63%, a layer norm's backward over [256, 128] -48% here
    (``benchmarks/results/cpu_special_shapes_before.md``)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for n in SPECIAL_SIZES:
        for name, fn in _special_calls(n).items():
            ns = _median_ns(fn, 15 if n >= 1 << 18 else 31)
            points.setdefault(name, []).append((float(n), _kernel_ns(ns, dispatch)))
    curves = {name: tuple(p) for name, p in points.items()}
    for alias, name in SPECIAL_ALIASES.items():       # the same kernels under their training export's names
        curves[alias] = curves[name]
    return curves


def _row_factors(dispatch: float) -> dict[str, Rates]:
    """``{op: ((row length, rate over the rate at SPECIAL_ROW), ...)}`` of the row-wise ops (``ROW_OPS``)
    over ``SPECIAL_ELEMENTS`` elements: a norm or softmax pays a fixed cost per row, so short rows run
    slower per element (a layer norm over rows of 64 ~1.6x slower than over 256 here, over 1024 ~1.3x
    faster)."""
    ns = {row: {name: _kernel_ns(_median_ns(fn, 15), dispatch)
                for name, fn in _special_calls(SPECIAL_ELEMENTS, row).items() if name in ROW_OPS}
          for row in ROW_LENGTHS}
    out = {name: tuple((float(row), ns[SPECIAL_ROW][name] / ns[row][name]) for row in ROW_LENGTHS)
           for name in ROW_OPS}
    for alias, name in SPECIAL_ALIASES.items():
        if name in out:
            out[alias] = out[name]
    return out


def _special_rates(curves: Mapping[str, Curve], dispatch: float) -> dict[str, float]:
    """Elements/s of each arithmetic-bound op at ``SPECIAL_ELEMENTS`` (its curve's plateau; what the model's
    composite prices, an attention's softmax or an LSTM's gates, read), with the random draws'."""
    rates = {name: _rate_at(curve, float(SPECIAL_ELEMENTS)) for name, curve in curves.items()}
    rates.update(_random_rates(dispatch))
    return rates


def _random_rates(dispatch: float) -> dict[str, float]:
    """Elements/s of the ops that draw random numbers, counted as ``CpuKernelModel.special_rate`` counts an
    op's work (the elements of all its tensor outputs: ``native_dropout``'s output and mask are 2 N), over
    ``SPECIAL_ELEMENTS``; the kernels' other names share their rate (``RANDOM_ALIASES``)."""
    aten = torch.ops.aten
    n = SPECIAL_ELEMENTS
    x = torch.randn(n)
    mask = x > 0
    calls: dict[str, tuple[int, Callable[[], object]]] = {
        "bernoulli_": (n, lambda: torch.empty(n).bernoulli_(0.9)),
        "dropout": (n, lambda: aten.dropout(x, 0.1, True)),
        "native_dropout": (2 * n, lambda: aten.native_dropout(x, 0.1, True)),
        "native_dropout_backward": (n, lambda: aten.native_dropout_backward(x, mask, 1.0 / 0.9)),
        "randn": (n, lambda: torch.randn(n)), "normal_": (n, lambda: x.normal_()),
        "rand": (n, lambda: torch.rand(n)), "randint": (n, lambda: torch.randint(0, 1000, (n,))),
        "randperm": (n, lambda: torch.randperm(n))}
    rates = {name: elements / (_kernel_ns(_median_ns(fn, 7), dispatch) / 1e9) for name, (elements, fn) in calls.items()}
    for alias, name in RANDOM_ALIASES.items():
        rates[alias] = rates[name]
    return rates


def _attention_rates(dispatch: float, backward: bool) -> Rates:
    """Causal fp32 SDPA ``[ATTN_BH / 4, 4, S, 64]`` for S in ``ATTN_SEQS``: (S, FLOP/s), FLOPs as
    ``passes/costs/attention.py`` counts them (forward ``4 BH pairs E``, backward ``10 BH pairs E``)."""
    import torch.nn.functional as F
    points = []
    for s in ATTN_SEQS:
        q, k, v = (torch.randn(ATTN_BH // 4, 4, s, 64, requires_grad=backward) for _ in range(3))
        pairs = s * (s + 1) / 2

        def forward() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            grad = torch.randn(ATTN_BH // 4, 4, s, 64)
            both = _median_ns(lambda: torch.autograd.grad(forward(), (q, k, v), grad), 9)
            ns, flops = both - _median_ns(forward, 9), 10.0 * ATTN_BH * pairs * 64
        else:
            with torch.no_grad():
                ns = _median_ns(forward, 15)
            flops = 4.0 * ATTN_BH * pairs * 64
        points.append((float(s), flops / (_kernel_ns(ns, dispatch) / 1e9)))
    return tuple(points)


def _depthwise_curve(dispatch: float) -> Curve:
    """3x3 depthwise convolutions (MobileNet's, ConvNeXt's kind): oneDNN runs them far below a GEMM's
    rate per FLOP (one multiply-add per weight per pixel, no reuse across channels)."""
    points = []
    for c in DEPTHWISE_CHANNELS:
        x, w = torch.randn(8, c, 28, 28), torch.randn(c, 1, 3, 3)
        ns = _median_ns(lambda: torch.ops.aten.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], c), 15)
        points.append((2.0 * 8 * c * 28 * 28 * 9, _kernel_ns(ns, dispatch)))
    return tuple(points)


def raise_mmap_threshold() -> None:
    """Free a fresh 31 MiB block: glibc raises its mmap threshold to a freed mapped block's size (at most
    32 MiB), so the outputs of the probes after it come from the heap, not from a fresh mapping that faults
    at every call (the step's faults are ``Analysis``'s to charge, from ``boomfx/memory/glibc_heap.py``)."""
    block = torch.empty((31 << 20) // 4)
    block[-1] = 0.0
    del block


def _conv_curves(dispatch: float) -> dict[str, Curve]:
    """oneDNN's dense convolutions, 1x1 and 3x3, forward and backward (input and weight gradients, what
    autograd asks of a hidden convolution without bias) at ``CONV_SHAPES``: ``{"forward@3x3": ((FLOPs, ns),
    ...), ...}``. Why their own curves: oneDNN's direct kernels reach ~2x the fp32 GEMM's rate per FLOP on
    large convolutions on the AMD development VM (~450 against ~215 GFLOP/s: MKL's GEMM runs its AVX2 code
    there, oneDNN its AVX-512 JIT), while a small convolution pays ~40 us of oneDNN's own per call (primitive
    lookup, layout reorders) on top of its FLOPs, where a GEMM-rate price or the one-element floor alone
    priced regnet-sized convolutions at half their time."""
    aten = torch.ops.aten
    raise_mmap_threshold()
    curves: dict[str, Curve] = {}
    for k in CONV_KERNELS:
        forward, backward = [], []
        for n, c, h in CONV_SHAPES:
            x, w, g = torch.randn(n, c, h, h), torch.randn(c, c, k, k), torch.randn(n, c, h, h)
            pad = [k // 2, k // 2]
            flops = 2.0 * n * c * c * k * k * h * h
            ns = _median_ns(lambda: aten.convolution(x, w, None, [1, 1], pad, [1, 1], False, [0, 0], 1), 7)
            forward.append((flops, _kernel_ns(ns, dispatch)))
            ns = _median_ns(lambda: aten.convolution_backward(g, x, w, None, [1, 1], pad, [1, 1], False, [0, 0], 1,
                                                              [True, True, False]), 7)
            backward.append((2.0 * flops, _kernel_ns(ns, dispatch)))
        curves[f"forward@{k}x{k}"], curves[f"backward@{k}x{k}"] = tuple(forward), tuple(backward)
    return curves


def _lstm_layer_rates(dispatch: float) -> dict[str, tuple[float, float]]:
    """oneDNN's LSTM layer (``mkldnn_rnn_layer``, what eager runs per ``nn.LSTM`` layer on a CPU) as ``ns =
    steps x ns_per_step + FLOPs / rate``, solved from two calls per pass: ``LSTM_SMALL`` (its per-step
    cost shows) and ``LSTM_LARGE`` (its rate shows); FLOPs as ``passes/costs/recurrent.py`` counts them.
    Passes: inference, the training forward (``train=True``: it writes the workspace its backward reads),
    the backward (autograd's, inputs' and weights' gradients)."""
    from boomfx.passes.costs.recurrent import CELL_FLOPS_PER_UNIT, LSTM_GATES
    aten = torch.ops.aten
    samples: dict[str, list[tuple[int, float, float]]] = {"forward": [], "forward_train": [], "backward": []}
    for steps, batch, width in (LSTM_SMALL, LSTM_LARGE):
        gates = LSTM_GATES * width
        x = torch.randn(steps, batch, width, requires_grad=True)
        weights = [torch.randn(gates, width, requires_grad=True) * 0.1, torch.randn(gates, width) * 0.1,
                   torch.randn(gates), torch.randn(gates)]
        state = torch.zeros(1, batch, width)
        products = 2.0 * steps * batch * 2 * width * gates
        cell = CELL_FLOPS_PER_UNIT * steps * batch * width

        def layer(train: bool) -> tuple:
            return aten.mkldnn_rnn_layer(x, *weights, state, state, False, [], 2, width, 1, True, False, False, train)

        with torch.no_grad():
            samples["forward"].append((steps, products + cell, _kernel_ns(_median_ns(lambda: layer(False), 7),
                                                                           dispatch)))
        samples["forward_train"].append((steps, products + cell, _kernel_ns(_median_ns(lambda: layer(True), 7),
                                                                             dispatch)))
        y = layer(True)[0]
        grad = torch.ones_like(y)
        leaves = [x, weights[0]]
        ns = _median_ns(lambda: torch.autograd.grad(y, leaves, grad, retain_graph=True), 7)
        samples["backward"].append((steps, 2 * products + cell, _kernel_ns(ns, dispatch)))
    rates = {}
    for name, ((t0, f0, ns0), (t1, f1, ns1)) in samples.items():
        # ns = t * step + f / rate, two equations; a negative solution means noise: no per-step term
        per_flop = (ns1 * t0 - ns0 * t1) / (f1 * t0 - f0 * t1)
        step = (ns0 - f0 * per_flop) / t0
        if per_flop <= 0 or step < 0:
            step, per_flop = 0.0, ns1 / f1
        rates[name] = (step, 1e9 / per_flop)
    return rates


def _op_floors() -> dict[str, float]:
    """The one-element (or smallest legal) call of each composite op whose fixed cost exceeds a pointwise
    op's dispatch, through the aten op as eager code calls it."""
    aten = torch.ops.aten
    x1, v1 = torch.ones(1, 1, 1, 1), torch.ones(1)
    w1 = torch.ones(1, 1, 1, 1)
    row, q = torch.ones(1, 1), torch.ones(1, 1, 1, 8)
    ids = torch.zeros(1, dtype=torch.long)
    calls: dict[str, Callable[[], object]] = {
        "conv2d": lambda: aten.conv2d(x1, w1), "convolution": lambda: aten.convolution(
            x1, w1, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        "batch_norm": lambda: aten.batch_norm(x1, v1, v1, v1, v1, False, 0.1, 1e-5, True),
        "layer_norm": lambda: aten.layer_norm(row, [1], v1, v1),
        "pad": lambda: aten.pad(x1, [1, 1, 1, 1]), "constant_pad_nd": lambda: aten.constant_pad_nd(x1, [1, 1, 1, 1]),
        "max_pool2d": lambda: aten.max_pool2d(x1, [1, 1]),
        "adaptive_avg_pool2d": lambda: aten.adaptive_avg_pool2d(x1, [1, 1]),
        "linear": lambda: aten.linear(row, row, v1), "addmm": lambda: aten.addmm(v1, row, row),
        "mm": lambda: aten.mm(row, row), "bmm": lambda: aten.bmm(row[None], row[None]),
        "scaled_dot_product_attention": lambda: aten.scaled_dot_product_attention(q, q, q),
        "embedding": lambda: aten.embedding(row, ids), "index": lambda: aten.index(v1, [ids]),
        "cat": lambda: aten.cat([v1, v1]), "masked_fill": lambda: aten.masked_fill(v1, v1 > 0, 0.0),
        "roll": lambda: aten.roll(v1, [1], [0]), "_softmax": lambda: aten._softmax(row, -1, False),
        "clone": lambda: aten.clone(v1), "mean": lambda: aten.mean(row, [-1]), "sum": lambda: aten.sum(row, [-1]),
    }
    # the oneDNN path of a convolution (kernels_db/cpu_convolution.py: a batch of two takes it) and both
    # paths' backward; oneDNN's backward runs a primitive per gradient of input and weight
    x2 = torch.ones(2, 1, 1, 1)
    grad1, grad2 = torch.ones(1, 1, 1, 1), torch.ones(2, 1, 1, 1)

    def backward(x: torch.Tensor, grad: torch.Tensor, mask: list[bool]) -> object:
        return aten.convolution_backward(grad, x, w1, [1], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, mask)

    calls.update({
        "conv2d@onednn": lambda: aten.conv2d(x2, w1),
        "convolution@onednn": lambda: aten.convolution(x2, w1, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        "convolution_backward": lambda: backward(x1, grad1, [True, True, True]),
        "convolution_backward@onednn": lambda: backward(x2, grad2, [True, True, True]),
        "convolution_backward@onednn_one": lambda: backward(x2, grad2, [False, True, True]),
    })
    loops = 20
    floors = {}
    for name, fn in calls.items():
        def run(fn: Callable[[], object] = fn) -> None:
            for _ in range(loops):
                fn()
        floors[name] = _median_ns(run, 9) / loops
    for alias, name in FLOOR_ALIASES.items():
        floors[alias] = floors[name]
    return floors


def _page_fault_ns() -> float:
    n = (2 * MMAP_ALWAYS_BYTES) // 4
    reused = torch.empty(n)
    fresh = _median_ns(lambda: torch.zeros(n), 9)
    refill = _median_ns(lambda: reused.zero_(), 9)
    return max(fresh - refill, 0.0) / (2 * MMAP_ALWAYS_BYTES / PAGE_BYTES)


def cpu_pressure_percent() -> Optional[float]:
    """The share of the last 10 s in which a runnable task waited for a CPU on this host (Linux PSI,
    ``/proc/pressure/cpu`` "some avg10"); None where the kernel does not report it."""
    try:
        with open("/proc/pressure/cpu", encoding="utf-8") as fh:
            return psi_some_avg10(fh.read())
    except OSError:
        return None


def psi_some_avg10(text: str) -> Optional[float]:
    """``avg10`` of the ``some`` line of a PSI file (``some avg10=29.23 avg60=7.62 avg300=2.43 total=...``)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            try:
                return float(dict(f.split("=", 1) for f in fields[1:] if "=" in f)["avg10"])
            except (KeyError, ValueError):
                return None
    return None


def measure_host_profile(with_host_costs: bool = True) -> HostProfile:
    """Run the probes at torch's current intra-op thread count (a few seconds); ``busy_percent``: the CPU
    pressure over them (the larger of before and after: PSI averages the last 10 s)."""
    before = cpu_pressure_percent()
    from boomfx.kernels_db.measure import _cpu_model
    dispatch = _dispatch_ns()
    costs: dict[str, float] = {}
    if with_host_costs:
        from boomfx.kernels_db.host_overheads import measure_host_costs
        from boomfx.kernels_db.measure import Measurer
        costs = {e: m.median_ns for e, m in measure_host_costs(Measurer("cpu", cpu_clock="wall"), pairs=30,
                                                                 compiled=False).items()}
    from boomfx.kernels_db.measure import l2_cache_bytes
    flushes = _flush_buffers()
    special = _special_curves(dispatch)
    profile = HostProfile(
        threads=torch.get_num_threads(), cpu=_cpu_model(), torch_version=torch.__version__, dispatch_ns=dispatch,
        l2_bytes=l2_cache_bytes(), gemm={name: _gemm_levels(dt, dispatch, flushes) for name, dt in GEMM_DTYPES.items()},
        stream=_stream_levels(dispatch, flushes), special_elements_per_s=_special_rates(special, dispatch),
        attention=_attention_rates(dispatch, False), attention_backward=_attention_rates(dispatch, True),
        depthwise_conv=_depthwise_curve(dispatch), page_fault_ns=_page_fault_ns(), op_floors_ns=_op_floors(),
        host_costs=costs, lstm_layer=_lstm_layer_rates(dispatch) if torch.backends.mkldnn.is_available() else {},
        special_curves=special, row_factors=_row_factors(dispatch), measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    if torch.backends.mkldnn.is_available():
        profile = replace(profile, conv=_conv_curves(dispatch))    # it raises glibc's mmap threshold
    raise_mmap_threshold()          # the calibration step's outputs from the heap, as a running step's
    from boomfx.kernels_db.in_step_calibration import measure_in_step_pairs
    profile = replace(profile, in_step=measure_in_step_pairs(_median_ns))
    readings = [p for p in (before, cpu_pressure_percent()) if p is not None]
    return replace(profile, busy_percent=max(readings)) if readings else profile


def profile_path(env: Optional[Mapping[str, str]] = None) -> Path:
    """``<user cache>/boomfx/host-<cpu>-t<threads>-torch<version>.json`` (next to the kernel databases)."""
    import re
    from boomfx.kernels_db.measure import _cpu_model
    from boomfx.kernels_db.store import default_db_path
    slug = re.sub(r"[^a-z0-9]+", "-", f"{_cpu_model()}-t{torch.get_num_threads()}-torch{torch.__version__}".lower())
    return default_db_path("cpu", env).parent / f"host-{slug.strip('-')}.json"


_LOADED: dict[Path, HostProfile] = {}


def _busy(pressure_percent: Optional[float]) -> bool:
    return pressure_percent is not None and pressure_percent > BUSY_PERCENT


def probing_enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if env is None else env
    return env.get(PROBE_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def host_profile(env: Optional[Mapping[str, str]] = None) -> Optional[HostProfile]:
    """This host's profile: cached in memory and in the user cache, measured on first use (a line on
    stderr says so), and again when the cached one was taken on a busy host and this one is quiet (a
    probe taken busy says so); None when probing is off."""
    if not probing_enabled(env):
        return None
    path = profile_path(env)
    hit = _LOADED.get(path)
    if hit is not None:
        return hit
    profile = None
    if path.exists():
        try:
            profile = HostProfile.from_json(path.read_text())
        except (ValueError, TypeError, KeyError):
            profile = None
    if profile is not None and profile.measured_busy and not _busy(cpu_pressure_percent()):
        sys.stderr.write(f"[boomfx] the cached CPU probe was taken while this host was busy "
                         f"({profile.busy_percent:.0f}% CPU pressure); measuring it again now that it is quiet\n")
        profile = None
    if profile is None:
        sys.stderr.write(f"[boomfx] measuring this CPU once ({torch.get_num_threads()} threads; cached in {path})\n")
        profile = measure_host_profile()
        if profile.measured_busy:
            sys.stderr.write(f"[boomfx] other tasks waited for a CPU {profile.busy_percent:.0f}% of the time while "
                             "it was measured: its rates may be low, and the next run on a quiet host measures "
                             "it again\n")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(profile.to_json())
            os.replace(tmp, path)
        except OSError as exc:     # a read-only cache: this process keeps its own measurement
            sys.stderr.write(f"[boomfx] could not cache the CPU probe in {path}: {exc}\n")
    _LOADED[path] = profile
    return profile
