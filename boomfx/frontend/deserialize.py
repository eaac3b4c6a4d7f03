"""Fast path for turning ``models/model.json`` into an ``ExportedProgram``.

Why: profiling ``torch.export.load`` on an 8-layer Llama-70B-shaped file (5 s) shows ~40% in
``_dict_to_dataclass`` (it calls ``typing.get_type_hints`` for every one of ~45k objects) and
~35% in ``_parse_sym_expr`` (``sympy.sympify`` on the same few ``expr_str`` strings thousands of
times). This module keeps torch's own ``GraphModuleDeserializer`` (so nodes, names, metadata and
fake values are built exactly as torch builds them) and removes the repeated work:

1. ``fast_dict_to_dataclass``: one converter per schema type, type hints resolved once.
2. ``_MemoSymbols``: ``expr_str -> sympy.Expr`` and ``(expr_str, hint) -> SymInt`` caches,
   installed on one deserializer instance (the class is ``Final``, so no subclass), so every
   tensor with size ``s77`` gets the same symbol under one ``ShapeEnv``.

3. ``_MemoTensorMeta``: one fake tensor per distinct tensor *description* (sizes, strides, dtype,
   device) for the values of call nodes. Creating a fake tensor costs ~2 ms (FakeTensorMode
   dispatch, symbolic stride checks) and was ~60% of the remaining load time; an 80-layer Llama has
   ~6k values but only a few dozen distinct descriptions, so sharing makes the load nearly
   depth-free in this step. Graph inputs (parameters, buffers, user inputs) keep their own fake
   tensor each: their storage identity is what tells tied weights apart (``passes/liveness.py``).
4. ``_lazy_graph_modules``: the two GraphModules built on the way are ``_LazyGraphModule``s, whose
   Python code is generated on first call or ``.code``, not at construction (an 80-layer Llama's
   code generation took ~1 s of the load, and analysis never runs the loaded module); and the
   per-node search for pending unbacked symbols returns at once when none is pending.

Anything unexpected raises; ``boomfx.frontend.loader`` then falls back to torch's unpatched deserializer.

Known limitations: relies on private torch APIs (``torch._export.serde.serialize``), checked
against torch 2.13; a mismatch shows up as a fallback in the loader's log, not as a wrong graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import torch
import torch.export.exported_program as ep_mod
from torch._export.serde import schema
from torch._export.serde import serialize as serde
from torch._export.serde.union import _Union, _UnionTag
from torch.fx.experimental import symbolic_shapes
from torch.utils._sympy.numbers import int_oo

# ---------------------------------------------------------------------------------------------
# 1. JSON dict -> schema dataclasses, with converters compiled once per type.
# ---------------------------------------------------------------------------------------------

_Converter = Callable[[Any], Any]
_CONVERTERS: dict[Any, _Converter] = {}


def _identity(data: Any) -> Any:
    return data


def _converter(tp: Any) -> _Converter:
    """Return (and cache) a converter equivalent to ``serde._dict_to_dataclass(tp, data)``."""
    conv = _CONVERTERS.get(tp)
    if conv is None:
        conv = _build_converter(tp)
        _CONVERTERS[tp] = conv
    return conv


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(schema))


def _build_converter(tp: Any) -> _Converter:
    cls = serde._resolve_schema_cls(tp)
    if isinstance(cls, str):
        raise TypeError(f"unresolved schema type {cls!r}")
    origin = typing.get_origin(cls)
    args = typing.get_args(cls)
    if origin is Annotated:
        return _converter(cls.__origin__)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if len(args) != 2:
            raise TypeError(f"unsupported optional type {cls!r}")
        inner = args[0]
        return lambda data: None if data is None else _converter(inner)(data)
    if isinstance(cls, type) and issubclass(cls, _Union):
        return _union_converter(cls)
    if dataclasses.is_dataclass(cls):
        return _dataclass_converter(cls)
    if origin is list:
        (item_type,) = args
        return lambda data: [_converter(item_type)(d) for d in data] if data else data
    if origin is dict:
        value_type = args[1]
        return lambda data: {k: _converter(value_type)(v) for k, v in data.items()}
    if cls is float:
        return float
    if cls in (int, str, bool, typing.Any) or isinstance(cls, type):
        return _identity
    # Unknown typing construct: defer to torch's own (slow but exact) conversion.
    return lambda data: serde._dict_to_dataclass(cls, data)


def _union_converter(cls: type) -> _Converter:
    """Build ``cls.create(key=value)`` without its per-object ``dataclasses.fields`` scans.

    ``_Union.create`` and ``__post_init__`` walk ``fields(cls)`` for each of ~35k objects in a
    32-layer file; the result (all fields None but one, plus the ``_type`` tag) is built directly.
    """
    field_types = _hints(cls)
    all_none = {f.name: None for f in dataclasses.fields(cls)}
    cls.create(**{next(iter(all_none)): None})  # runs torch's one-off checks on the class

    def convert(data: dict[str, Any]) -> Any:
        if not isinstance(data, dict) or len(data) != 1:
            raise TypeError(f"{cls.__name__}: expected a one-key dict, got {data!r:.80}")
        ((key, value),) = data.items()
        if key not in all_none:
            raise TypeError(f"{cls.__name__} has no field {key!r}")
        obj = object.__new__(cls)
        obj.__dict__.update(all_none)
        obj.__dict__[key] = _converter(field_types[key])(value)
        obj._type = _UnionTag.create(key, cls)
        return obj

    return convert


def _dataclass_converter(cls: type) -> _Converter:
    field_types = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]

    def convert(data: dict[str, Any]) -> Any:
        # Like torch: keys unknown to this schema version are ignored (forward compatibility).
        return cls(**{n: _converter(field_types[n])(data[n]) for n in names if n in data})

    return convert


def fast_dict_to_dataclass(data: dict[str, Any]) -> schema.ExportedProgram:
    """Convert the raw ``models/model.json`` dict to ``schema.ExportedProgram``."""
    return _converter(schema.ExportedProgram)(data)


# ---------------------------------------------------------------------------------------------
# 2. Memoized symbolic-expression parsing on one GraphModuleDeserializer instance.
# ---------------------------------------------------------------------------------------------


class _MemoSymbols:
    """Per-load caches installed as instance attributes of a ``GraphModuleDeserializer``.

    ``_parse_sym_expr`` has side effects (ShapeEnv ranges, hints, stacks) that only matter the
    first time an expression is seen; later calls only need the hint check, which we keep.
    """

    def __init__(self, deser: Any) -> None:
        self.deser = deser
        self.exprs: dict[str, Any] = {}
        self.symints: dict[tuple[str, Any], Any] = {}
        self.original_parse = deser._parse_sym_expr
        self.original_sym_int = deser.deserialize_sym_int
        deser._parse_sym_expr = self.parse_sym_expr
        deser.deserialize_sym_int = self.deserialize_sym_int

    def parse_sym_expr(self, expr_str: str, hint: Any = None) -> Any:
        sym = self.exprs.get(expr_str)
        if sym is None:
            sym = self.original_parse(expr_str, hint)
            self.exprs[expr_str] = sym
            return sym
        shape_env = self.deser.shape_env
        if hint is not None and sym not in shape_env.backed_var_to_val and not (sym.is_Integer or sym.is_Float or sym.is_Boolean):
            shape_env.add_backed_var_to_val(sym, hint)
        return sym

    def deserialize_sym_int(self, s: Any) -> Any:
        if s.type != "as_expr":
            return self.original_sym_int(s)
        val = s.value
        hint = None if val.hint is None else val.hint.value
        key = (val.expr_str, hint)
        out = self.symints.get(key)
        if out is None:
            out = self.original_sym_int(s)
            self.symints[key] = out
        return out


def _sym_key(s: Any) -> Any:
    if s.type == "as_expr":
        v = s.value
        return ("e", v.expr_str, None if v.hint is None else (v.hint.type, v.hint.value))
    return (s.type, s.value)


class _MemoTensorMeta:
    """Share one fake tensor between call-node values with the same description (see module doc).

    A fake tensor here is metadata only: no pass mutates it or compares call-node values by
    identity; only graph inputs' storages are compared (tied weights), and those are not shared.
    """

    def __init__(self, deser: Any, graph: schema.Graph) -> None:
        self.original = deser.deserialize_tensor_meta
        self.inputs = {id(graph.tensor_values[i.value.name]) for i in graph.inputs
                       if i.type == "as_tensor" and i.value.name in graph.tensor_values}
        self.cache: dict[Any, Any] = {}
        deser.deserialize_tensor_meta = self.deserialize_tensor_meta

    def deserialize_tensor_meta(self, tm: Any) -> Any:
        if id(tm) in self.inputs:
            return self.original(tm)
        key = (tuple(_sym_key(s) for s in tm.sizes), tuple(_sym_key(s) for s in tm.strides), tm.dtype,
               tm.device.type, tm.device.index, tm.requires_grad, _sym_key(tm.storage_offset), tm.layout)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self.original(tm)
        return hit


def _range_map(program: schema.ExportedProgram) -> dict[str, Any]:
    return {
        k: symbolic_shapes.ValueRanges(
            serde._int_to_sympy_int(v.min_val, -int_oo), serde._int_to_sympy_int(v.max_val, int_oo)
        )
        for k, v in program.range_constraints.items()
    }


def check_schema_version(program: schema.ExportedProgram) -> None:
    """Raise ``ValueError`` when torch's deserializer would refuse the schema version."""
    version = program.schema_version
    if version.major != serde.SCHEMA_VERSION[0] and not (version.major == 0 and version.minor == 0):
        raise ValueError(
            f"schema version {version.major}.{version.minor} does not match this torch's "
            f"{serde.SCHEMA_VERSION[0]}.{serde.SCHEMA_VERSION[1]}"
        )


@contextlib.contextmanager
def _lazy_graph_modules() -> Any:
    """Within: ``torch.export``'s GraphModules are built lazy (see module doc, 4.)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    original = ep_mod._create_graph_module_for_export
    original_unbacked = symbolic_shapes._free_unbacked_symbols_with_path

    def create(root: Any, graph: torch.fx.Graph) -> torch.fx.GraphModule:
        return _LazyGraphModule(root, graph)

    def unbacked(a: Any, path: Any, real: Any = None, shape_env: Any = None, pending: Any = None,
                 simplify: bool = False) -> dict:
        # deserialize_graph asks this of every node's value; with no unbacked symbol pending it can
        # match nothing and returns {} (~0.2 s of an 80-layer Llama's load)
        if pending is not None and not pending:
            return {}
        return original_unbacked(a, path, real=real, shape_env=shape_env, pending=pending, simplify=simplify)

    ep_mod._create_graph_module_for_export = create
    symbolic_shapes._free_unbacked_symbols_with_path = unbacked
    try:
        yield
    finally:
        ep_mod._create_graph_module_for_export = original
        symbolic_shapes._free_unbacked_symbols_with_path = original_unbacked


def deserialize_fast(
    program: schema.ExportedProgram,
    state_dict: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
) -> torch.export.ExportedProgram:
    """Mirror ``ExportedProgramDeserializer.deserialize`` with a memoizing graph deserializer."""
    check_schema_version(program)
    symbol_name_to_range = _range_map(program)
    deser = serde.GraphModuleDeserializer()
    _MemoSymbols(deser)
    _MemoTensorMeta(deser, program.graph_module.graph)
    with _lazy_graph_modules():
        return _deserialize_fast(program, deser, state_dict, constants, symbol_name_to_range)


def _deserialize_fast(program: schema.ExportedProgram, deser: Any, state_dict: dict[str, torch.Tensor],
                      constants: dict[str, torch.Tensor], symbol_name_to_range: dict[str, Any]
                      ) -> torch.export.ExportedProgram:
    res = deser.deserialize(program.graph_module, state_dict, constants, None, symbol_name_to_range)
    range_constraints = {
        res.names_to_symbols[k]: v for k, v in symbol_name_to_range.items() if k in res.names_to_symbols
    }
    result = ep_mod.ExportedProgram(
        root=res.graph_module,
        graph=res.graph_module.graph,
        graph_signature=res.signature,
        state_dict=res.state_dict,
        range_constraints=range_constraints,
        module_call_graph=res.module_call_graph,
        example_inputs=None,
        constants=res.constants,
        verifiers=[serde.load_verifier(v) for v in program.verifiers],
    )
    result._guards_code = program.guards_code
    return result


def deserialize_torch(
    raw_program: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
) -> torch.export.ExportedProgram:
    """torch's own conversion and deserializer, fed parsed JSON and meta tensors (no pickle)."""
    program = serde._dict_to_dataclass(schema.ExportedProgram, raw_program)
    check_schema_version(program)
    return serde.ExportedProgramDeserializer().deserialize(program, state_dict, constants, None)
