"""Let a .pt2 that calls custom ops this process has not registered load (``boomfx.passes.foreign_ops``).

Why: ``transformers``' Mixtral exports ``torch.ops.transformers.grouped_mm_fallback``; without
``transformers`` imported, torch's deserializer cannot resolve the target and the file is refused.
The file records, for every call, its arguments by name and kind and the metadata of every output,
which is all an analysis reads. So each unresolved target gets a stand-in op whose schema is read
off its calls, and the node targets are rewritten to the stand-in before deserialisation.

When the op *is* registered (the user imported its library), nothing is replaced: its real meta
kernel and backward are used.

Known limitations: argument types are read from the recorded values (an int is ``SymInt``, a None
is ``Tensor?``), so a schema that only accepts other types is not reproduced exactly; ops whose
calls disagree on argument names or kinds, or carry values with no schema type (graphs, custom
objects), stay refused with ``LoadError``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import torch

from boomfx.frontend.archive import MODEL_JSON, LoadError
from boomfx.passes.foreign_ops import FOREIGN_NAMESPACE, define_foreign_op

_TORCH_OPS = "torch.ops."
# namespaces torch itself resolves (or that are not operator libraries)
_BUILTIN_NAMESPACES = frozenset({"aten", "prims", "higher_order", "_operator", "profiler", "math", "builtins",
                                 FOREIGN_NAMESPACE})

# serialized Argument kind -> the schema type of the value it carries
_ARGUMENT_TYPES = {
    "as_tensor": "Tensor", "as_tensors": "Tensor[]", "as_optional_tensor": "Tensor?",
    "as_optional_tensors": "Tensor?[]", "as_none": "Tensor?",
    "as_int": "SymInt", "as_sym_int": "SymInt", "as_ints": "SymInt[]", "as_sym_ints": "SymInt[]",
    "as_float": "float", "as_sym_float": "SymFloat", "as_floats": "float[]", "as_sym_floats": "SymFloat[]",
    "as_bool": "bool", "as_sym_bool": "SymBool", "as_bools": "bool[]", "as_sym_bools": "SymBool[]",
    "as_string": "str", "as_strings": "str[]", "as_scalar_type": "ScalarType",
    "as_memory_format": "MemoryFormat", "as_layout": "Layout", "as_device": "Device",
}
_RETURN_TYPES = {"as_tensor": "Tensor", "as_tensors": "Tensor[]", "as_sym_int": "SymInt",
                 "as_sym_float": "SymFloat", "as_sym_bool": "SymBool"}
_KEYWORD = 2   # schema.ArgumentKind.KEYWORD
# custom op ("ns::op") -> the module of its library that registers it. Imported only for runs that call the op
# for real (``boomfx validate``'s step, ``kernels collect``'s measurements), never to analyse a file, and only
# from this table (a file cannot name a module to import)
REGISTERING_MODULES = {
    "transformers::grouped_mm_fallback": "transformers.integrations.moe",
    "transformers::grouped_mm_fallback_backward": "transformers.integrations.moe",
}


def op_is_registered(target: str) -> bool:
    """Whether ``"torch.ops.<ns>.<op>.<overload>"`` resolves in this process (or is not a library op)."""
    parts = target.split(".")[2:]
    if not target.startswith(_TORCH_OPS) or len(parts) < 3 or parts[0] in _BUILTIN_NAMESPACES:
        return True
    namespace, op, overload = parts[0], parts[1], parts[2]
    try:
        return hasattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return False


def _kind(arg: Any) -> Optional[str]:
    return next(iter(arg)) if isinstance(arg, dict) and len(arg) == 1 else None


def _signature(calls: list[dict], target: str, path: str) -> str:
    """"(Tensor input, Tensor weight, *, SymInt n=...) -> Tensor" as the calls of ``target`` imply."""
    args: Optional[list[tuple[str, str, bool]]] = None
    returns: Optional[list[str]] = None
    for call in calls:
        these = []
        for item in call.get("inputs") or []:
            name, kind = item.get("name"), _kind(item.get("arg"))
            if not isinstance(name, str) or not name.isidentifier() or kind not in _ARGUMENT_TYPES:
                raise LoadError(f"{path}: custom op {target} in {MODEL_JSON} has an argument "
                                f"{name!r} of a kind ({kind}) boomfx cannot give a schema type.")
            these.append((name, _ARGUMENT_TYPES[kind], item.get("kind") == _KEYWORD))
        outs = [_RETURN_TYPES.get(_kind(o) or "") for o in call.get("outputs") or []
                if _kind(o) != "as_none"]
        if None in outs:
            raise LoadError(f"{path}: custom op {target} in {MODEL_JSON} returns a value boomfx cannot give a "
                            f"schema type.")
        args = these if args is None else _merge_args(args, these, target, path)
        if returns is not None and returns != outs:
            raise LoadError(f"{path}: the calls of custom op {target} in {MODEL_JSON} disagree on what it returns.")
        returns = outs
    positional = [f"{t} {n}" for n, t, kw in args or [] if not kw]
    keyword = [f"{t} {n}" for n, t, kw in args or [] if kw]
    arg_text = ", ".join(positional + (["*"] + keyword if keyword else []))
    ret = (returns or [])
    ret_text = ret[0] if len(ret) == 1 else f"({', '.join(ret)})"
    return f"({arg_text}) -> {ret_text}"


def _merge_args(known: list, these: list, target: str, path: str) -> list:
    """Calls agree on names and kinds; a None in one call and a tensor in another is ``Tensor?``."""
    if [(n, kw) for n, _, kw in known] != [(n, kw) for n, _, kw in these]:
        raise LoadError(f"{path}: the calls of custom op {target} in {MODEL_JSON} disagree on their arguments.")
    merged = []
    for (name, a, kw), (_, b, _) in zip(known, these):
        if a != b and {a, b} <= {"Tensor", "Tensor?"}:
            a = "Tensor?"
        elif a != b:
            raise LoadError(f"{path}: custom op {target} in {MODEL_JSON} takes {name!r} as {a} in one call and "
                            f"{b} in another.")
        merged.append((name, a, kw))
    return merged


def replace_foreign_ops(program: dict, path: str) -> list[str]:
    """Rewrite, in place, node targets this process cannot resolve to stand-ins; return their names.

    ``program`` is the parsed ``models/model.json`` (already checked by ``validate``).
    """
    nodes = program.get("graph_module", {}).get("graph", {}).get("nodes", [])
    calls: dict[str, list[dict]] = {}
    for node in nodes:
        target = node.get("target") if isinstance(node, dict) else None
        if isinstance(target, str) and not op_is_registered(target):
            calls.setdefault(target, []).append(node)
    for target, these in sorted(calls.items()):
        parts = target.split(".")
        if len(parts) != 5 or not all(p.isidentifier() for p in parts[2:]):
            raise LoadError(f"{path}: {MODEL_JSON} calls {target!r}, which is not an operator name "
                            f"(torch.ops.<namespace>.<op>.<overload>).")
        namespace, op, overload = parts[2:]
        signature = _signature(these, target, path)
        try:
            stand_in = define_foreign_op(f"{namespace}::{op}", overload, signature)
        except (RuntimeError, ValueError) as err:   # torch refuses the schema the calls imply
            raise LoadError(f"{path}: custom op {target} in {MODEL_JSON} implies the schema {signature}, which torch "
                            f"refuses ({str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__}).") from err
        new_target = f"{_TORCH_OPS}{FOREIGN_NAMESPACE}.{stand_in._schema.name.split('::')[-1]}.{overload}"
        for node in these:
            node["target"] = new_target
    return sorted(t[len(_TORCH_OPS):] for t in calls)


def refuse_retrace_of_stand_ins(ep: torch.export.ExportedProgram, what: str) -> None:
    """``--train``/``--amp`` re-run every op on fake tensors; a stand-in has no shape rule or backward, unless
    ``passes/foreign_rules.py`` gives it one (``transformers``' grouped-mm fallback)."""
    from boomfx.core.errors import UnsupportedError
    from boomfx.passes.foreign_ops import can_rerun, is_foreign

    names = sorted({str(n.target) for n in ep.graph.nodes
                    if n.op == "call_function" and is_foreign(n.target) and not can_rerun(n.target)})
    if names:
        raise UnsupportedError(
            f"{what} re-runs every op, but custom op(s) {', '.join(names)} have no meta kernel or backward here: "
            f"import their library before analysing in Python, or export with plain ATen instead (transformers MoE: "
            f"experts_implementation='batched_mm'), or analyse without {what}.")


def stand_ins_called(graph: torch.fx.Graph) -> list[str]:
    """The library names (``"transformers::grouped_mm_fallback"``) of the stand-ins ``graph`` calls."""
    from boomfx.passes.foreign_ops import is_foreign, library_op_name

    return sorted({library_op_name(n.target) for n in graph.nodes
                   if n.op == "call_function" and is_foreign(n.target)})


def import_libraries(names: list[str]) -> bool:
    """Import the registering module (``REGISTERING_MODULES``) of each op of ``names`` that this Python has;
    whether any now defines its op (a file loaded again resolves it instead of standing it in)."""
    imported = False
    for module in sorted({REGISTERING_MODULES[name] for name in names if name in REGISTERING_MODULES}):
        try:
            importlib.import_module(module)
            imported = True
        except ImportError:
            pass
    return imported and any(_registered(name) for name in names)


def _registered(name: str) -> bool:
    namespace, op = name.split("::", 1)
    try:
        return hasattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return False


def with_library_ops(ep: torch.export.ExportedProgram, reload: Optional[Callable[[], torch.export.ExportedProgram]],
                     called: Callable[[str], bool] = lambda name: True) -> torch.export.ExportedProgram:
    """``ep`` whose stand-ins a real run calls (those of ``stand_ins_called`` that ``called`` keeps) replaced by
    the library's own ops: each op's registering module (``REGISTERING_MODULES``) imported where this Python
    has it, then the file loaded again by ``reload`` (None: an ExportedProgram given, not reloadable).

    Raises UnsupportedError (one line) naming the ops still without an implementation."""
    from boomfx.core.errors import UnsupportedError

    missing = [name for name in stand_ins_called(ep.graph) if called(name)]
    if not missing:
        return ep
    if import_libraries(missing) and reload is not None:
        ep = reload()
        missing = [name for name in stand_ins_called(ep.graph) if called(name)]
    if missing:
        libraries = sorted({REGISTERING_MODULES.get(name, name.split("::")[0]).split(".")[0] for name in missing})
        raise UnsupportedError(
            f"this runs the step for real, but custom op(s) {', '.join(missing)} have no implementation in this "
            f"process: install their library ({', '.join(libraries)}), or call boomfx from Python after importing "
            f"it{'' if reload is not None else ' and exporting again'}")
    return ep
