"""Rewrite serialized pytree specs so that they load without the user's model code.

Why: an export of a ``transformers`` model records its output container as
``transformers.modeling_outputs.CausalLMOutputWithPast``; torch's loader then fails unless that
module was imported, and enum contexts even make it ``importlib.import_module`` a name taken from
the file. The analysis needs the graph, not the container, so each type that is not already
registered with ``torch.utils._pytree`` becomes a plain container with the same children:

- a context that is a list of strings with one entry per child -> ``dict`` keyed by them
  (``ModelOutput`` subclasses, dataclasses);
- a namedtuple whose class is unknown -> ``dict`` keyed by its recorded field names;
- anything else -> ``tuple``.

Enum objects inside a context are replaced by the string ``"<fqn>.<name>"``. Nothing is imported.
"""

from __future__ import annotations

import json
from typing import Any

from torch.utils import _pytree as pytree

_NAMEDTUPLE = "collections.namedtuple"
_DICT = "builtins.dict"
_TUPLE = "builtins.tuple"


def _drop_enums(obj: Any) -> tuple[Any, bool]:
    """Replace ``{"__enum__": ...}`` objects by strings; report whether any was found."""
    if isinstance(obj, dict):
        if "__enum__" in obj:
            return f"{obj.get('fqn', '')}.{obj.get('name', '')}", True
        found = False
        out = {}
        for k, v in obj.items():
            out[k], f = _drop_enums(v)
            found |= f
        return out, found
    if isinstance(obj, list):
        items = [_drop_enums(v) for v in obj]
        return [v for v, _ in items], any(f for _, f in items)
    return obj, False


def _plain(node: dict[str, Any], keys: Any) -> dict[str, Any]:
    n_children = len(node["children_spec"])
    if isinstance(keys, list) and len(keys) == n_children and all(isinstance(k, str) for k in keys):
        if len(set(keys)) == n_children:
            return {**node, "type": _DICT, "context": json.dumps(keys)}
    return {**node, "type": _TUPLE, "context": "null"}


def _sanitize_node(node: dict[str, Any], namedtuple_fields: dict[str, list[str]], replaced: list[str]) -> dict[str, Any]:
    children = [_sanitize_node(c, namedtuple_fields, replaced) for c in node.get("children_spec", [])]
    node = {**node, "children_spec": children}
    type_name = node.get("type")
    if type_name is None:
        return node
    context_str = node.get("context")
    try:
        context = json.loads(context_str) if isinstance(context_str, str) else None
    except json.JSONDecodeError:
        context = None
    if type_name == _NAMEDTUPLE:
        if context in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            return node
        replaced.append(f"namedtuple {context}")
        return _plain(node, namedtuple_fields.get(context) if isinstance(context, str) else None)
    if type_name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
        replaced.append(type_name)
        return _plain(node, context)
    if isinstance(context_str, str) and "__enum__" in context_str:
        cleaned, found = _drop_enums(context)
        node_def = pytree.SUPPORTED_SERIALIZED_TYPES[pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE[type_name]]
        # Only the default context decoder (json with enum_object_hook) imports enum modules.
        if found and node_def.from_dumpable_context is None:
            replaced.append(f"enum context of {type_name}")
            return {**node, "context": json.dumps(cleaned)}
    return node


def sanitize_treespec(serialized: str, namedtuple_fields: dict[str, list[str]], replaced: list[str]) -> str:
    """Return ``serialized`` (a ``treespec_dumps`` string) with unknown types made plain.

    Names of the replaced types are appended to ``replaced`` so the caller can log them.
    """
    protocol, root = json.loads(serialized)
    if protocol != 1:
        return serialized
    before = len(replaced)
    new_root = _sanitize_node(root, namedtuple_fields, replaced)
    if len(replaced) == before:
        return serialized
    return json.dumps([protocol, new_root])


def sanitize_program(program: dict[str, Any]) -> list[str]:
    """Sanitize every in_spec/out_spec of a raw ``models/model.json`` dict in place.

    Returns the replaced type names (empty when the file needs no rewriting).
    """
    gm = program["graph_module"]
    fields = {k: v.get("field_names", []) for k, v in (gm.get("treespec_namedtuple_fields") or {}).items()}
    replaced: list[str] = []
    for entry in gm.get("module_call_graph", []):
        sig = entry.get("signature")
        if not sig:
            continue
        for key in ("in_spec", "out_spec"):
            if isinstance(sig.get(key), str):
                sig[key] = sanitize_treespec(sig[key], fields, replaced)
    return replaced
