"""Cost rules for matrix products: mm, addmm, bmm, baddbmm, matmul, linear, mv, addmv, dot, einsum.

Derivation (one GEMM, ``[M, K] @ [K, N]``):

1. every output element is a length-K dot product: K multiplies + K adds = ``2*K`` FLOPs (a
   multiply-add counts as 2, like ``torch.utils.flop_counter``; the exact ``2K - 1`` is ignored);
2. so ``flops = 2 * M * N * K = 2 * out.numel * K``, which also covers batched, broadcast and
   vector forms (``mv``: out = M; ``dot``: out = 1);
3. the ``add*`` forms add ``beta * self`` to the product: + ``out.numel`` FLOPs, so
   ``addmm == mm + add`` in FLOPs;
4. bytes: each operand read once at its own size (a broadcast batch operand once), output written
   once: the eager cuBLAS kernel's compulsory traffic.

Example::

    >>> a = TensorSpec((sympy.Integer(4), sympy.Integer(16)), (16, 1), torch.float32)
    >>> b = TensorSpec((sympy.Integer(16), sympy.Integer(8)), (8, 1), torch.float32)
    >>> o = TensorSpec((sympy.Integer(4), sympy.Integer(8)), (8, 1), torch.float32)
    >>> mm_cost(OpCall.build(aten.mm.default, (a, b), {}, (o,))).flops   # 2*4*8*16
    1024

Known limitations:
- NB: tiles re-read operands from L2/HBM when they do not fit in shared memory; only the
  compulsory traffic is counted.
- NB: ``alpha``/``beta`` scaling (when != 1) is not counted; it is fused into the epilogue.
- NB: einsum with 3+ operands is priced contracting left to right (torch's order without
  opt_einsum); a different path changes FLOPs.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from boomfx.passes.costs.pointwise import (
    GELU_TANH_FLOPS, bytes_of, first_output, read_all, unique_bytes, written_all,
)
from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.specs import SymExpr, TensorSpec

aten = torch.ops.aten


def _contract_dim(a: TensorSpec) -> SymExpr:
    """K: the last dim of the left operand (1-D operands contract their only dim)."""
    return a.shape[-1]


def _product_cost(call: OpCall, left: str, bias: str = "") -> Cost:
    """``2 * out.numel * K`` (+ ``out.numel`` for a bias/``self`` add); inputs read, output written."""
    a, out = call.arg(left), first_output(call)
    if not isinstance(a, TensorSpec) or out is None:
        return ZERO
    flops = 2 * out.numel * _contract_dim(a)
    if bias and isinstance(call.arg(bias), TensorSpec) and call.arg("beta", 1) != 0:
        flops = flops + out.numel
    return Cost(flops, read_all(call), written_all(call))


def _packet_name(op: torch._ops.OpOverload) -> str:
    return op.overloadpacket._qualified_op_name.split("::", 1)[1]


@register_cost(aten.mm, aten.bmm, aten.matmul, aten.mv, aten.dot, aten.vdot, aten.inner)
def mm_cost(call: OpCall) -> Cost:
    """``2 * out.numel * K``: mm ``2*M*N*K``; bmm ``2*B*M*N*K``; mv ``2*M*K``; dot ``2*K``."""
    return _product_cost(call, "self")


@register_cost(aten.addmm, aten.baddbmm, aten.addmv)
def addmm_cost(call: OpCall) -> Cost:
    """Product FLOPs + ``out.numel`` for adding ``beta * self``; ``self`` read at its own (bias) size."""
    left = {"addmm": "mat1", "baddbmm": "batch1", "addmv": "mat"}[_packet_name(call.op)]
    return _product_cost(call, left, "self")


@register_cost(aten.addbmm)
def addbmm_cost(call: OpCall) -> Cost:
    """``self + sum_b batch1[b] @ batch2[b]``: ``2*B*N*P*M`` + ``N*P`` (the batch sum is the K loop)."""
    b1, out = call.arg("batch1"), first_output(call)
    flops = 2 * b1.shape[0] * out.numel * b1.shape[-1] + out.numel
    return Cost(flops, read_all(call), written_all(call))


@register_cost(aten.linear)
def linear_cost(call: OpCall) -> Cost:
    """``input @ weight.T + bias``: ``2 * out.numel * in_features`` (+ ``out.numel`` with bias)."""
    return _product_cost(call, "input", "bias")


@register_cost(aten._addmm_activation)
def addmm_activation_cost(call: OpCall) -> Cost:
    """addmm + a fused epilogue activation: ReLU (1 FLOP/element) or tanh-GELU (9 FLOPs/element)."""
    base = _product_cost(call, "mat1", "self")
    act = GELU_TANH_FLOPS if call.arg("use_gelu") else 1
    return Cost(base.flops + act * first_output(call).numel, base.bytes_read, base.bytes_written)


@register_cost(aten._scaled_mm)
def scaled_mm_cost(call: OpCall) -> Cost:
    """FP8 GEMM: ``2*M*N*K`` (+ ``M*N`` with bias); scales read, output written in ``out_dtype``."""
    return _product_cost(call, "self", "bias")


# ---------------------------------------------------------------------------------------------
# einsum
# ---------------------------------------------------------------------------------------------

def _expand_ellipsis(term: str, ndim: int, pool: str) -> str:
    if "..." not in term:
        return term
    n_ell = ndim - (len(term) - 3)
    return term.replace("...", pool[len(pool) - n_ell:] if n_ell > 0 else "")


def _parse_einsum(equation: str, operands: list[TensorSpec]) -> tuple[list[str], str, dict[str, SymExpr]]:
    """Input index strings, output index string and each index's size (ellipsis spelled out)."""
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    pool = "".join(chr(c) for c in range(0x100, 0x100 + 32))  # letters not used by equations
    max_ell = max((op.ndim - (len(t) - 3) for t, op in zip(lhs.split(","), operands) if "..." in t),
                  default=0)
    terms = [_expand_ellipsis(t, op.ndim, pool) for t, op in zip(lhs.split(","), operands)]
    sizes: dict[str, SymExpr] = {}
    for term, op in zip(terms, operands):
        for idx, size in zip(term, op.shape):
            if idx not in sizes or sizes[idx] == 1:
                sizes[idx] = size
    if "->" in equation:
        out = rhs.replace("...", pool[len(pool) - max_ell:] if max_ell > 0 else "")
    else:
        counts = "".join(terms)
        ell = pool[len(pool) - max_ell:] if max_ell > 0 else ""
        out = ell + "".join(sorted(i for i in set(counts) if counts.count(i) == 1 and i not in ell))
    return terms, out, sizes


def _prod(indices: Any, sizes: dict[str, SymExpr]) -> SymExpr:
    return sympy.Mul(*[sizes[i] for i in indices]) if indices else sympy.Integer(1)


@register_cost(aten.einsum)
def einsum_cost(call: OpCall) -> Cost:
    """Left-to-right pairwise contraction; each step costs ``2 * prod(all its index sizes)`` when it
    sums over an index (multiply-add), ``prod(...)`` when it only multiplies (outer/Hadamard).

    A single operand is a reduction/permutation: ``prod(its index sizes)`` adds (0 if a pure permute).
    Bytes: operands read once, output written once (intermediates of 3+ operand chains not counted).
    """
    operands = [t for t in call.arg("tensors") or [] if isinstance(t, TensorSpec)]
    out_spec = first_output(call)
    if not operands or out_spec is None:
        return ZERO
    terms, out, sizes = _parse_einsum(str(call.arg("equation")), operands)
    flops: SymExpr = sympy.Integer(0)
    current = terms[0]
    if len(terms) == 1 and set(current) - set(out):
        flops = _prod(set(current), sizes)
    for k in range(1, len(terms)):
        nxt = terms[k]
        later = set(out).union(*[set(t) for t in terms[k + 1:]])
        union = set(current) | set(nxt)
        kept = {i for i in union if i in later}
        summed = union - kept
        flops = flops + (2 if summed else 1) * _prod(union, sizes)
        current = "".join(sorted(kept))
    return Cost(flops, bytes_of(operands), unique_bytes(out_spec))


@register_cost(aten.bilinear)
def bilinear_cost(call: OpCall) -> Cost:
    """``nn.Bilinear``: ``y[n, o] = x1[n] W[o] x2[n] + b[o]``: ``2 * N * O * I1 * I2`` FLOPs (ATen contracts
    ``x1`` with ``W`` first, then with ``x2``: ``2 N O I1 I2 + 2 N O I2``, the second term counted too) and
    the bias; each operand read once, the output written."""
    x1, x2, w, out = call.arg("input1"), call.arg("input2"), call.arg("weight"), first_output(call)
    rows = x1.numel / x1.shape[-1]
    flops = 2 * rows * w.shape[0] * w.shape[1] * w.shape[2] + 2 * rows * w.shape[0] * w.shape[2]
    if call.arg("bias") is not None:
        flops = flops + out.numel
    return Cost(flops, read_all(call), written_all(call))


@register_cost(aten._trilinear)
def trilinear_cost(call: OpCall) -> Cost:
    """``_trilinear`` (``bilinear``'s kernel and its gradients): ``sum over sumdim of i1 * i2 * i3``, each
    input broadcast with size-1 dimensions at its ``expand`` positions: 2 FLOPs per point of the product
    space (the output's elements times the summed dimensions' sizes)."""
    expanded = []
    for name, where in (("i1", "expand1"), ("i2", "expand2"), ("i3", "expand3")):
        shape = list(call.arg(name).shape)
        for d in sorted(int(e) for e in call.arg(where)):
            shape.insert(d, sympy.Integer(1))
        expanded.append(shape)
    summed = sympy.Integer(1)
    for d in call.arg("sumdim"):
        summed = summed * sympy.Max(*(shape[int(d)] for shape in expanded))
    return Cost(2 * first_output(call).numel * summed, read_all(call), written_all(call))
