"""Check the JSON of a .pt2 archive before anything reads it: types, references and tensor metadata.

Why: torch's deserializer (and boomfx's fast copy of it) assumes a well-formed file; a damaged one
makes it fail deep inside with ``AttributeError: 'str' object has no attribute 'items'``, or worse,
load and give a wrong graph. Checking the raw JSON first turns every such file into one
``LoadError`` that names the archive entry and the field, e.g.
``model.pt2 is corrupt: models/model.json graph_module.graph.nodes[12].inputs[0].arg has no field 'as_tensorx'``.

What is checked (torch's own schema, ``torch._export.serde.schema``, is the source of truth):

1. Types: every field of every schema dataclass is present (unless it has a default) and of its
   declared type; a union is a one-key object whose key is one of its fields; enum codes (dtype,
   layout, memory format) are known.
2. Tensor metadata: as many strides as sizes; no negative size, stride or storage offset.
3. Calls: each node's argument names are its operator's (once each, the required ones present);
   pytree specs of the module call graph are JSON trees.
4. References: every tensor or symbol a node reads is a graph input or the output of an earlier
   node, every name is defined once and has metadata; the graph signature names the graph's inputs
   and outputs, in order; exported ranges have ``min <= max``.
5. Payload configs (weights, constants): a ``config`` object of ``fqn -> {path_name, tensor_meta}``.

Known limitations: symbolic expressions (``expr_str``) are parsed by the deserializer, which turns
a malformed one into a ``LoadError`` naming ``models/model.json``, not the field.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import torch
from torch._export.serde import schema
from torch._export.serde import serialize as serde

from boomfx.frontend.archive import CONSTANTS_CONFIG, MODEL_JSON, WEIGHTS_CONFIG, LoadError

_Path = list  # keys and indices from the entry's root to the value being checked
_Checker = Callable[[Any, _Path], None]
_CHECKERS: dict[Any, _Checker] = {}


class _Invalid(Exception):
    """A value does not match the schema; ``path`` says where (formatted once, at the top)."""

    def __init__(self, path: _Path, problem: str) -> None:
        super().__init__(problem)
        self.path = list(path)
        self.problem = problem


def _where(path: _Path) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "(root)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# 1. Type checkers compiled once per schema type.
# ---------------------------------------------------------------------------------------------


def _checker(tp: Any) -> _Checker:
    check = _CHECKERS.get(tp)
    if check is None:
        _CHECKERS[tp] = lambda data, path: _CHECKERS[tp](data, path)   # recursive types (Graph)
        check = _CHECKERS[tp] = _build_checker(tp)
    return check


def _expect(kinds: tuple[type, ...], name: str) -> _Checker:
    """A scalar check; ``bool`` is an ``int`` in Python but not in the schema."""
    bool_ok = bool in kinds

    def check(data: Any, path: _Path) -> None:
        if not isinstance(data, kinds) or (isinstance(data, bool) and not bool_ok):
            raise _Invalid(path, f"is {_short(data)}, not {name}")
    return check


# how torch's serializer writes floats JSON has no number for (``serde._dataclass_to_dict``): -inf in a
# ``masked_fill(mask, -inf)`` (DeepSeek-V3's and PhiMoE's routers) is ``"-Infinity"``
NON_FINITE_FLOATS = frozenset({"Infinity", "-Infinity", "NaN"})


def _check_float(data: Any, path: _Path) -> None:
    if isinstance(data, bool) or not (isinstance(data, (int, float))
                                      or isinstance(data, str) and data in NON_FINITE_FLOATS):
        raise _Invalid(path, f"is {_short(data)}, not a number")


def _build_checker(tp: Any) -> _Checker:
    cls = serde._resolve_schema_cls(tp)
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin is Annotated:
        return _checker(cls.__origin__)
    if origin in (typing.Union, types.UnionType):
        inner = [_checker(a) for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {cls!r}")

        def optional(data: Any, path: _Path) -> None:
            if data is not None:
                inner[0](data, path)
        return optional
    if isinstance(cls, type) and issubclass(cls, schema._Union):
        return _union_checker(cls)
    if dataclasses.is_dataclass(cls):
        return _dataclass_checker(cls)
    if origin is list:
        item = _checker(args[0])

        def check_list(data: Any, path: _Path) -> None:
            if not isinstance(data, list):
                raise _Invalid(path, f"is {_short(data)}, not a list")
            for i, value in enumerate(data):
                path.append(i)
                item(value, path)
                path.pop()
        return check_list
    if origin is dict:
        value_check = _checker(args[1])

        def check_dict(data: Any, path: _Path) -> None:
            if not isinstance(data, dict):
                raise _Invalid(path, f"is {_short(data)}, not an object")
            for key, value in data.items():
                path.append(key)
                value_check(value, path)
                path.pop()
        return check_dict
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        codes = {m.value for m in cls}

        def check_enum(data: Any, path: _Path) -> None:
            if not isinstance(data, int) or isinstance(data, bool) or data not in codes:
                raise _Invalid(path, f"is {_short(data)}, not a {cls.__name__} code")
        return check_enum
    if cls is bool:
        return _expect((bool,), "a bool")
    if cls is int:
        return _expect((int,), "an integer")
    if cls is float:
        return _check_float
    if cls is str:
        return _expect((str,), "a string")
    if cls is typing.Any:
        return lambda data, path: None
    raise TypeError(f"unsupported schema type {cls!r}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(schema))


def _union_checker(cls: type) -> _Checker:
    hints = _hints(cls)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    def check(data: Any, path: _Path) -> None:
        if not isinstance(data, dict) or len(data) != 1:
            raise _Invalid(path, f"is {_short(data)}, not a one-key {cls.__name__} object")
        ((key, value),) = data.items()
        if key not in fields:
            raise _Invalid(path, f"has no field {key!r} (a {cls.__name__} is one of {', '.join(fields)})")
        path.append(key)
        _checker(fields[key])(value, path)
        path.pop()
    return check


def _dataclass_checker(cls: type) -> _Checker:
    hints = _hints(cls)
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]

    def check(data: Any, path: _Path) -> None:
        if not isinstance(data, dict):
            raise _Invalid(path, f"is {_short(data)}, not a {cls.__name__} object")
        missing = required - data.keys()
        if missing:
            raise _Invalid(path, f"has no {', '.join(sorted(missing))} (a {cls.__name__} needs it)")
        for name, tp in fields:     # unknown keys are ignored, as torch does (forward compatibility)
            if name in data:
                path.append(name)
                _checker(tp)(data[name], path)
                path.pop()
    return check


# ---------------------------------------------------------------------------------------------
# 2-3. Tensor metadata and references of one graph (and its subgraphs).
# ---------------------------------------------------------------------------------------------


def _check_tensor_meta(meta: dict[str, Any], path: _Path) -> None:
    sizes, strides = meta["sizes"], meta["strides"]
    if len(sizes) != len(strides):
        raise _Invalid(path, f"has {len(sizes)} sizes but {len(strides)} strides")
    for key, values in (("sizes", sizes), ("strides", strides), ("storage_offset", [meta["storage_offset"]])):
        for i, v in enumerate(values):
            if "as_int" in v and v["as_int"] < 0:
                raise _Invalid(path + [key, i] if key != "storage_offset" else path + [key],
                               f"is {v['as_int']}, negative")


def _names_read(arg: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, name) of each tensor / symbol an Argument refers to (nested graphs are checked apart)."""
    ((key, value),) = arg.items()
    if key in ("as_tensor",):
        return [("tensor", value["name"])]
    if key == "as_tensors":
        return [("tensor", v["name"]) for v in value]
    if key == "as_nested_tensors":
        return [("tensor", v["name"]) for inner in value for v in inner]
    if key in ("as_optional_tensor",):
        return [("tensor", value["as_tensor"]["name"])] if "as_tensor" in value else []
    if key == "as_optional_tensors":
        return [("tensor", v["as_tensor"]["name"]) for v in value if "as_tensor" in v]
    if key in ("as_sym_int", "as_sym_bool", "as_sym_float"):
        return [(key[3:], value["as_name"])] if "as_name" in value else []
    if key in ("as_sym_ints", "as_sym_bools", "as_sym_floats"):
        return [(key[3:-1], v["as_name"]) for v in value if "as_name" in v]
    if key == "as_string_to_argument":
        return [n for v in value.values() for n in _names_read(v)]
    return []


_VALUE_TABLES = {"tensor": "tensor_values", "sym_int": "sym_int_values", "sym_bool": "sym_bool_values",
                 "sym_float": "sym_float_values"}


def _check_graph(graph: dict[str, Any], path: _Path, outer: set[tuple[str, str]]) -> None:
    for name, meta in graph["tensor_values"].items():
        _check_tensor_meta(meta, path + ["tensor_values", name])
    defined: set[tuple[str, str]] = set(outer)

    def define(arg: dict[str, Any], where: _Path) -> None:
        for kind, name in _names_read(arg):
            if (kind, name) in defined and not outer:
                raise _Invalid(where, f"defines {name!r} a second time")
            table = _VALUE_TABLES[kind]
            if name not in graph.get(table, {}):
                raise _Invalid(where, f"names {name!r}, which has no entry in {table}")
            defined.add((kind, name))

    for i, arg in enumerate(graph["inputs"]):
        define(arg, path + ["inputs", i])
    for i, node in enumerate(graph["nodes"]):
        for j, named in enumerate(node["inputs"]):
            where = path + ["nodes", i, "inputs", j, "arg"]
            for kind, name in _names_read(named["arg"]):
                if (kind, name) not in defined:
                    raise _Invalid(where, f"reads {name!r}, which no earlier node or graph input defines")
            subgraph = named["arg"].get("as_graph")
            if subgraph is not None:
                _check_graph(subgraph["graph"], where + ["as_graph", "graph"], defined)
        for j, out in enumerate(node["outputs"]):
            define(out, path + ["nodes", i, "outputs", j])
    for i, arg in enumerate(graph["outputs"]):
        for kind, name in _names_read(arg):
            if (kind, name) not in defined:
                raise _Invalid(path + ["outputs", i], f"returns {name!r}, which nothing defines")


def _spec_arg_names(spec: dict[str, Any]) -> list[str]:
    ((_, value),) = spec.items()
    arg = value.get("arg")
    if arg is None:
        return []
    if "name" in arg:
        return [arg["name"]]
    return [name for _, name in _names_read(arg)]


def _check_signature(gm: dict[str, Any], path: _Path) -> None:
    graph, sig = gm["graph"], gm["signature"]
    for key, specs, args in (("input_specs", sig["input_specs"], graph["inputs"]),
                             ("output_specs", sig["output_specs"], graph["outputs"])):
        if len(specs) != len(args):
            raise _Invalid(path + ["signature", key], f"has {len(specs)} entries for the graph's {len(args)}")
        for i, (spec, arg) in enumerate(zip(specs, args)):
            graph_names = [name for _, name in _names_read(arg)]
            spec_names = _spec_arg_names(spec)
            if spec_names and graph_names and spec_names != graph_names:
                raise _Invalid(path + ["signature", key, i],
                               f"names {spec_names[0]!r} but the graph's {key[:-6]} {i} is {graph_names[0]!r}")


def _check_ranges(ranges: dict[str, Any], path: _Path) -> None:
    for name, r in ranges.items():
        lo, hi = r["min_val"], r["max_val"]
        if lo is not None and hi is not None and lo > hi:
            raise _Invalid(path + [name], f"has min_val {lo} > max_val {hi}")


def _check_spec_tree(text: str, path: _Path) -> None:
    """A serialized pytree spec: JSON ``[protocol, node]``, each node ``{type, context, children_spec}``."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise _Invalid(path, f"is {_short(text)}, not a JSON tree spec") from None
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[0], int) and not isinstance(doc[0], bool)):
        raise _Invalid(path, "is not a [protocol, tree] pair")
    stack = [doc[1]]
    while stack:
        node = stack.pop()
        if (not isinstance(node, dict) or not isinstance(node.get("type"), (str, type(None)))
                or not isinstance(node.get("context"), (str, type(None)))
                or not isinstance(node.get("children_spec"), list)):
            raise _Invalid(path, f"holds a tree node {_short(node)} without type, context and children_spec")
        stack.extend(node["children_spec"])


def _check_call_specs(gm: dict[str, Any], path: _Path) -> None:
    for i, entry in enumerate(gm["module_call_graph"]):
        sig = entry.get("signature")
        if sig is not None:
            for key in ("in_spec", "out_spec"):
                _check_spec_tree(sig[key], path + ["module_call_graph", i, "signature", key])


@functools.lru_cache(maxsize=4096)
def _op_arguments(target: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """(all argument names, required ones) of a registered ATen-style operator; None when unknown.

    Only attributes of ``torch.ops`` are looked up: nothing is imported.
    """
    parts = target.split(".")
    if len(parts) != 5 or parts[:2] != ["torch", "ops"]:
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
    except (AttributeError, RuntimeError):
        return None
    op_schema = getattr(op, "_schema", None)
    if op_schema is None:
        return None
    names = frozenset(a.name for a in op_schema.arguments)
    required = frozenset(a.name for a in op_schema.arguments if not a.has_default_value() and not a.kwarg_only)
    return names, required


def _check_node_arguments(graph: dict[str, Any], path: _Path) -> None:
    """Each call's argument names are its operator's, once each, required ones present: a renamed or
    dropped argument would otherwise load as a different call (a linear without its bias)."""
    for i, node in enumerate(graph["nodes"]):
        known = _op_arguments(node["target"])
        if known is None:
            continue
        names, required = known
        given = [named["name"] for named in node["inputs"]]
        where = path + ["nodes", i, "inputs"]
        unknown = [n for n in given if n not in names]
        if unknown:
            raise _Invalid(where, f"names argument {unknown[0]!r}, which {node['target']} does not have")
        if len(set(given)) != len(given):
            raise _Invalid(where, f"gives an argument of {node['target']} twice")
        missing = sorted(required - set(given))
        if missing:
            raise _Invalid(where, f"lacks {node['target']}'s required argument {missing[0]!r}")


# ---------------------------------------------------------------------------------------------
# 4. Payload configs, and the public entry point.
# ---------------------------------------------------------------------------------------------


def _check_payload_config(config: dict[str, Any], path: _Path) -> None:
    for fqn, payload in config.items():
        where = path + [fqn]
        if not isinstance(payload, dict):
            raise _Invalid(where, f"is {_short(payload)}, not a payload object")
        if not isinstance(payload.get("path_name", ""), str):
            raise _Invalid(where + ["path_name"], f"is {_short(payload['path_name'])}, not a string")
        meta = payload.get("tensor_meta")
        if meta is not None:
            _checker(schema.TensorMeta)(meta, where + ["tensor_meta"])
            _check_tensor_meta(meta, where + ["tensor_meta"])


def _check_signature_payloads(program: dict[str, Any], weights: dict[str, Any], constants: dict[str, Any],
                              source: str) -> None:
    """Every parameter and persistent buffer of the signature has a payload in the weights config, every
    tensor constant (and non-persistent buffer) one in either config, as ``torch.export.save`` writes them."""
    for spec in program["graph_module"]["signature"]["input_specs"]:
        ((kind, value),) = spec.items()
        if kind == "parameter" or (kind == "buffer" and value["persistent"]):
            fqn, entries = value["parameter_name" if kind == "parameter" else "buffer_name"], (weights,)
        elif kind in ("buffer", "tensor_constant"):
            fqn = value["buffer_name" if kind == "buffer" else "tensor_constant_name"]
            entries = (weights, constants)
        else:
            continue
        if not any(fqn in config for config in entries):
            entry = WEIGHTS_CONFIG if len(entries) == 1 else f"{WEIGHTS_CONFIG} or {CONSTANTS_CONFIG}"
            raise LoadError(f"{source} is corrupt: {entry} has no payload for the {kind.replace('_', ' ')} "
                            f"{fqn!r} that {MODEL_JSON}'s graph signature names.")


def _raise(source: str, entry: str, err: _Invalid) -> None:
    raise LoadError(f"{source} is corrupt: {entry} {_where(err.path)} {err.problem}.") from None


def check_program_json(program: Any, source: str) -> None:
    """Raise ``LoadError`` naming ``models/model.json`` and the field if ``program`` is malformed."""
    try:
        _checker(schema.ExportedProgram)(program, [])
        gm = program["graph_module"]
        _check_graph(gm["graph"], ["graph_module", "graph"], set())
        _check_node_arguments(gm["graph"], ["graph_module", "graph"])
        _check_signature(gm, ["graph_module"])
        _check_call_specs(gm, ["graph_module"])
        _check_ranges(program["range_constraints"], ["range_constraints"])
    except _Invalid as err:
        _raise(source, MODEL_JSON, err)


def check_payload_configs(weights: dict[str, Any], constants: dict[str, Any], source: str,
                          program: dict[str, Any] | None = None) -> None:
    """Raise ``LoadError`` naming the config entry and the field if a payload of a config is malformed,
    or (given the checked ``program``) if a weight its signature names has no payload.

    ``weights`` and ``constants`` are the ``config`` objects of the two entries (``read_archive``
    has checked that they are objects).
    """
    for entry, config in ((WEIGHTS_CONFIG, weights), (CONSTANTS_CONFIG, constants)):
        try:
            _check_payload_config(config, ["config"])
        except _Invalid as err:
            _raise(source, entry, err)
    if program is not None:
        _check_signature_payloads(program, weights, constants, source)
