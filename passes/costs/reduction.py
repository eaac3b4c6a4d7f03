"""Cost rules for reductions, scans, softmax and the classification/regression losses.

Contract: a reduction reads its input once and writes its (small) output once; its FLOPs are a
per-input-element constant (the combine step) plus a per-output-element constant (the finish):

    flops = in.numel * per_input + out.numel * per_output

===================== ========= ========== ===================================================
op                    per input per output derivation
===================== ========= ========== ===================================================
sum, prod, any, all   1         0          one combine per element (N-1 rounded to N)
mean                  1         1          sum, then one divide per output
amax/amin/max/min/arg 1         0          one compare per element
var / std (+ _mean)   3         1 (+1)     Welford: delta, mean update, M2 update; divide (+sqrt)
norm (p-norm)         2         1          |x|^p, add; final root
logsumexp             4         2          max, sub, exp, add; log, add max back
cumsum / cumprod      1         0          one combine per element (a scan)
histc / bincount      1         0          one bin increment per element
diff                  0         1          one subtraction per output element
softmax               5         0          max, sub, exp, sum, divide
log_softmax           5         0          max, sub, exp, sum, subtract log-sum
softmax backward      4         0          g*y, row sum, sub, mul: ``y * (g - sum(g*y))``
log_softmax backward  4         0          exp(y), row sum of g, mul, sub: ``g - exp(y)*sum(g)``
===================== ========= ========== ===================================================

Example::

    >>> # sum of a [4, 8] float32 over dim 1: flops 4*8 = 32; read 4*8*4 = 128 B; write 4*4 = 16 B

Known limitations:
- NB: eager softmax kernels read rows that do not fit on chip two or three times; counted once.
- NB: the two-pass var/std kernels on some backends read the input twice; counted once (Welford).
- NB: ``nll_loss`` reads only the ``target.numel`` gathered log-probabilities, not the whole input.
"""
from __future__ import annotations

from typing import Any

import torch

from boomfx.passes.costs.pointwise import (
    bytes_of, elementwise_cost, first_output, numel_of, read_all, unique_bytes, written_all,
)
from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.specs import SymExpr, TensorSpec

aten = torch.ops.aten

SOFTMAX_FLOPS = 5
SOFTMAX_BACKWARD_FLOPS = 4

# (FLOPs per input element, FLOPs per output element) for each reduction / scan (table above).
REDUCTION_FLOPS: dict[Any, tuple[int, int]] = {
    aten.sum: (1, 0), aten.nansum: (1, 0), aten.prod: (1, 0), aten.any: (1, 0), aten.all: (1, 0),
    aten.count_nonzero: (1, 0), aten.mean: (1, 1), aten.nanmean: (1, 1),
    aten.amax: (1, 0), aten.amin: (1, 0), aten.max: (1, 0), aten.min: (1, 0), aten.aminmax: (1, 0),
    aten.argmax: (1, 0), aten.argmin: (1, 0), aten.median: (1, 0), aten.mode: (1, 0),
    aten.var: (3, 1), aten.var_mean: (3, 1), aten.std: (3, 2), aten.std_mean: (3, 2),
    aten.norm: (2, 1), aten.linalg_vector_norm: (2, 1), aten.frobenius_norm: (2, 1),
    aten.logsumexp: (4, 2), aten.cumsum: (1, 0), aten.cumprod: (1, 0), aten.cummax: (1, 0),
    aten.cummin: (1, 0), aten.logcumsumexp: (4, 0),
    aten.histc: (1, 0), aten.bincount: (1, 0),   # one bin increment per element (MoE routers' expert counts)
    aten.diff: (0, 1),                           # one subtraction per output element
}


@register_cost(*REDUCTION_FLOPS, aten.cumsum_)
def reduction_cost(call: OpCall) -> Cost:
    """Table-driven reduction: input read once, outputs (values, indices, mean...) written once."""
    key = aten.cumsum if call.op.overloadpacket is aten.cumsum_ else call.op.overloadpacket
    per_in, per_out = REDUCTION_FLOPS[key]
    x = call.arg("self")
    outs = call.tensor_outputs()
    if not isinstance(x, TensorSpec):  # aten.sum.int and friends on Python lists
        return ZERO
    out_numel = outs[0].numel if outs else x.numel
    return Cost(x.numel * per_in + out_numel * per_out, read_all(call), written_all(call))


@register_cost(aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax, aten._safe_softmax)
def softmax_cost(call: OpCall) -> Cost:
    """5 FLOPs per element (table); input read once, output written once (see NB)."""
    return elementwise_cost(call, SOFTMAX_FLOPS)


@register_cost(aten._softmax_backward_data, aten._log_softmax_backward_data)
def softmax_backward_cost(call: OpCall) -> Cost:
    """4 FLOPs per element; reads grad_output and output, writes grad_input."""
    return elementwise_cost(call, SOFTMAX_BACKWARD_FLOPS)


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------

def _gathered_bytes(x: TensorSpec, target: TensorSpec) -> SymExpr:
    """Bytes of the ``target.numel`` log-probabilities an nll kernel picks out of ``x``."""
    return target.numel * x.itemsize


@register_cost(aten.nll_loss_forward, aten.nll_loss2d_forward, aten.nll_loss, aten.nll_loss_nd,
               aten.nll_loss2d)
def nll_loss_cost(call: OpCall) -> Cost:
    """``-x[i, t_i] * w[t_i]``, summed: ``target.numel`` adds (+ as many multiplies with a weight).

    Reads the target, the gathered ``x`` and ``w`` entries; writes output (+ total_weight).
    """
    x, target, weight = call.arg("self"), call.arg("target"), call.arg("weight")
    n = target.numel
    flops = n + (n if isinstance(weight, TensorSpec) else 0)
    read = unique_bytes(target) + _gathered_bytes(x, target)
    if isinstance(weight, TensorSpec):
        read = read + n * weight.itemsize
    return Cost(flops, read, written_all(call))


@register_cost(aten.nll_loss_backward, aten.nll_loss2d_backward)
def nll_loss_backward_cost(call: OpCall) -> Cost:
    """grad_input is zero-filled (full write) with ``-grad * w[t_i] / total_weight`` at ``target.numel``
    places: ``target.numel`` FLOPs (2 with a weight); reads grad, target (+ weight gathers)."""
    target, weight = call.arg("target"), call.arg("weight")
    n = target.numel
    flops = n + (n if isinstance(weight, TensorSpec) else 0)
    read = bytes_of([call.arg("grad_output"), target, call.arg("total_weight")])
    if isinstance(weight, TensorSpec):
        read = read + n * weight.itemsize
    return Cost(flops, read, written_all(call))


@register_cost(aten.cross_entropy_loss)
def cross_entropy_cost(call: OpCall) -> Cost:
    """Composite (default IR): ``log_softmax`` kernel then ``nll_loss`` kernel, as eager runs it.

    1. log_softmax: 5 FLOPs/element, reads the logits, writes the same-size log-probabilities;
    2. nll_loss: ``target.numel`` FLOPs, reads target and the gathered log-probabilities;
    3. label smoothing (``> 0``) also sums every log-probability: + numel FLOPs and a full re-read.
    NB: class-probability targets (same shape as the input) are priced like label smoothing.
    """
    x, target, out = call.arg("self"), call.arg("target"), first_output(call)
    logp_bytes = unique_bytes(x)
    flops = x.numel * SOFTMAX_FLOPS
    read, written = unique_bytes(x), logp_bytes
    dense_target = target.dtype.is_floating_point
    if dense_target or (call.arg("label_smoothing") or 0) > 0:
        flops, read = flops + 2 * x.numel, read + logp_bytes + unique_bytes(target)
    else:
        flops, read = flops + target.numel, read + unique_bytes(target) + _gathered_bytes(x, target)
    if isinstance(call.arg("weight"), TensorSpec):
        read = read + unique_bytes(call.arg("weight"))
    return Cost(flops, read, written + unique_bytes(out))


# FLOPs per element for elementwise losses: diff (1), square/abs (1), reduce add (1) ...
_ELEMENTWISE_LOSS_FLOPS: dict[Any, int] = {
    aten.mse_loss: 3, aten.l1_loss: 3, aten.smooth_l1_loss: 5, aten.huber_loss: 5,
    aten.binary_cross_entropy: 7,              # y*log(x) + (1-y)*log(1-x), reduce
    aten.binary_cross_entropy_with_logits: 9,  # log-sigmoid (5) + 4
    aten.mse_loss_backward: 3, aten.smooth_l1_loss_backward: 4,
    aten.huber_loss_backward: 4, aten.binary_cross_entropy_backward: 5,
    aten.kl_div: 4, aten.soft_margin_loss: 4,
}


@register_cost(*_ELEMENTWISE_LOSS_FLOPS)
def elementwise_loss_cost(call: OpCall) -> Cost:
    """Per input element constant (table); every input read, output (scalar or per-element) written."""
    x = call.arg("self")
    fpe = _ELEMENTWISE_LOSS_FLOPS[call.op.overloadpacket]
    return Cost(numel_of([x]) * fpe, read_all(call), written_all(call))
