"""Which outputs of a node share storage with which inputs, read from the op schema's alias annotations.

``Tensor(a) self -> Tensor(a)`` is a view, ``Tensor(a!) self -> Tensor(a!)`` an in-place write. Two
CompositeImplicit ops claim an alias but copy when the input is not viewable: ``reshape`` and
``contiguous`` (and ``to`` when the dtype changes); for those the input/output strides decide.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx

from boomfx.passes.specs import contiguous_strides

aten = torch.ops.aten

# Ops whose alias annotation means "may alias": decided per call from strides/dtypes.
_MAYBE_COPY = {
    aten.reshape.default, aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.to.other, aten.type_as.default, aten.flatten.using_ints, aten.view_as.default, aten.reshape_as.default,
}

MAYBE_COPY_OPS = frozenset(_MAYBE_COPY)

# Dropout in eval mode (train=False) or with p=0 returns its input tensor itself (ATen's dropout).
# The in-place forms (``nn.Dropout(inplace=True)``, MobileNetV2's classifier) return their input too.
_IDENTITY_WHEN_INACTIVE = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
                           aten.feature_alpha_dropout.default, aten.dropout_.default, aten.feature_dropout_.default,
                           aten.alpha_dropout_.default, aten.feature_alpha_dropout_.default}


def _inactive_dropout(node: torch.fx.Node) -> bool:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is False or p == 0


def is_inactive_dropout(node: torch.fx.Node) -> bool:
    """A dropout that returns its input itself (eval mode or p=0), as ATen's ``dropout`` does."""
    return node.target in _IDENTITY_WHEN_INACTIVE and _inactive_dropout(node)


# Views whose schema carries no alias annotation (``_unsafe_view`` exists precisely to hide that its
# result aliases its input from autograd); they never copy.
# ``_c10d_functional.wait_tensor`` returns the very tensor it waited for.
_UNANNOTATED_VIEWS = {aten._unsafe_view.default, torch.ops._c10d_functional.wait_tensor.default}

# Views that do not carry an alias annotation we can rely on across versions.
_ALWAYS_VIEW_CALLABLES = {operator.getitem}


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    try:
        return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0
    except (TypeError, sympy.SympifyError):
        return False


def _is_contiguous(val: torch.Tensor) -> bool:
    shape = [s.node.expr if isinstance(s, torch.SymInt) else s for s in val.shape]
    strides = [s.node.expr if isinstance(s, torch.SymInt) else s for s in val.stride()]
    want = contiguous_strides(tuple(sympy.sympify(s) for s in shape))
    return all(_same(size, 1) or _same(st, w) for size, st, w in zip(shape, strides, want))


def _copies_anyway(node: torch.fx.Node) -> bool:
    """For the may-copy ops: True when this call materialises a new storage."""
    src = node.args[0] if node.args else None
    src_val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    out_val = node.meta.get("val")
    if not isinstance(src_val, torch.Tensor) or not isinstance(out_val, torch.Tensor):
        return False
    if src_val.dtype != out_val.dtype:
        return True
    if node.target in (aten.reshape.default, aten.flatten.using_ints, aten.reshape_as.default,
                       aten.contiguous.default):
        return not _is_contiguous(src_val)
    return False


def output_aliases(node: torch.fx.Node) -> list[Optional[tuple[torch.fx.Node, bool]]]:
    """For each output of ``node`` (one entry for a single tensor), the input node it aliases and whether
    it is an in-place write, or None when the output is a fresh storage."""
    target = node.target
    if target in _ALWAYS_VIEW_CALLABLES:
        src = node.args[0]
        return [(src, False)] if isinstance(src, torch.fx.Node) else [None]
    if getattr(target, "boomfx_fused", False):  # compiled execution: in-place buffer reuse (passes/compiled.py)
        return target.output_aliases(node)
    if target in _GRAD_MODE_WRAPPERS:
        return _wrapper_aliases(node)
    if not isinstance(target, torch._ops.OpOverload):
        return [None]
    if target in _UNANNOTATED_VIEWS:
        src = node.args[0]
        return [(src, False)] if isinstance(src, torch.fx.Node) else [None]
    val = node.meta.get("val")
    n_out = len(val) if isinstance(val, (list, tuple)) else 1
    if target in _MAYBE_COPY and _copies_anyway(node):
        return [None] * n_out
    if target in _IDENTITY_WHEN_INACTIVE and _inactive_dropout(node):
        src = node.args[0]
        return [(src, False)] if isinstance(src, torch.fx.Node) else [None]
    arg_sets, returns = _alias_plan(target)
    if not arg_sets:         # no argument aliases anything: every output is fresh
        return [None] * n_out
    # alias set of each tensor input -> the fx node passed for it
    by_set: dict[str, torch.fx.Node] = {}
    for i, name, kwarg_only, sets in arg_sets:
        value = node.args[i] if i < len(node.args) and not kwarg_only else node.kwargs.get(name)
        if isinstance(value, torch.fx.Node):
            for s in sets:
                by_set.setdefault(s, value)
    results: list[Optional[tuple[torch.fx.Node, bool]]] = []
    for i in range(n_out):
        ret = returns[min(i, len(returns) - 1)] if returns else None
        src = None
        if ret is not None:
            sets, is_write = ret
            for s in sets:
                if s in by_set:
                    src = by_set[s]
                    break
        results.append((src, is_write) if src is not None else None)
    return results


# torch.export's wrappers of a region run under another grad or autocast mode (``with torch.no_grad():`` inside
# forward): a submodule called on operands. RWKV rescales its weights in place under no_grad at its first eval
# forward; the wrapper returns the weights themselves, which a fresh storage per output counted again.
_GRAD_MODE_WRAPPERS = frozenset(op for op in (getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None),
                                              getattr(torch.ops.higher_order, "wrap_with_autocast", None)) if op)


def _wrapper_aliases(node: torch.fx.Node) -> list[Optional[tuple[torch.fx.Node, bool]]]:
    """Per output of a grad/autocast-mode wrapper: the operand it aliases inside its submodule (a returned
    placeholder, or a view or in-place result of one, followed through the submodule's own nodes), else None."""
    val = node.meta.get("val")
    n_out = len(val) if isinstance(val, (list, tuple)) else 1
    at = next((i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
    owner = node.graph.owning_module
    if at is None or owner is None:
        return [None] * n_out
    try:
        body = owner.get_submodule(node.args[at].target)
    except AttributeError:
        return [None] * n_out
    operands = node.args[at + 1:]
    placeholders = {p: k for k, p in enumerate(n for n in body.graph.nodes if n.op == "placeholder")}
    returned = next(n for n in body.graph.nodes if n.op == "output").args[0]
    returned = list(returned) if isinstance(returned, (list, tuple)) else [returned]

    def operand_of(inner: Any, write: bool) -> Optional[tuple[torch.fx.Node, bool]]:
        while isinstance(inner, torch.fx.Node):
            if inner in placeholders:
                k = placeholders[inner]
                outer = operands[k] if k < len(operands) else None
                return (outer, write) if isinstance(outer, torch.fx.Node) else None
            if inner.op != "call_function":
                return None
            alias = output_aliases(inner)[0] if inner.target is not operator.getitem else None
            if alias is None:
                return None
            inner, write = alias[0], write or alias[1]
        return None

    out = [operand_of(r, False) for r in returned]
    return (out + [None] * n_out)[:n_out]


_ALIAS_PLANS: dict[Any, tuple] = {}


def _alias_plan(op: torch._ops.OpOverload) -> tuple:
    """Per op, once (scale: reading ``_schema.arguments`` builds new objects on every access):
    ((index, name, kwarg_only, alias sets) of each argument with alias info,
     ((sets, is_write) or None) of each return; a list return's set is on the wildcard)."""
    plan = _ALIAS_PLANS.get(op)
    if plan is None:
        schema = op._schema
        arg_sets = tuple((i, a.name, a.kwarg_only, tuple(a.alias_info.before_set | a.alias_info.after_set))
                         for i, a in enumerate(schema.arguments) if a.alias_info is not None)
        returns = tuple((tuple(r.alias_info.before_set or {"*"}), bool(r.alias_info.is_write))
                        if r.alias_info is not None else None for r in schema.returns)
        plan = _ALIAS_PLANS[op] = (arg_sets, returns)
    return plan


def is_view_node(node: torch.fx.Node) -> bool:
    """A node that launches no kernel: every output aliases an input without writing it."""
    if node.op != "call_function":
        return False
    aliases = output_aliases(node)
    return bool(aliases) and all(a is not None and not a[1] for a in aliases)
