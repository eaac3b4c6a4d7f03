"""Cost rules for normalisation layers: layer norm, RMS norm, batch norm, group norm (+ backward).

FLOPs per input element (one add/mul/sub = 1; the per-row/per-channel ``rsqrt`` and divides are
a vanishing fraction and are not counted):

================================ ====== ===================================================
kernel                           FLOPs  derivation
================================ ====== ===================================================
layer norm forward               5 +1+1 mean add; x-mean; square, add (var); * rstd; (+ *w) (+ +b)
layer norm backward, grad_input  9 +1   xhat (2); sum(gw) (1); sum(gw*xhat) (2);
                                        rstd * (gw - mean(gw) - xhat*mean(gw*xhat)) (4); (+ gw = g*w)
layer norm backward, grad_w / b  4 / 1  xhat recomputed (2), g*xhat, add / add
rms norm forward                 3 +1   square, add; * rstd; (+ *w)
rms norm backward, grad_input    7 +1   sum(gw*x) (2); rstd*(gw - x*rstd^2*mean(gw*x)) (5); (+ g*w)
rms norm backward, grad_w        3      x * rstd * g, add
batch/group norm stats pass      3      Welford: delta, mean update, M2 update
batch/group norm transform       4      (x - mean) * invstd * w + b
batch/group norm backward        9      xhat (2); sum(g) (1); sum(g*xhat) (2); combine (4)
batch norm backward, eval        1      g * (invstd * w), scale folded per channel
================================ ====== ===================================================

Bytes: layer/RMS norm kernels read each row once (it fits on chip) and write the output plus the
per-row statistics. NB: batch and group norm in training run two kernels, a statistics pass and a
transform pass, so the input is read twice; their backward likewise reads ``grad_out`` and the
input once for the reductions and once more for ``grad_input``. NB: the layer-norm backward
runs separate kernels for ``grad_input`` and for ``grad_weight``/``grad_bias``; each reads
``grad_out`` and the input. In-place running-statistic updates (``running_mean/var``) are
read and written.

Example::

    >>> # native_layer_norm of [4, 8] float32 with weight and bias:
    >>> # flops (5+1+1)*4*8 = 224; read 128 + 32 + 32 = 192 B; write 128 + 16 + 16 = 160 B

Known limitations:
- NB: composite ``layer_norm``/``batch_norm``/``group_norm``/``rms_norm`` (default export IR) are
  priced as the fused kernel they dispatch to on GPU.
- NB: Welford costs slightly more than 3 FLOPs per element (a divide per update); counted as 3.
"""
from __future__ import annotations

from typing import Any

import torch

from boomfx.passes.costs.pointwise import bytes_of, read_all, unique_bytes, written_all
from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.specs import TensorSpec

aten = torch.ops.aten

LN_FWD_FLOPS = 5
LN_BWD_INPUT_FLOPS = 9
LN_BWD_WEIGHT_FLOPS = 4
LN_BWD_BIAS_FLOPS = 1
RMS_FWD_FLOPS = 3
RMS_BWD_INPUT_FLOPS = 7
RMS_BWD_WEIGHT_FLOPS = 3
STATS_FLOPS = 3
TRANSFORM_FLOPS = 4
NORM_BWD_FLOPS = 9
BN_EVAL_BWD_FLOPS = 1


def _is_tensor(value: Any) -> bool:
    return isinstance(value, TensorSpec)


def _mask(call: OpCall, n: int) -> list[bool]:
    mask = call.arg("output_mask")
    return list(mask) if mask is not None else [True] * n


# ---------------------------------------------------------------------------------------------
# Layer norm and RMS norm: one pass over each row
# ---------------------------------------------------------------------------------------------

@register_cost(aten.native_layer_norm, aten.layer_norm)
def layer_norm_cost(call: OpCall) -> Cost:
    """``(5 + [w] + [b]) * numel``; input, weight, bias read once; out (+ mean, rstd) written."""
    x = call.arg("input")
    fpe = LN_FWD_FLOPS + _is_tensor(call.arg("weight")) + _is_tensor(call.arg("bias"))
    return Cost(x.numel * fpe, read_all(call), written_all(call))


@register_cost(aten.native_layer_norm_backward)
def layer_norm_backward_cost(call: OpCall) -> Cost:
    """grad_input kernel (9 [+1 with weight]) and grad_weight/grad_bias kernel (4 / 1), per mask."""
    g, x, w = call.arg("grad_out"), call.arg("input"), call.arg("weight")
    mask = _mask(call, 3)
    outs = list(call.outputs) + [None] * 3
    stats = bytes_of([call.arg("mean"), call.arg("rstd")])
    total = ZERO
    if mask[0]:
        fpe = LN_BWD_INPUT_FLOPS + _is_tensor(w)
        total = total + Cost(x.numel * fpe, bytes_of([g, x, w]) + stats, unique_bytes(outs[0]))
    if mask[1] or mask[2]:
        fpe = LN_BWD_WEIGHT_FLOPS * bool(mask[1]) + LN_BWD_BIAS_FLOPS * bool(mask[2])
        written = unique_bytes(outs[1]) * bool(mask[1]) + unique_bytes(outs[2]) * bool(mask[2])
        total = total + Cost(x.numel * fpe, bytes_of([g, x]) + stats, written)
    return total


@register_cost(aten._fused_rms_norm, aten.rms_norm)
def rms_norm_cost(call: OpCall) -> Cost:
    """``(3 + [w]) * numel``; input, weight read; out (+ rstd) written."""
    x = call.arg("input")
    return Cost(x.numel * (RMS_FWD_FLOPS + _is_tensor(call.arg("weight"))), read_all(call), written_all(call))


@register_cost(aten._fused_rms_norm_backward)
def rms_norm_backward_cost(call: OpCall) -> Cost:
    """grad_input (7 [+1 with weight]) and grad_weight (3) per element, per ``output_mask``."""
    g, x, w = call.arg("grad_out"), call.arg("input"), call.arg("weight")
    mask = _mask(call, 2)
    outs = list(call.outputs) + [None] * 2
    rstd = unique_bytes(call.arg("rstd"))
    total = ZERO
    if mask[0]:
        fpe = RMS_BWD_INPUT_FLOPS + _is_tensor(w)
        total = total + Cost(x.numel * fpe, bytes_of([g, x, w]) + rstd, unique_bytes(outs[0]))
    if mask[1]:
        total = total + Cost(x.numel * RMS_BWD_WEIGHT_FLOPS, bytes_of([g, x]) + rstd, unique_bytes(outs[1]))
    return total


# ---------------------------------------------------------------------------------------------
# Batch norm and group norm: statistics pass + transform pass
# ---------------------------------------------------------------------------------------------

_ALWAYS_TRAINING = frozenset({aten._batch_norm_with_update, aten.native_group_norm, aten.group_norm,
                              aten.instance_norm})       # instance norm's statistics are always the input's
_NEVER_TRAINING = frozenset({aten._native_batch_norm_legit_no_training, aten._batch_norm_no_update})
# Ops that update running_mean/var in place (their new values are not among the outputs).
_MUTATES_RUNNING_STATS = frozenset({aten.native_batch_norm, aten._native_batch_norm_legit, aten.batch_norm,
                                    aten.cudnn_batch_norm, aten._batch_norm_with_update})


def uses_batch_statistics(call: OpCall) -> bool:
    """Whether a batch/group/instance norm call normalises by its input's own statistics (training mode),
    not by running ones: a statistics pass more, and on a CPU another kernel (kernels_db/cpu_model.py)."""
    packet = call.op.overloadpacket
    if packet in _ALWAYS_TRAINING:
        return True
    if packet in _NEVER_TRAINING:
        return False
    return bool(call.arg("training", True))


@register_cost(aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
               aten._native_batch_norm_legit_no_training, aten.cudnn_batch_norm, aten.miopen_batch_norm,
               aten.batch_norm, aten._batch_norm_with_update, aten._batch_norm_no_update,
               aten.native_group_norm, aten.group_norm, aten.instance_norm)
def batch_norm_cost(call: OpCall) -> Cost:
    """Training: stats pass (3/elem, reads input) + transform pass (4/elem, reads input again).
    Eval: transform pass only, with the running statistics."""
    x = call.arg("input")
    training = uses_batch_statistics(call)
    fpe = TRANSFORM_FLOPS + (STATS_FLOPS if training else 0)
    read = read_all(call) + (unique_bytes(x) if training else 0)
    written = written_all(call)
    if training and call.op.overloadpacket in _MUTATES_RUNNING_STATS:
        written = written + bytes_of([call.arg("running_mean"), call.arg("running_var")])
    return Cost(x.numel * fpe, read, written)


@register_cost(aten.native_batch_norm_backward, aten.cudnn_batch_norm_backward, aten.miopen_batch_norm_backward,
               aten.batch_norm_backward, aten.native_group_norm_backward)
def batch_norm_backward_cost(call: OpCall) -> Cost:
    """Reduction pass (sum(g), sum(g*xhat): reads grad_out, input; yields grad_weight/bias) when
    training or when weight/bias grads are wanted, then the grad_input pass (reads them again).

    Training: 9 FLOPs/element in total; eval grad_input only: 1 FLOP/element (+ 3 for the reductions).
    """
    g = call.arg("grad_out", call.arg("grad_output"))
    x = call.arg("input")
    packet = call.op.overloadpacket
    training = packet is aten.native_group_norm_backward or bool(call.arg("train", call.arg("update", True)))
    mask = _mask(call, 3)
    small = read_all(call) - bytes_of([g, x])  # weight, saved statistics, reserve space
    flops, read = 0, small
    if training or mask[1] or mask[2]:
        flops, read = flops + 3 * x.numel, read + bytes_of([g, x])
    if mask[0]:
        per = NORM_BWD_FLOPS - 3 if training else BN_EVAL_BWD_FLOPS
        flops = flops + per * x.numel
        read = read + (bytes_of([g, x]) if training else unique_bytes(g))
    return Cost(flops, read, written_all(call))
