"""How much slower a kernel runs inside a step than looped alone, measured on this host on a calibration
step of its own, for the CPU model (``cpu_model.CpuKernelModel``) to price a program no database holds.

Why: the probe times each kernel in a loop, where its code, its operands and its output buffer stay hot;
inside a real eager step hundreds of other kernels and the framework's Python run between two calls.
Measured on this repository's 2-vCPU VM with a dispatch mode around nine ``transformers`` models' eager
inference (SegFormer, ELECTRA, BART, Gemma-2, RegNet, MobileViT, CLIP-vision, ALBERT, ESM; 395 distinct
calls), each call in its step against the same call looped alone: median 2.5x for calls under 5 us,
1.5x at 5-10 us, 1.3x at 10-100 us, 1.07x at 100-300 us. Priced at their looped times, the no-database
predictions of such models were 20-50% under their real steps; a database collected with ``kernels
collect --for`` times the program's own kernels in its rotation (``in_step.py``) and has no such gap.

So the probe runs ``in_step.time_in_step`` over a step of its own making, a calibration program no user
model is (``calibration_program``: two pre-norm transformer stacks, tokens x width 256 x 128 and 512 x
256 and 128 x 64, and residual convolution stacks at 8x8, 16x16, 32x32 and 56x56 pixels; 167 kernels,
each layer its own weights), with the operand flow a real step has (each call reads the activation its
producer just wrote) and times the same calls looped alone (``measure_in_step_pairs``, kept in the
probe's profile); the CPU model keeps the median in-step/alone ratio of the calls in each band of looped time
(``RATIO_BANDS_NS``) at the band's geometric-mean time (``ratios_by_bound``), per what bounds the call's
looped price (``CpuKernelModel.bound``): a GEMM's or attention's rate (in the real steps above 1.11x and
1.16x summed over their calls: their blocking reuses their operands), a convolution's, special
function's or norm's rate (convolutions 1.34x, GELU 1.44x, layer norm 1.09x), or its bytes (adds 1.96x,
multiplies 2.35x, copies 1.73x: all their time is the data a step left cold). ``CpuKernelModel`` scales
a looped price by its bound's ratio at its time (log-interpolated between bands, held beyond them).
Nothing is fitted to a user's model: the nine models above only showed the gap. Checked on models the
calibration never saw (2026-12-07, same probe, no database): ``benchmarks/offsuite_cpu.py`` (20
transformers architectures, nine of them the models above, and 10 hand-written models; 60 steps,
validate's real step) median |time error| 31.9% -> 15.2%, mean -20.1% -> -7.8%; ``cpu_accuracy.py
--protocol nodb`` (14 other models, 28 steps, the nn.Module at torch's threads) 13.6% -> 4.4%, mean
-15.8% -> -0.2%.

Known limitations: one calibration program stands for every step (its kernels, sizes and the Python
between them are not the user's); the framework's Python between kernels is not in the rotation (its
effect on the caches is in the real-step ratios above, not in these); within a bound the ratio depends on
the call's time only. The ratios move with the host's state: the band of memory-bound calls of ~3 us
read 2.0-3.1x in probes taken within two hours here; at 3.1x, RWKV's per-token loop (hundreds of calls
on [4, 128] vectors, which a calibration recurrence measured at 1.2-1.6x in the step) came out +63%
inference, +79% training (``benchmarks/results/offsuite_cpu_s42_final.md``); a calibration with such
a recurrence was tried and not kept (its bands need the checks above again).
"""
from __future__ import annotations

import functools
import itertools
import math
import statistics
from typing import Callable, Optional, Sequence

import torch

from boomfx.kernels_db.in_step import time_in_step
from boomfx.kernels_db.keys import kernel_key, make_inputs
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.operands import Operand, Operands
from boomfx.passes.specs import TensorSpec, contiguous_strides

aten = torch.ops.aten
# bands of a call's looped time (ns): each band's median ratio is one point of the curve
RATIO_BANDS_NS = (5e3, 20e3, 80e3, 300e3, 1e6)
Rates = tuple[tuple[float, float], ...]
Pairs = tuple[tuple[str, float, float], ...]     # (key hash, looped ns, in-step ns) per calibration call


def _spec(*shape: int) -> TensorSpec:
    return TensorSpec(tuple(shape), contiguous_strides(tuple(shape)), torch.float32)


class _Program:
    """Calls in program order with their operands: each call reads the values named (None: a tensor of its
    own, as a layer's weights are) and writes one value of its own."""

    def __init__(self) -> None:
        self.calls: list[OpCall] = []
        self.operands: list[Operands] = []
        self._names = itertools.count()

    def call(self, op: torch._ops.OpOverload, args: tuple, out: TensorSpec, reads: Sequence[Optional[str]]) -> str:
        name = f"v{next(self._names)}"
        self.calls.append(OpCall.build(op, args, {}, (out,)))
        self.operands.append(Operands(tuple(Operand(r, r) if r else None for r in reads), (Operand(name, name),)))
        return name


def _transformer(p: _Program, tokens: int, width: int, layers: int, heads: int = 4) -> None:
    """Pre-norm transformer layers over ``tokens`` rows (a batch of 4 sequences): norm, QKV projection,
    attention, output projection, residual add, norm, MLP of 4x width with GELU, residual add."""
    t, d = tokens, width
    seq = _spec(4, heads, tokens // 4, d // heads)
    x = p.call(aten.relu.default, (_spec(t, d),), _spec(t, d), [None])
    for _ in range(layers):
        h = p.call(aten.layer_norm.default, (_spec(t, d), [d], _spec(d), _spec(d)), _spec(t, d), [x, None, None])
        p.call(aten.linear.default, (_spec(t, d), _spec(3 * d, d), _spec(3 * d)), _spec(t, 3 * d), [h, None, None])
        p.call(aten.scaled_dot_product_attention.default, (seq, seq, seq), seq, [None, None, None])
        o = p.call(aten.linear.default, (_spec(t, d), _spec(d, d), _spec(d)), _spec(t, d), [None, None, None])
        x = p.call(aten.add.Tensor, (_spec(t, d), _spec(t, d)), _spec(t, d), [x, o])
        h = p.call(aten.layer_norm.default, (_spec(t, d), [d], _spec(d), _spec(d)), _spec(t, d), [x, None, None])
        u = p.call(aten.linear.default, (_spec(t, d), _spec(4 * d, d), _spec(4 * d)), _spec(t, 4 * d), [h, None, None])
        g = p.call(aten.gelu.default, (_spec(t, 4 * d),), _spec(t, 4 * d), [u])
        o = p.call(aten.linear.default, (_spec(t, 4 * d), _spec(d, 4 * d), _spec(d)), _spec(t, d), [g, None, None])
        x = p.call(aten.add.Tensor, (_spec(t, d), _spec(t, d)), _spec(t, d), [x, o])


def _convolutional(p: _Program, pixels: int, channels: int, blocks: int) -> None:
    """Residual blocks over a batch of 4 images: 3x3 convolution, batch norm (eval), ReLU, 1x1 convolution,
    residual add."""
    x = _spec(4, channels, pixels, pixels)
    y = p.call(aten.relu.default, (x,), x, [None])
    for _ in range(blocks):
        c = p.call(aten.conv2d.default,
                   (x, _spec(channels, channels, 3, 3), _spec(channels), [1, 1], [1, 1], [1, 1], 1), x, [y, None, None])
        n = p.call(aten.batch_norm.default, (x, _spec(channels), _spec(channels), _spec(channels), _spec(channels),
                                             False, 0.1, 1e-5, True), x, [c, None, None, None, None])
        r = p.call(aten.relu.default, (x,), x, [n])
        c = p.call(aten.conv2d.default,
                   (x, _spec(channels, channels, 1, 1), _spec(channels), [1, 1], [0, 0], [1, 1], 1), x, [r, None, None])
        y = p.call(aten.add.Tensor, (x, x), x, [y, c])


def calibration_program() -> tuple[list[OpCall], list[Operands]]:
    """The calibration step's calls and their operands (module docstring)."""
    p = _Program()
    _transformer(p, 256, 128, 4)
    _convolutional(p, 16, 32, 4)
    _transformer(p, 512, 256, 2)
    _convolutional(p, 32, 32, 2)
    _transformer(p, 128, 64, 4)
    _convolutional(p, 8, 64, 4)
    _convolutional(p, 56, 64, 2)
    return p.calls, p.operands


def band_ratios(pairs: Sequence[tuple[float, float]], bands: Sequence[float] = RATIO_BANDS_NS) -> Rates:
    """``((geometric-mean looped ns, median in-step / looped ratio), ...)`` of the (looped ns, in-step ns)
    ``pairs`` in each band of looped time (edges ``bands``; an empty band is left out), by increasing time; a
    ratio below 1 (a call faster in the step than alone: noise) counts as 1."""
    edges = (0.0, *bands, math.inf)
    out = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [(alone, step) for alone, step in pairs if lo <= alone < hi and alone > 0]
        if not inside:
            continue
        centre = math.exp(statistics.fmean(math.log(alone) for alone, _ in inside))
        out.append((centre, max(1.0, statistics.median(step / alone for alone, step in inside))))
    return tuple(out)


def measure_in_step_pairs(median_ns: Callable[[Callable[[], object], int], float],
                          target_s: float = 1.0) -> Pairs:
    """Run the calibration program in the step rotation and alone (``median_ns(fn, reps)``: the probe's
    looped timer) on this host's CPU: ``((key hash, looped ns, in-step ns), ...)`` per distinct call, in
    program order. About two seconds."""
    calls, operands = calibration_program()
    times = time_in_step(calls, "cpu", target_s=target_s, operands=operands)
    pairs: list[tuple[str, float, float]] = []
    seen: set[str] = set()
    cpu = torch.device("cpu")
    with torch.no_grad():
        for index, call in enumerate(calls):
            key = kernel_key(call)
            if key.key_hash in seen or key.key_hash not in times.samples:
                continue
            seen.add(key.key_hash)
            op, args, kwargs = make_inputs(key, cpu, seed=index)
            alone = median_ns(lambda: op(*args, **kwargs), 25)
            pairs.append((key.key_hash, float(alone), float(statistics.median(times.samples[key.key_hash]))))
    return tuple(pairs)


@functools.lru_cache(maxsize=1)
def _calls_by_hash() -> dict[str, OpCall]:
    """The calibration program's calls by their key's hash (built once: ~50 ms)."""
    return {kernel_key(call).key_hash: call for call in calibration_program()[0]}


def ratios_by_bound(pairs: Pairs, bound: Callable[[OpCall], Optional[str]]) -> dict[str, Rates]:
    """The band ratios (``band_ratios``) of the measured ``pairs`` per what bounds each calibration call's
    price (``bound``: ``CpuKernelModel.bound`` over the probe's rates); calls ``pairs`` does not hold (an
    older calibration program) are left out."""
    by_hash = _calls_by_hash()
    grouped: dict[str, list[tuple[float, float]]] = {}
    for key_hash, alone, step in pairs:
        call = by_hash.get(key_hash)
        kind = bound(call) if call is not None else None
        if kind is not None:
            grouped.setdefault(kind, []).append((alone, step))
    return {kind: rates for kind, group in grouped.items() if (rates := band_ratios(group))}
