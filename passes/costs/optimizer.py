"""Cost rules for optimizer kernels: the ``_foreach_*`` family and fused Adam/AdamW/SGD.

A ``_foreach_op(self: Tensor[], ...)`` applies one elementwise op to every list element (in a few
multi-tensor-apply launches). Its cost is the sum over the list of the elementwise cost:

    flops         = sum_i self[i].numel * FLOPs per element      (``FOREACH_FLOPS``)
    bytes_read    = every tensor argument (lists flattened) once
    bytes_written = sum_i self[i] bytes (the results have ``self``'s shapes, in place or not)

``_foreach_copy_`` reads only ``src``; ``_foreach_zero_`` reads nothing; ``_foreach_norm`` writes
one scalar per tensor.

Fused optimizers, per parameter element (see ``adam_flops_per_element``):

- Adam: ``m = b1*m + (1-b1)*g`` (3), ``v = b2*v + (1-b2)*g*g`` (4),
  ``p -= lr * m / (sqrt(v)/sqrt(bc2) + eps)`` (6): 13; weight decay (+2: ``g += wd*p`` for Adam,
  ``p -= lr*wd*p`` for AdamW); amsgrad (+1 max); ``grad_scale`` (+1 divide); bias corrections are
  per tensor, not per element. Reads p, g, m, v (+ max_v), writes p, m, v (+ max_v).
- SGD: weight decay (+2), momentum ``buf = mom*buf + (1-damp)*g`` (+3), nesterov (+2),
  ``p -= lr*g`` (2). Reads p, g (+ buf), writes p (+ buf).

Example::

    >>> # _foreach_add.List([a[4], b[6]], [c[4], d[6]]) in float32:
    >>> # flops 4+6 = 10, read (4+6+4+6)*4 = 80 B, write (4+6)*4 = 40 B

Known limitations:
- NB: the 0-dim ``state_steps`` increments and the per-tensor scalar math are not counted
  separately (they are included in the bytes of ``state_steps``).
- NB: a ``Tensor`` scalar argument (``_foreach_add.Tensor``) is counted as read once.
"""
from __future__ import annotations

from typing import Any

import torch

from boomfx.passes.costs.pointwise import bytes_of, numel_of, read_all, written_all
from boomfx.passes.costs.registry import Cost, OpCall, register_cost
from boomfx.passes.specs import TensorSpec

aten = torch.ops.aten

# base name -> FLOPs per element (see pointwise.FLOPS_PER_ELEMENT for the same conventions)
FOREACH_FLOPS: dict[str, int] = {
    "add": 1, "sub": 1, "mul": 1, "div": 1, "addcmul": 3, "addcdiv": 3, "sqrt": 1, "rsqrt": 1,
    "lerp": 3, "maximum": 1, "minimum": 1, "clamp_min": 1, "clamp_max": 1, "neg": 1, "abs": 1,
    "exp": 1, "log": 1, "reciprocal": 1, "sign": 1, "pow": 1, "sigmoid": 4, "tanh": 1, "sin": 1,
    "cos": 1, "expm1": 1, "log1p": 1, "floor": 1, "ceil": 1, "round": 1, "trunc": 1, "frac": 1,
    "erf": 1, "norm": 2, "copy_": 0, "zero_": 0,
}


def _foreach_ops() -> dict[Any, str]:
    """``{aten._foreach_add: "add", aten._foreach_add_: "add", ...}`` for the ops this build has."""
    table: dict[Any, str] = {}
    for base in FOREACH_FLOPS:
        for name in {f"_foreach_{base}", f"_foreach_{base}_"}:
            if hasattr(aten, name) and not name.endswith("__"):
                table[getattr(aten, name)] = base
    return table


FOREACH_OPS = _foreach_ops()


@register_cost(*FOREACH_OPS)
def foreach_cost(call: OpCall) -> Cost:
    """Sum over list elements of the elementwise cost (module docstring)."""
    base = FOREACH_OPS[call.op.overloadpacket]
    tensors = [t for t in call.arg("self") or [] if isinstance(t, TensorSpec)]
    fpe = FOREACH_FLOPS[base]
    if base in {"add", "sub"} and call.arg("alpha") not in (None, 1):
        fpe += 1
    flops = numel_of(tensors) * fpe
    if base == "copy_":
        return Cost(0, bytes_of([call.arg("src")]), bytes_of(tensors))
    if base == "zero_":
        return Cost(0, 0, bytes_of(tensors))
    if base == "norm":
        return Cost(flops, read_all(call), written_all(call))
    return Cost(flops, read_all(call), bytes_of(tensors))


def adam_flops_per_element(call: OpCall) -> int:
    """13 base + 2 weight decay (L2 for Adam, decoupled for AdamW: both 2) + 1 amsgrad + 1 grad_scale."""
    flops = 13
    if (call.arg("weight_decay") or 0) != 0:
        flops += 2
    if call.arg("amsgrad"):
        flops += 1
    if isinstance(call.arg("grad_scale"), TensorSpec):
        flops += 1
    return flops


@register_cost(aten._fused_adam_, aten._fused_adamw_, aten._fused_adam, aten._fused_adamw)
def fused_adam_cost(call: OpCall) -> Cost:
    """Per element of every parameter; reads p, g, m, v (+max_v), writes p, m, v (+max_v)."""
    params = call.arg("self")
    fpe = adam_flops_per_element(call)
    states = [params, call.arg("exp_avgs"), call.arg("exp_avg_sqs")]
    if call.arg("amsgrad"):
        states.append(call.arg("max_exp_avg_sqs"))
    read = bytes_of(states) + bytes_of([call.arg("grads"), call.arg("state_steps"), call.arg("lr"),
                                        call.arg("grad_scale"), call.arg("found_inf")])
    return Cost(numel_of([params]) * fpe, read, bytes_of(states))


@register_cost(aten._fused_sgd_, aten._fused_sgd)
def fused_sgd_cost(call: OpCall) -> Cost:
    """Per element: update 2, + weight decay 2, + momentum 3, + nesterov 2; reads p, g (+buf)."""
    params = call.arg("self")
    fpe = 2
    if (call.arg("weight_decay") or 0) != 0:
        fpe += 2
    states = [params]
    if (call.arg("momentum") or 0) != 0:
        fpe += 3 + (2 if call.arg("nesterov") else 0)
        states.append(call.arg("momentum_buffer_list"))
    read = bytes_of(states) + bytes_of([call.arg("grads"), call.arg("lr"), call.arg("grad_scale"),
                                        call.arg("found_inf")])
    return Cost(numel_of([params]) * fpe, read, bytes_of(states))

