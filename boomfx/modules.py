"""Module paths of fx nodes (from ``nn_module_stack``) and the layer they belong to."""
from __future__ import annotations

import re
from typing import Optional

import torch.fx

_INDEX = re.compile(r"^\d+$")


def module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """[(path, class name)] from outermost to innermost, with the root module dropped."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value if isinstance(value, tuple) else (str(value), "")
        path = _clean(path)
        if path:
            out.append((path, cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))))
    return out


def _clean(path: str) -> str:
    """Export paths look like ``L['self'].h[0].attn`` in some versions and ``h.0.attn`` in others."""
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
