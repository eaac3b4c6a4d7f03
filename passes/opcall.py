"""Turn an fx node into an ``OpCall``: tensors become ``TensorSpec``, SymInts become sympy expressions.

This is the only place that reads fake values off fx nodes for pricing, so cost formulas and the
kernel database never see FakeTensors.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.fx

from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec, to_sympy


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
