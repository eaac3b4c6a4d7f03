"""Cost rules for elementwise (pointwise) ops, and the byte-counting helpers other families share.

Contract: an elementwise kernel computes every output element from the matching (broadcast)
input elements, so

    flops         = output elements * FLOPs per element      (table ``FLOPS_PER_ELEMENT``)
    bytes_read    = sum of each tensor input's own bytes      (``unique_bytes``: a broadcast input
                                                               is read once, at its own size)
    bytes_written = sum of the output bytes

Scalar arguments are free. In-place variants (``add_``, ``mul_``...) have the same cost: they read
``self`` and write it back.

Example::

    >>> from boomfx.passes.costs.registry import OpCall, price_call
    >>> x = TensorSpec((sympy.Integer(4), sympy.Integer(8)), (8, 1), torch.float32)
    >>> b = TensorSpec((sympy.Integer(8),), (1,), torch.float32)
    >>> price_call(OpCall.build(aten.add.Tensor, (x, b), {}, (x,))).cost
    Cost(flops=32, bytes_read=160, bytes_written=128)

FLOPs per element (one arithmetic op, comparison or select = 1 FLOP; a transcendental function
such as exp/log/tanh/erf/sin counted as 1 FLOP, as fvcore and most roofline tools do; composite
activations count their arithmetic steps, derivations next to the table).

Known limitations:
- NB: a transcendental runs on the special-function unit at a lower rate than an FMA; counting it
  as 1 FLOP underestimates compute-bound activation kernels (rare: they are memory bound).
- NB: ``pow`` is 1 FLOP per element whatever the exponent.
- NB: type promotion is ignored: every input is read at its own dtype, the output at its own.
- NB: ``contiguous``/``to``/``type_as`` are free when the output aliases the input (same dtype,
  already in the requested layout), otherwise a full copy.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import sympy
import torch

from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.specs import SymExpr, TensorSpec, contiguous_strides

aten = torch.ops.aten
_ZERO_EXPR = sympy.Integer(0)


# ---------------------------------------------------------------------------------------------
# Shared byte helpers (used by every family module)
# ---------------------------------------------------------------------------------------------

_UNIQUE_BYTES: dict[TensorSpec, SymExpr] = {}   # scale: foreach lists repeat a few specs hundreds of times


def unique_bytes(spec: Optional[TensorSpec]) -> SymExpr:
    """Bytes a kernel reading ``spec`` whole must fetch: dims with stride 0 (broadcast) count once."""
    if not isinstance(spec, TensorSpec):
        return _ZERO_EXPR
    hit = _UNIQUE_BYTES.get(spec)
    if hit is None:
        numel: SymExpr = sympy.Integer(1)
        for size, stride in zip(spec.shape, spec.stride):
            if sympy.sympify(stride) != 0:
                numel = numel * size
        hit = numel * spec.itemsize
        if len(_UNIQUE_BYTES) > 100_000:
            _UNIQUE_BYTES.clear()
        _UNIQUE_BYTES[spec] = hit
    return hit


def _terms(values: Iterable[Any], term: Any, out: list) -> list:
    for value in values:
        if isinstance(value, TensorSpec):
            out.append(term(value))
        elif isinstance(value, (list, tuple)):
            _terms(value, term, out)
    return out


def bytes_of(values: Iterable[Any]) -> SymExpr:
    """Sum of ``unique_bytes`` over tensors (lists flattened; None and scalars ignored)."""
    # scale: one sympy Add over all terms (adding a 720-tensor foreach list term by term is quadratic)
    terms = _terms(values, unique_bytes, [])
    return sympy.Add(*terms) if terms else _ZERO_EXPR


def numel_of(values: Iterable[Any]) -> SymExpr:
    """Sum of elements over tensors (lists flattened)."""
    terms = _terms(values, lambda t: t.numel, [])
    return sympy.Add(*terms) if terms else _ZERO_EXPR


def read_all(call: OpCall) -> SymExpr:
    """Every tensor argument read once, at its own size."""
    return bytes_of(call.tensor_args())


def written_all(call: OpCall) -> SymExpr:
    """Every tensor output written once."""
    return bytes_of(call.tensor_outputs())


def first_output(call: OpCall) -> Optional[TensorSpec]:
    outs = call.tensor_outputs()
    return outs[0] if outs else None


def elementwise_cost(call: OpCall, flops_per_element: Any) -> Cost:
    """``flops_per_element`` FLOPs per element of the first output; every input read, every output written.

    When the op returns nothing (an in-place op traced without a value), ``self`` stands for the output.
    An ``out=`` variant (``mul.Scalar_out``: DDP's copy of a gradient into its bucket) writes its
    ``out`` argument and never reads it.
    """
    out = first_output(call)
    if out is None and isinstance(call.arg("self"), TensorSpec):
        out = call.arg("self")
        return Cost(out.numel * flops_per_element, _read_inputs(call), unique_bytes(out))
    if out is None:
        return ZERO
    return Cost(out.numel * flops_per_element, _read_inputs(call), written_all(call))


_OUT_ARGS: dict[Any, frozenset[str]] = {}


def _read_inputs(call: OpCall) -> SymExpr:
    """Every tensor argument but the schema's ``out`` ones (written, not read), read once."""
    names = _OUT_ARGS.get(call.op)
    if names is None:
        schema = getattr(call.op, "_schema", None)
        names = _OUT_ARGS[call.op] = frozenset(a.name for a in (schema.arguments if schema else ()) if a.is_out)
    if not names:
        return read_all(call)
    return bytes_of(v for name, v in call.args.items() if name not in names)


# ---------------------------------------------------------------------------------------------
# FLOPs per element, by op
# ---------------------------------------------------------------------------------------------

GELU_ERF_FLOPS = 5    # 0.5 * x * (1 + erf(x / sqrt2)): div, erf, add, mul, mul
GELU_TANH_FLOPS = 9   # 0.5x(1 + tanh(c(x + 0.044715 x^3))): x^3 (2), mul, add, mul, tanh, add, mul, mul
SIGMOID_FLOPS = 4     # 1 / (1 + exp(-x)): neg, exp, add, div
SILU_FLOPS = 5        # x * sigmoid(x)
DROPOUT_FLOPS = 3     # random draw, compare with p, multiply by mask * 1/(1-p)

FLOPS_PER_ELEMENT: dict[Any, int] = {
    # binary / unary arithmetic: 1 op each
    aten.add: 1, aten.sub: 1, aten.mul: 1, aten.div: 1, aten.rsub: 1, aten.neg: 1, aten.abs: 1,
    aten.reciprocal: 1, aten.sqrt: 1, aten.rsqrt: 1, aten.square: 1, aten.pow: 1, aten.sign: 1,
    aten.remainder: 1, aten.fmod: 1, aten.floor_divide: 1, aten.floor: 1, aten.ceil: 1, aten.round: 1,
    aten.trunc: 1, aten.frac: 1, aten.maximum: 1, aten.minimum: 1, aten.fmax: 1, aten.fmin: 1,
    aten.max.other: 1, aten.min.other: 1,
    # comparisons, logic, select: 1 op each
    aten.eq: 1, aten.ne: 1, aten.lt: 1, aten.le: 1, aten.gt: 1, aten.ge: 1, aten.logical_not: 1,
    aten.logical_and: 1, aten.logical_or: 1, aten.logical_xor: 1, aten.bitwise_not: 1,
    aten.bitwise_and: 1, aten.bitwise_or: 1, aten.bitwise_xor: 1, aten.isnan: 1, aten.isinf: 1,
    aten.__and__: 1, aten.__or__: 1, aten.__xor__: 1,   # Python's & | ^ on tensors (MoE routers' masks)
    aten.where: 1, aten.masked_fill: 1, aten.clamp_min: 1, aten.clamp_max: 1,
    aten.clamp: 2,  # compare with min, compare with max
    aten.nan_to_num: 3,  # isnan, isinf, select
    # transcendental: 1 "FLOP" each (see module NB)
    aten.exp: 1, aten.exp2: 1, aten.expm1: 1, aten.log: 1, aten.log2: 1, aten.log10: 1, aten.log1p: 1,
    aten.sin: 1, aten.cos: 1, aten.tan: 1, aten.tanh: 1, aten.erf: 1, aten.erfc: 1, aten.erfinv: 1,
    aten.atan: 1, aten.asin: 1, aten.acos: 1, aten.sinh: 1, aten.cosh: 1, aten.atan2: 1,
    # activations
    aten.relu: 1, aten.threshold: 1, aten.threshold_backward: 1,
    aten.hardtanh: 2, aten.hardtanh_backward: 2, aten.leaky_relu: 2, aten.leaky_relu_backward: 2,
    aten.prelu: 2, aten._prelu_kernel: 2, aten._prelu_kernel_backward: 3,   # compare, mul (grads: + the weight's)
    aten.glu: SIGMOID_FLOPS + 1,  # a * sigmoid(b), per output element (the input is twice the output)
    aten.glu_backward: 2 * (SIGMOID_FLOPS + 2),  # per input element: both halves' gradients
    aten.sigmoid: SIGMOID_FLOPS, aten.silu: SILU_FLOPS, aten.logit: 3,
    aten.elu: 4,                  # compare, exp, sub, mul (x2 scales folded)
    aten.softplus: 4,             # mul beta, exp, log1p, div; threshold compare folded
    aten.mish: 7,                 # x * tanh(softplus(x))
    aten.hardswish: 4,            # x * clamp(x + 3, 0, 6) / 6
    aten.hardsigmoid: 3,
    aten.sigmoid_backward: 3,     # g * y * (1 - y)
    aten.tanh_backward: 3,        # g * (1 - y * y)
    aten.silu_backward: 9,        # s = sigmoid(x) (4); g * s * (1 + x * (1 - s)) (5)
    aten.elu_backward: 4, aten.hardswish_backward: 4, aten.hardsigmoid_backward: 2,
    aten.softplus_backward: 6, aten.mish_backward: 12,
    # ternary
    aten.lerp: 3,                 # a + w * (b - a)
    aten.addcmul: 3,              # s + v * t1 * t2
    aten.addcdiv: 3,              # s + v * t1 / t2
    # dropout: mask generation + scale
    aten.native_dropout: DROPOUT_FLOPS, aten.dropout: DROPOUT_FLOPS, aten.bernoulli: 2,
    aten.native_dropout_backward: 2,  # g * mask * scale
    # copies and fills: pure data movement
    aten._to_copy: 0, aten.clone: 0, aten.lift_fresh_copy: 0,
    aten.alias_copy: 0, aten.rand: 1, aten.randn: 2, aten.rand_like: 1,
    aten.randn_like: 2,
}


def _inplace_variant(key: Any) -> Optional[torch._ops.OpOverloadPacket]:
    """``aten.add`` -> ``aten.add_`` when PyTorch defines it (only for packets)."""
    if not isinstance(key, torch._ops.OpOverloadPacket):
        return None
    name = key._qualified_op_name.split("::", 1)[1]
    return getattr(aten, name + "_", None) if hasattr(aten, name + "_") else None


def _flops_key(op: torch._ops.OpOverload) -> Any:
    if op in FLOPS_PER_ELEMENT:
        return op
    packet = op.overloadpacket
    if packet in FLOPS_PER_ELEMENT:
        return packet
    return _INPLACE_TO_BASE[packet]


def _inplace_table() -> dict[Any, Any]:
    table = {}
    for key in FLOPS_PER_ELEMENT:
        inplace = _inplace_variant(key)
        if inplace is not None:
            table[inplace] = key
    return table


_INPLACE_TO_BASE = _inplace_table()


def _alpha_flops(call: OpCall) -> int:
    """``add(x, y, alpha=a)`` with a != 1 also multiplies: one extra FLOP per element."""
    alpha = call.arg("alpha")
    return 0 if alpha is None or alpha == 1 else 1


def _gelu_flops(call: OpCall) -> int:
    return GELU_TANH_FLOPS if call.arg("approximate") == "tanh" else GELU_ERF_FLOPS


@register_cost(*FLOPS_PER_ELEMENT, *_INPLACE_TO_BASE)
def pointwise_cost(call: OpCall) -> Cost:
    """Table-driven elementwise rule: output elements x FLOPs per element; inputs read, outputs written."""
    fpe = FLOPS_PER_ELEMENT[_flops_key(call.op)] + _alpha_flops(call)
    return elementwise_cost(call, fpe)


@register_cost(aten.gelu, aten.gelu_)
def gelu_cost(call: OpCall) -> Cost:
    """GELU: 5 FLOPs/element with erf, 9 with the tanh approximation (table derivations above)."""
    return elementwise_cost(call, _gelu_flops(call))


@register_cost(aten.gelu_backward)
def gelu_backward_cost(call: OpCall) -> Cost:
    """g * (cdf(x) + x * pdf(x)): cdf (5, or 9 for tanh), pdf = c * exp(-x^2/2) (4), combine (3)."""
    return elementwise_cost(call, _gelu_flops(call) + 7)


# ---------------------------------------------------------------------------------------------
# Copies, fills and layout changes
# ---------------------------------------------------------------------------------------------

def _aliases_input(src: Any, out: Optional[TensorSpec]) -> bool:
    """The output is the input itself: same dtype, shape, strides and offset."""
    return (isinstance(src, TensorSpec) and out is not None and src.dtype == out.dtype
            and tuple(src.shape) == tuple(out.shape) and tuple(src.stride) == tuple(out.stride)
            and src.storage_offset == out.storage_offset)


@register_cost(aten.contiguous, aten.to, aten.type_as)
def maybe_copy_cost(call: OpCall) -> Cost:
    """Free when the result aliases ``self`` (already contiguous / same dtype), else read + write a copy.

    NB: for ``contiguous`` we also treat an input with contiguous strides as aliasing when the
    traced output carries no strides of its own.
    """
    src, out = call.arg("self"), first_output(call)
    if _aliases_input(src, out):
        return ZERO
    if call.op.overloadpacket is aten.contiguous and isinstance(src, TensorSpec) \
            and tuple(src.stride) == contiguous_strides(tuple(src.shape)) and out is None:
        return ZERO
    if out is None:
        return ZERO
    return Cost(0, unique_bytes(src), unique_bytes(out))


@register_cost(aten.copy_, aten.copy)
def copy_cost(call: OpCall) -> Cost:
    """``self.copy_(src)`` / ``copy(self, src)``: reads ``src`` (or ``other``), writes ``self``-shaped data.

    NB: the functional ``copy`` never reads ``self``'s values either, only its shape.
    """
    dst = first_output(call) or call.arg("self")
    src = call.arg("src", call.arg("other"))
    return Cost(0, unique_bytes(src), unique_bytes(dst))


@register_cost(aten.fill_, aten.fill, aten.zero_, aten.zero)
def fill_cost(call: OpCall) -> Cost:
    """A fill writes every element and reads nothing but a 0-dim fill value (``fill_.Tensor``)."""
    out = first_output(call)
    if out is None:
        out = call.arg("self")
    return Cost(0, unique_bytes(call.arg("value")), unique_bytes(out))
