"""Check that a loaded program's recorded shapes are the ones its own ops produce.

Why: the costs and lifetimes boomfx reports are read from the fake values recorded on each node
(``meta["val"]``) and from the weights' shapes. A file whose JSON is well formed can still hold
numbers that do not fit together: a weight whose shape in the weights config differs from its
placeholder in the graph, or an intermediate tensor recorded as ``[2, 0]`` where its inputs give
``[2, 64]``. Analysed as is, such a file gives a silently wrong prediction; checked, it gives one
``LoadError`` naming the entry and the node.

Checks, in order:

0. Every size symbol has an exported range (or is an unbacked ``u*`` symbol an op creates).
1. Every parameter, buffer and constant placeholder has the shape, strides and dtype of its tensor
   in the payload config (``data/weights/...`` or ``data/constants/...``).
2. Every call of an ATen operator is re-run on the fake values of its inputs (``torch``'s own meta
   kernels, under the program's ``ShapeEnv``) and its output must have the recorded sizes and dtype
   (not strides: output layouts depend on the kernel that ran at export; sizes compared by their example hints, so equivalent symbolic forms agree). Calls with
   the same operator and input descriptions are re-run once, so the cost does not grow with depth
   (about 20-50 distinct calls in the shipped examples).

Known limitations: operators without a meta kernel (custom ops), data-dependent ones and
higher-order operators are not re-run (nothing to compare against); strides of size-0/1 dims and
of empty tensors are not compared (they carry no meaning).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch._dispatch.python import enable_python_dispatcher
import torch.fx
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, UnsupportedOperatorException
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from boomfx.frontend.archive import CONSTANTS_CONFIG, MODEL_JSON, WEIGHTS_CONFIG, LoadError

# Exceptions that mean "this op cannot be re-run on fake values", not "this graph is inconsistent".
_CANNOT_RERUN = (UnsupportedOperatorException, DataDependentOutputException, GuardOnDataDependentSymNode,
                 NotImplementedError)


def _fmt(values: Any) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _hint(value: Any) -> Any:
    """A size's example value (an int), or its expression when it has no hint (unbacked)."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else str(value.node.expr)
    return int(value)


# ---------------------------------------------------------------------------------------------
# 1. Payloads against placeholders.
# ---------------------------------------------------------------------------------------------


def _check_payloads(ep: ExportedProgram, source: str) -> None:
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        entry = CONSTANTS_CONFIG if spec.kind == InputKind.CONSTANT_TENSOR else WEIGHTS_CONFIG
        payload = ep.state_dict.get(spec.target) if spec.kind != InputKind.CONSTANT_TENSOR else None
        if payload is None:
            payload = ep.constants.get(spec.target)
        node = placeholders.get(getattr(spec.arg, "name", ""))
        val = node.meta.get("val") if node is not None else None
        if not isinstance(payload, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue   # a missing payload is the deserializer's to refuse; non-tensors carry no shape
        recorded = (tuple(_hint(s) for s in val.shape), val.dtype)
        stored = (tuple(int(s) for s in payload.shape), payload.dtype)
        if recorded != stored or _meaningful_strides(val) != _meaningful_strides(payload):
            raise LoadError(
                f"{source} is inconsistent: {entry} gives {spec.target!r} sizes {_fmt(stored[0])} strides "
                f"{_fmt(payload.stride())} {stored[1]}, but {MODEL_JSON} records its placeholder {node.name} "
                f"as {_fmt(val.shape)} strides {_fmt(val.stride())} {val.dtype}.")


# ---------------------------------------------------------------------------------------------
# 2. Recorded values against the ops' own meta kernels.
# ---------------------------------------------------------------------------------------------


def _meaningful_strides(t: torch.Tensor) -> Optional[tuple]:
    """Strides of the dims with more than one element (the others' strides are arbitrary)."""
    sizes = [_hint(s) for s in t.shape]
    if any(s == 0 for s in sizes if isinstance(s, int)):
        return None
    return tuple(_hint(st) for st, n in zip(t.stride(), sizes) if n != 1)


def _describe(value: Any) -> Any:
    """A hashable description of an argument: what a meta kernel's result depends on."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()),
                str(value.storage_offset()), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((k, _describe(v)) for k, v in value.items())
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(value.node.expr))
    return ("const", type(value).__name__, repr(value))


def _summary(value: Any) -> Any:
    """What is compared between a recorded value and a re-run: sizes (hints) and dtype. Not strides: an
    op's output layout depends on the kernel that ran at export (T5's SDPA on CPU records [512, 128, 16, 1]
    where its meta kernel gives [512, 16, 64, 1]), so a stride difference is no sign of damage."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(_hint(s) for s in value.shape), value.dtype, None)
    if isinstance(value, (list, tuple)):
        return tuple(_summary(v) for v in value)
    if isinstance(value, torch.SymInt):
        return ("int", _hint(value))
    return None      # other values (SymFloat, None, constants) are not compared


def _show(summary: Any) -> str:
    if isinstance(summary, tuple) and summary and summary[0] == "tensor":
        return f"{_fmt(summary[1])} {summary[2]}" + (f" strides {_fmt(summary[3])}" if summary[3] else "")
    if isinstance(summary, tuple) and summary and summary[0] == "int":
        return str(summary[1])
    if isinstance(summary, tuple):
        return "(" + ", ".join(_show(s) for s in summary) + ")"
    return repr(summary)


def _fake_mode(ep: ExportedProgram) -> Any:
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return None


def _arg_value(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _check_recorded_values(ep: ExportedProgram, source: str) -> None:
    mode = _fake_mode(ep)
    if mode is None:
        return
    rerun: dict[Any, Any] = {}
    # torch's Python meta functions and decompositions, as export runs them: some C++ kernels read sizes
    # as ints (constant_pad_nd), and re-running them would fix a size symbol in the program's ShapeEnv to
    # its example value (MobileNetV2's padding: every later analysis bound to batch 2)
    # no_grad: shapes do not depend on grad mode, and an in-place op on a parameter-like leaf (a
    # StaticCache's index_copy_ into its buffer) is refused under grad mode though export recorded it
    with mode, enable_python_dispatcher(), torch.no_grad():
        for node in ep.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            recorded = node.meta.get("val")
            args = torch.fx.node.map_arg(node.args, _arg_value)
            kwargs = torch.fx.node.map_arg(node.kwargs, _arg_value)
            key = (node.target, _describe(args), _describe(kwargs))
            if key not in rerun:
                args, kwargs = _clone_written(node.target, args, kwargs)
                rerun[key] = _run(node, args, kwargs, source)
            expected = rerun[key]
            if expected is None:
                continue
            got = _summary(recorded)
            if got != expected:
                raise LoadError(f"{source} is inconsistent: {MODEL_JSON} records node {node.name} "
                                f"({node.target}) as {_show(got)}, but its inputs give {_show(expected)}.")


def _clone_written(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Clones of the inputs ``op`` writes to (``Tensor(a!)``), so re-running it leaves the recorded
    values untouched (``resize_``/``unsqueeze_`` would change their metadata)."""
    written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    if not written:
        return args, kwargs
    names = [a.name for a in op._schema.arguments]
    clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    args = tuple(clone(v) if i < len(names) and names[i] in written else v for i, v in enumerate(args))
    kwargs = {k: clone(v) if k in written else v for k, v in kwargs.items()}
    return args, kwargs


def _run(node: torch.fx.Node, args: Any, kwargs: Any, source: str) -> Any:
    """The summary of the op's result on these inputs, None if it cannot be re-run."""
    try:
        return _summary(node.target(*args, **kwargs))
    except _CANNOT_RERUN:
        return None
    except Exception as e:  # noqa: BLE001  any other failure: the recorded inputs do not fit the op
        if isinstance(e, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode):
            return None
        text = str(e).strip().splitlines()
        raise LoadError(f"{source} is inconsistent: {MODEL_JSON} node {node.name} ({node.target}) fails on its "
                        f"recorded inputs ({type(e).__name__}: {text[0][:200] if text else ''}).") from e


def _sizes_of(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [*value.shape, *value.stride(), value.storage_offset()]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _sizes_of(v)]
    if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return [value]
    return []


def _check_symbols(ep: ExportedProgram, source: str) -> None:
    """Every size symbol has an exported range, or is an unbacked one (``u0``) that an op creates."""
    known = {str(s) for s in ep.range_constraints}
    seen: set[int] = set()
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if val is None or id(val) in seen:
            continue
        seen.add(id(val))
        for size in _sizes_of(val):
            if not isinstance(size, (torch.SymInt, torch.SymBool, torch.SymFloat)):
                continue
            for sym in size.node.expr.free_symbols:
                name = str(sym)
                if name not in known and not name.startswith("u"):
                    raise LoadError(f"{source} is inconsistent: {MODEL_JSON} records node {node.name} with "
                                    f"size symbol {name!r}, which has no exported range (range_constraints).")


def check_graph(ep: ExportedProgram, source: str) -> None:
    """Raise ``LoadError`` when the loaded program's shapes do not fit together (see the module doc)."""
    _check_symbols(ep, source)
    _check_payloads(ep, source)
    _check_recorded_values(ep, source)
