"""Recognise an export that already carries a KV cache: past keys and values as graph inputs.

A decode-step export (``transformers`` with a ``DynamicCache`` input registered for export, or a
wrapper taking flattened ``[batch, kv_heads, past, head_dim]`` tensors per layer) feeds each
attention layer ``cat([past_k, new_k], dim=-2)``: the keys an SDPA reads are longer than its
queries by the cached context. This module walks back from an SDPA's unexpanded key (or value)
through those concatenations to the user inputs they start from.

What the serving model takes from them (``boomfx/serving/model.py``):
- the KV-cache shape per layer straight from the cache input (KV heads = dim 1, head size =
  dim 3, its dtype), so KV bytes per token come from the tensors the model really caches;
- the past-length symbol (dim 2), bound when the graph is priced;
- the concatenation nodes: the model's own cache write, replaced by the engine's. Among them,
  ``cat([empty, past_k])`` is the export rebuilding its cache object from the flattened inputs
  (transformers' ``DynamicCache`` unflatten calls ``update`` on empty layers): a copy of the whole
  cache that a framework keeping its cache object between steps never makes (``rewrap``).

Known limitations:
- NB: caches held as module buffers and updated in place (``StaticCache`` wrappers such as
  transformers' ``TorchExportableModuleWithStaticCache``) fix batch and sequence at export and are
  refused with one line (``ServingModelError``).
- NB: a sliding-window model's decode step does not export with a dynamic cache length beyond its
  window (transformers' ``DynamicSlidingWindowLayer`` branches on it): read its windows from the
  plain export, or give ``--sliding-window``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import sympy
import torch
import torch.fx

from boomfx.core.program import ROLE_BUFFER, ROLE_INPUT, Program

aten = torch.ops.aten

# ops a cached K/V passes through on its way into the concatenation (no data change)
_PASS_OPS = frozenset({aten.detach, aten.detach_, aten.alias, aten.clone, aten.contiguous, aten._to_copy, aten.to,
                       aten.lift_fresh_copy})
_CONCAT_OPS = frozenset({aten.cat, aten.concat, aten.concatenate})
_IN_PLACE_CACHE_OPS = frozenset({aten.index_copy, aten.index_copy_, aten.index_put, aten.index_put_, aten.copy_,
                                 aten.slice_scatter})
_SEQ_DIMS = (2, -2)            # [batch, kv_heads, seq, head_dim]


@dataclass(frozen=True)
class CacheSource:
    """Where one SDPA input's cached part comes from."""

    placeholder: str                 # the graph input holding past K (or V) of this layer
    chain: tuple[str, ...]           # the concatenation nodes (and their pass-through copies)
    rewrap: tuple[str, ...]          # concatenations of the cache input with empty tensors only (below)
    past: sympy.Expr                 # the cached length (dim 2 of the input)
    kv_heads: object                 # dim 1 (an int for a usable export)
    head_dim: object                 # dim 3
    dtype: torch.dtype


def _packet(node: torch.fx.Node) -> object:
    return getattr(node.target, "overloadpacket", None)


def _cat_dim(node: torch.fx.Node) -> int:
    if len(node.args) > 1:
        return int(node.args[1])     # type: ignore[call-overload]
    return int(node.kwargs.get("dim", 0))   # type: ignore[call-overload]


def _origin(node: torch.fx.Node, chain: list[torch.fx.Node]) -> torch.fx.Node:
    """Walk back through pass-through copies, recording them."""
    while node.op == "call_function" and _packet(node) in _PASS_OPS and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        chain.append(node)
        node = node.args[0]
    return node


def find_cache_source(program: Program, base: torch.fx.Node) -> Optional[CacheSource]:
    """The cache input behind an SDPA key/value ``base`` (``None``: the export carries no cache here).

    ``base`` must be ``cat(..., dim=-2)`` of 4-d tensors, nested or not, one operand of which
    leads (through copies) to a 4-d user input: that input is the past K/V."""
    chain: list[torch.fx.Node] = []
    found: list[torch.fx.Node] = []
    rewrap: list[str] = []
    stack = [_origin(base, chain)]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and _packet(node) in _CONCAT_OPS and _cat_dim(node) in _SEQ_DIMS:
            chain.append(node)
            parts = [p for p in (node.args[0] if isinstance(node.args[0], (list, tuple)) else ())
                     if isinstance(p, torch.fx.Node)]
            if sum(1 for p in parts if not _is_empty(p)) == 1 and len(parts) > 1:
                rewrap.append(node.name)
            for part in parts:
                stack.append(_origin(part, chain))
        elif node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() == 4 and program.input_roles.get(node.name) == ROLE_INPUT:
                found.append(node)
    if not found:
        return None
    src = found[0]
    val = src.meta["val"]
    past = sympy.sympify(val.shape[2].node.expr if hasattr(val.shape[2], "node") else int(val.shape[2]))
    return CacheSource(src.name, tuple(n.name for n in chain if n.op == "call_function"), tuple(rewrap), past,
                       val.shape[1], val.shape[3], val.dtype)


def _is_empty(node: torch.fx.Node) -> bool:
    """A tensor with no elements at export (``torch.tensor([])``-style placeholders of an empty cache)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    return any(isinstance(d, int) and d == 0 for d in val.shape)   # never int() a SymInt: that would guard it


def reads_a_buffer_cache(program: Program, base: torch.fx.Node) -> bool:
    """Whether ``base`` is a cache buffer updated in place (a ``StaticCache``-style export)."""
    node = _origin(base, [])
    seen = 0
    while node.op == "call_function" and seen < 8:
        if _packet(node) in _IN_PLACE_CACHE_OPS:
            return True
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
        seen += 1
    return node.op == "placeholder" and program.input_roles.get(node.name) == ROLE_BUFFER and \
        isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 4
