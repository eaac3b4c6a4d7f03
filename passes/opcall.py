"""Turn an fx node into an ``OpCall``: tensors become ``TensorSpec``, SymInts become sympy expressions.

This is the only place that reads fake values off fx nodes for pricing, so cost formulas and the
kernel database never see FakeTensors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
import torch.fx

from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec, to_sympy

if TYPE_CHECKING:  # the evaluator imports nothing from here; the hint only documents the argument
    from boomfx.passes.evaluate import Evaluator


def spec_of(value: Any) -> Any:
    """Replace tensors by TensorSpec and symbolic scalars by sympy, recursively through lists/tuples."""
    if isinstance(value, torch.Tensor):
        return TensorSpec.from_tensor(value)
    if isinstance(value, (list, tuple)):
        return type(value)(spec_of(v) for v in value) if isinstance(value, list) else tuple(spec_of(v) for v in value)
    return to_sympy(value)


def _arg_value(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return spec_of(arg.meta.get("val"))
    if isinstance(arg, (list, tuple)):
        return [_arg_value(a) for a in arg] if isinstance(arg, list) else tuple(_arg_value(a) for a in arg)
    return to_sympy(arg)


def opcall_from_node(node: torch.fx.Node, context: Optional[Mapping[str, Any]] = None) -> Optional[OpCall]:
    """The OpCall for a ``call_function`` node whose target is an aten-style OpOverload, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    args = tuple(_arg_value(a) for a in node.args)
    kwargs = {k: _arg_value(v) for k, v in node.kwargs.items()}
    val = node.meta.get("val")
    outputs = tuple(spec_of(v) for v in val) if isinstance(val, (list, tuple)) else (spec_of(val),)
    return OpCall.build(node.target, args, kwargs, outputs, context)


def bind_value(value: Any, ev: "Evaluator") -> Any:
    """Substitute concrete sizes into a spec / sympy value (recursively)."""
    import sympy

    if isinstance(value, TensorSpec):
        # scale: one bound spec per distinct spec and point (an optimizer foreach op's 720-tensor
        # lists repeat a handful of shapes); Evaluator keeps the cache, other callables get none
        cache = getattr(ev, "bound_specs", None)
        hit = cache.get(value) if cache is not None else None
        if hit is None:
            hit = TensorSpec(tuple(sympy.Integer(ev(s)) for s in value.shape),
                             tuple(sympy.Integer(ev(s)) for s in value.stride),
                             value.dtype, sympy.Integer(ev(value.storage_offset)))
            if cache is not None:
                cache[value] = hit
        return hit
    if isinstance(value, list):
        return [bind_value(v, ev) for v in value]
    if isinstance(value, tuple):
        return tuple(bind_value(v, ev) for v in value)
    if isinstance(value, sympy.Basic) and not isinstance(value, sympy.logic.boolalg.BooleanAtom):
        free = value.free_symbols
        if free:
            from boomfx.passes.evaluate import UnboundSymbolError
            bound = getattr(ev, "bindings", None)
            if bound is not None and not free <= bound.keys():
                return _data_dependent(value, ev)   # scale: no exception, no message to format
            try:
                return sympy.Integer(ev(value)) if value.is_integer is not False else sympy.Float(ev.number(value))
            except (UnboundSymbolError, TypeError):
                return _data_dependent(value, ev)   # e.g. Adam's step count, not a size
        return value
    return value


def _data_dependent(value: Any, ev: "Evaluator") -> Any:
    fix = getattr(ev, "data_dependent", None)
    return fix(value) if fix is not None else value


def bind_call(call: OpCall, ev: "Evaluator") -> OpCall:
    """The same call with every symbolic size replaced by its value under ``ev``'s bindings."""
    return OpCall(call.op, {k: bind_value(v, ev) for k, v in call.args.items()},
                  tuple(bind_value(v, ev) for v in call.outputs), call.context)
