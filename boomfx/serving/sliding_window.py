"""Read each attention layer's sliding window off the mask the export builds for it.

A sliding-window layer (Mistral, or Gemma-2/3's alternating local layers) differs from a full one
only in its mask: query ``q`` may see keys ``q - W + 1 .. q``. Mask constructions differ between
models and library versions (``kv_idx > q_idx - W`` comparisons, ``triu``/``tril`` bands, additive
``-inf`` masks), so the mask is not pattern-matched: its subgraph is *run* on a concrete input of
``probe_tokens`` tokens (token ids and attention masks all ones: masks depend on positions and
padding, not on token values) and the last query's row is read: it sees ``min(W, probe_tokens)``
keys. Fewer than all keys means a window of that many tokens.

Known limitations:
- NB: a window at least as long as the probe (``MAX_PROBE_TOKENS``, or the export's sequence range
  when shorter) is not seen; ``--sliding-window N`` gives it (a window that long never
  drops a token of a request shorter than the probe anyway).
- NB: a mask that depends on a parameter or a buffer is not run (its layers count as full
  attention unless ``--sliding-window`` is given).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import sympy
import torch
import torch.fx

from boomfx.core.program import ROLE_INPUT, Program

# one past the commonest long window (4096: Mistral-7B-v0.1, Gemma-2), so that it is seen; a
# [1, 1, 4097, 4097] boolean mask is 16 MiB while probing
MAX_PROBE_TOKENS = 4097


def _concrete(value: Any, bindings: Mapping[sympy.Symbol, int]) -> Any:
    if isinstance(value, torch.SymInt):
        return int(sympy.sympify(value.node.expr).subs(bindings))
    return value


def _placeholder_value(node: torch.fx.Node, bindings: Mapping[sympy.Symbol, int]) -> Optional[torch.Tensor]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    shape = [_concrete(s, bindings) for s in val.shape]
    if not all(isinstance(s, int) for s in shape):
        return None
    # token ids / attention masks as ones (no padding: every position present), cached K/V as zeros
    fill = 0 if val.is_floating_point() else 1
    return torch.full(shape, fill, dtype=val.dtype)


def _ancestors(root: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def run_mask(program: Program, mask: torch.fx.Node, bindings: Mapping[sympy.Symbol, int]) -> Optional[torch.Tensor]:
    """The mask tensor ``mask`` evaluates to at ``bindings`` (None when it cannot be run here)."""
    needed = _ancestors(mask)
    env: dict[torch.fx.Node, Any] = {}
    for node in program.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            if program.input_roles.get(node.name) != ROLE_INPUT:
                return None
            value = _placeholder_value(node, bindings)
            if value is None:
                return None
            env[node] = value
        elif node.op == "call_function":
            args = torch.fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = dict(torch.fx.node.map_arg(node.kwargs, lambda n: env[n]))
            if "device" in kwargs:
                kwargs["device"] = "cpu"
            try:
                env[node] = node.target(*args, **kwargs)
            except Exception:   # an op the probe cannot run on CPU: the window stays unknown
                return None
        else:
            return None
    out = env.get(mask)
    return out if isinstance(out, torch.Tensor) else None


def window_of_mask(mask: torch.Tensor) -> Optional[int]:
    """Keys the last query sees, when that is fewer than all keys (``None``: full attention)."""
    if mask.dim() < 2 or mask.shape[-1] < 2:
        return None
    row = mask.reshape(-1, mask.shape[-2], mask.shape[-1])[0, -1]
    allowed = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    seen = int(allowed.sum())
    return seen if 0 < seen < row.numel() else None


def probe_windows(program: Program, masks: Mapping[str, torch.fx.Node], bindings: Mapping[sympy.Symbol, int]
                  ) -> dict[str, Optional[int]]:
    """Each distinct mask node's window (keyed by SDPA node name); masks shared by layers run once."""
    by_mask: dict[str, Optional[int]] = {}
    out: dict[str, Optional[int]] = {}
    for sdpa, mask in masks.items():
        if mask.name not in by_mask:
            with torch.no_grad():
                value = run_mask(program, mask, bindings)
            by_mask[mask.name] = window_of_mask(value) if value is not None else None
        out[sdpa] = by_mask[mask.name]
    return out
