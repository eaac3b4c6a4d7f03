"""Cost rules for the grouped matrix products of mixture-of-experts layers.

``aten._grouped_mm(self, mat2, offs)`` multiplies G groups at once; ``offs`` holds the cumulative end
of each group along the grouped dimension. The four layouts (torch/_meta_registrations.py,
``_create_grouped_mm_output_tensor``) and their work, with ``M_g``/``K_g``/``N_g`` the group sizes:

=========  ==============================  ==============  ================================
self       mat2                            out             FLOPs (sum over g)
=========  ==============================  ==============  ================================
[sum M, K] [G, K, N]  (MoE: tokens x E)    [sum M, N]      2 * sum(M_g) * K * N
[M, sum K] [sum K, N] (grouped K)          [G, M, N]       2 * M * sum(K_g) * N
[G, M, K]  [K, sum N]                      [M, sum N]      2 * M * K * sum(N_g)
[G, M, K]  [G, K, N]  (batched, no offs)   [G, M, N]       2 * G * M * K * N
=========  ==============================  ==============  ================================

In every row but the second, that is ``2 * out.numel * K`` with ``K = self.shape[-1]``; in the second
the sum of the K groups is ``self.shape[-1]`` and the output has G copies of [M, N]:
``2 * M * N * self.shape[-1]``. So FLOPs are exact whatever the split: the per-group sizes are
data-dependent (``offs`` is computed from the router's choices), but only their sum enters.

Assumed (NB): the groups cover the whole grouped dimension (``offs[-1]`` equals its size). In a MoE
layer that dimension is the ``tokens * top_k`` routed (token, expert) pairs, spread over the experts
in any proportion; rows past ``offs[-1]`` (expert-parallel sentinels, dropped tokens) are counted as
computed. Bytes: every operand read once (all G expert matrices, i.e. every expert receives at least
one token: true when ``tokens * top_k`` is well above the expert count, an overcount for tiny decode
batches), the output written once.

``transformers``' fallback (``transformers::grouped_mm_fallback(input, weight, offs)``, the
``[sum M, K] x [G, K, N]`` layout, one ``mm`` per expert) and its backward op are priced by the same
rule, by name: they exist only when ``transformers`` is imported, or as stand-ins (``foreign_ops``).

Example::

    >>> x = TensorSpec((sympy.Integer(6), sympy.Integer(4)), (4, 1), torch.float32)      # 3 tokens x top-2
    >>> w = TensorSpec((sympy.Integer(8),) + (sympy.Integer(4), sympy.Integer(5)), (20, 5, 1), torch.float32)
    >>> offs = TensorSpec((sympy.Integer(8),), (1,), torch.int32)
    >>> out = TensorSpec((sympy.Integer(6), sympy.Integer(5)), (5, 1), torch.float32)
    >>> grouped_mm_cost(OpCall.build(aten._grouped_mm.default, (x, w, offs), {}, (out,))).flops  # 2*6*4*5
    240

Known limitations:
- NB: the transformers fallback is a Python loop (one ``offs.tolist()`` sync, one ``mm`` launch per
  expert with tokens); it is priced as one kernel, so its host time is undercounted.
- NB: group-size imbalance costs GEMM efficiency (partly empty tiles), not FLOPs; not modelled.
"""
from __future__ import annotations

import torch

from boomfx.passes.costs.pointwise import first_output, read_all, written_all
from boomfx.passes.costs.registry import (
    ZERO, Cost, OpCall, fallback_cost, register_cost, register_library_cost,
)
from boomfx.passes.specs import SymExpr, TensorSpec

aten = torch.ops.aten

TRANSFORMERS_GROUPED_MM = "transformers::grouped_mm_fallback"
TRANSFORMERS_GROUPED_MM_BACKWARD = "transformers::grouped_mm_fallback_backward"
# library ops that are grouped matrix products (passes/kernels.py classes them as matmuls)
LIBRARY_GROUPED_MM_OPS = frozenset({TRANSFORMERS_GROUPED_MM, TRANSFORMERS_GROUPED_MM_BACKWARD})


def grouped_product_flops(a: TensorSpec, b: TensorSpec, out: TensorSpec) -> SymExpr:
    """FLOPs of one grouped product ``a`` x ``b`` -> ``out`` (module doc's table)."""
    if a.ndim == 2 and b.ndim == 2:          # groups along K: out [G, M, N], sum of K_g = a.shape[-1]
        return 2 * out.shape[-2] * out.shape[-1] * a.shape[-1]
    return 2 * out.numel * a.shape[-1]


@register_cost(aten._grouped_mm, aten._scaled_grouped_mm)
def grouped_mm_cost(call: OpCall) -> Cost:
    """``2 * sum_g(M_g) * K * N`` for the MoE layout; operands (and ``offs``, scales, bias) read, output written."""
    a, b, out = call.arg("self"), call.arg("mat2"), first_output(call)
    if not isinstance(a, TensorSpec) or not isinstance(b, TensorSpec) or out is None:
        return ZERO
    flops = grouped_product_flops(a, b, out)
    if isinstance(call.arg("bias"), TensorSpec):
        flops = flops + out.numel
    return Cost(flops, read_all(call), written_all(call))


@register_library_cost(TRANSFORMERS_GROUPED_MM)
def transformers_grouped_mm_cost(call: OpCall) -> Cost:
    """``input [S, K]`` x ``weight [E, K, N]`` -> ``[S, N]``: ``2 * S * K * N`` (S = tokens x top_k)."""
    a, b, out = call.arg("input"), call.arg("weight"), first_output(call)
    if not isinstance(a, TensorSpec) or not isinstance(b, TensorSpec) or out is None:
        return fallback_cost(call)   # another library version's arguments: bytes moved, never a silent zero
    return Cost(grouped_product_flops(a, b, out), read_all(call), written_all(call))


@register_library_cost(TRANSFORMERS_GROUPED_MM_BACKWARD)
def transformers_grouped_mm_backward_cost(call: OpCall) -> Cost:
    """grad_input = grad_out [S, N] x weight^T and grad_weight = input^T x grad_out: ``2 * 2*S*K*N``."""
    a, grad = call.arg("input"), call.arg("grad_output")
    if not isinstance(a, TensorSpec) or not isinstance(grad, TensorSpec):
        return fallback_cost(call)
    per_product = 2 * a.shape[0] * a.shape[-1] * grad.shape[-1]
    return Cost(2 * per_product, read_all(call), written_all(call))
