"""Cost rules for pooling: max/average pools over fixed windows and adaptive pools.

Contract: a pool reads its input once and writes its outputs (values, and indices for max pools) once;
its FLOPs are one combine per window element of every output, plus one divide per output for averages:

    max pool       flops = out.numel * window          (one compare per element of the window)
    average pool   flops = out.numel * (window + 1)    (adds, then one divide)

For fixed windows ``window`` is the product of ``kernel_size``. An adaptive pool's windows tile the input
(exactly when the sizes divide), so ``out.numel * window = in.numel``:

    adaptive max   flops = in.numel
    adaptive avg   flops = in.numel + out.numel        (= ``mean`` over the window, which is what
                                                        torch decomposes a 1x1 adaptive average into)

Backwards scatter each output gradient over its window: the same FLOPs as the forward, reading the
gradient (and indices) and writing the input gradient once.

Example::

    >>> # max_pool2d of a [8, 16, 32, 32] input, kernel 2, stride 2: out [8, 16, 16, 16] = 32768
    >>> # elements; flops = 32768 * 2*2 = 131072

Known limitations:
- NB: overlapping windows (stride < kernel) read input elements more than once from cache; counted once.
- NB: adaptive windows of non-dividing sizes overlap by one row/column; ``in.numel`` undercounts them.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from boomfx.passes.costs.pointwise import read_all, written_all
from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.specs import TensorSpec

aten = torch.ops.aten


def _window(call: OpCall, dims: int) -> Any:
    kernel = call.arg("kernel_size")
    kernel = list(kernel) if isinstance(kernel, (list, tuple)) else [kernel]
    if len(kernel) == 1:
        kernel = kernel * dims
    return sympy.Mul(*[sympy.sympify(k) for k in kernel])


def _fixed(dims: int, average: bool):
    def cost(call: OpCall) -> Cost:
        outs = call.tensor_outputs()
        if not outs:
            return ZERO
        per_output = _window(call, dims) + (1 if average else 0)
        return Cost(outs[0].numel * per_output, read_all(call), written_all(call))
    return cost


def _adaptive(average: bool):
    def cost(call: OpCall) -> Cost:
        x = call.arg("self")
        outs = call.tensor_outputs()
        if not isinstance(x, TensorSpec) or not outs:
            return ZERO
        return Cost(x.numel + (outs[0].numel if average else 0), read_all(call), written_all(call))
    return cost


def _fixed_backward(dims: int, average: bool):
    def cost(call: OpCall) -> Cost:
        grad = call.arg("grad_output")
        if not isinstance(grad, TensorSpec):
            return ZERO
        per_output = _window(call, dims) + (1 if average else 0)
        return Cost(grad.numel * per_output, read_all(call), written_all(call))
    return cost


def _adaptive_backward(average: bool):
    def cost(call: OpCall) -> Cost:
        outs = call.tensor_outputs()
        grad = call.arg("grad_output")
        if not outs or not isinstance(grad, TensorSpec):
            return ZERO
        return Cost(outs[0].numel + (grad.numel if average else 0), read_all(call), written_all(call))
    return cost


for _dims, _ops in ((1, (aten.max_pool1d, aten.max_pool1d_with_indices)),
                    (2, (aten.max_pool2d, aten.max_pool2d_with_indices)),
                    (3, (aten.max_pool3d, aten.max_pool3d_with_indices))):
    register_cost(*_ops)(_fixed(_dims, average=False))
for _dims, _op in ((1, aten.avg_pool1d), (2, aten.avg_pool2d), (3, aten.avg_pool3d)):
    register_cost(_op)(_fixed(_dims, average=True))
register_cost(aten.max_pool2d_with_indices_backward)(_fixed_backward(2, average=False))
register_cost(aten.max_pool3d_with_indices_backward)(_fixed_backward(3, average=False))
register_cost(aten.avg_pool2d_backward)(_fixed_backward(2, average=True))
register_cost(aten.avg_pool3d_backward)(_fixed_backward(3, average=True))
register_cost(aten.adaptive_max_pool1d, aten.adaptive_max_pool2d, aten.adaptive_max_pool3d)(_adaptive(False))
register_cost(aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d,
              aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d)(_adaptive(True))
register_cost(aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward)(_adaptive_backward(False))
register_cost(aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward)(_adaptive_backward(True))
