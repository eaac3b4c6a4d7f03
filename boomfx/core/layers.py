"""Module paths of fx nodes (from ``nn_module_stack``) and the layer they belong to."""
from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import Optional

import torch.fx

_INDEX = re.compile(r"^\d+$")


def module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """[(path, class name)] from outermost to innermost, with the root module dropped."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value if isinstance(value, tuple) else (str(value), "")
        path = clean_module_path(path)
        if path:
            out.append((path, cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))))
    return out


@functools.lru_cache(maxsize=1 << 16)
def clean_module_path(path: str) -> str:
    """Export paths look like ``L['self'].h[0].attn`` in some versions and ``h.0.attn`` in others.

    Cached: a graph has a few hundred distinct paths but the rewrites ask for them once per node and unit."""
    path = path.replace("L['self'].", "").replace("L['self']", "")
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def module_path(node: torch.fx.Node) -> str:
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def module_class(node: torch.fx.Node) -> str:
    stack = module_stack(node)
    return stack[-1][1].rsplit(".", 1)[-1] if stack else ""


def layer_of(path: str) -> str:
    """The layer a module path belongs to: everything up to the first numeric component
    (``model.layers.3.mlp`` -> ``model.layers.3``), else its first component."""
    if not path:
        return "(top level)"
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return parts[0]


def layer_pattern(layer: str) -> Optional[str]:
    """``model.layers.3`` -> ``model.layers.*``; None when the layer is not a list entry."""
    parts = layer.split(".")
    if parts and _INDEX.match(parts[-1]):
        return ".".join(parts[:-1] + ["*"])
    return None


# -- the main layer list of a graph (activation checkpointing and depth-free training use it) ----------
_INDEXED = re.compile(r"(.+)\.(\d+)")


def stack_paths(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [str(path) for path, _cls in stack.values()]


def find_layer_list(graph: torch.fx.Graph) -> str | None:
    """Module path of the main layer list (e.g. ``"model.layers"``), or None if there is none.

    Chosen as the ``<prefix>.<int>`` family with the most distinct indices, ties broken by how many
    nodes it covers.
    """
    indices: dict[str, set[int]] = defaultdict(set)
    node_counts: dict[str, int] = defaultdict(int)
    parsed: dict[str, Optional[tuple[str, int]]] = {}      # path -> (prefix, index): few distinct paths
    for node in graph.nodes:
        seen: set[str] = set()
        for path in stack_paths(node):
            if path not in parsed:
                match = _INDEXED.fullmatch(path)
                parsed[path] = (match.group(1), int(match.group(2))) if match else None
            hit = parsed[path]
            if hit is not None and hit[0] not in seen:
                seen.add(hit[0])
                indices[hit[0]].add(hit[1])
                node_counts[hit[0]] += 1
    candidates = [p for p, idx in indices.items() if len(idx) >= 2]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (len(indices[p]), node_counts[p]))


@functools.lru_cache(maxsize=64)
def _instance_pattern(prefix: str) -> re.Pattern:
    return re.compile(re.escape(prefix) + r"\.\d+")


def layer_instance(node: torch.fx.Node, prefix: str) -> str | None:
    """The layer instance (``"h.3"``) that ``node`` belongs to, if any."""
    pattern = _instance_pattern(prefix)
    for path in stack_paths(node):
        if pattern.fullmatch(path):
            return path
    return None


def layer_index(node: torch.fx.Node, prefix: str) -> Optional[int]:
    path = layer_instance(node, prefix)
    return int(path.rsplit(".", 1)[1]) if path is not None else None
