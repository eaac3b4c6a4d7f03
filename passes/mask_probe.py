"""Run the subgraph that builds an attention mask on concrete sizes, without the model's weights.

Why: mask constructions differ between models and library versions (``kv_idx > q_idx - W`` comparisons,
``triu``/``tril`` bands, additive ``-inf`` masks), so a mask is not pattern-matched: its subgraph is run on
token ids and attention masks of ones (masks depend on positions and padding, not on token values) and
the result read. Used to find sliding windows (``boomfx/serving/sliding_window.py``) and masks an eager
module never builds (``passes/eager_sdpa.py``).

Known limitations:
- NB: a mask that depends on a parameter or a buffer is not run (``run_mask`` returns None).
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


def visible(mask: torch.Tensor) -> torch.Tensor:
    """Which keys each query may see: a boolean mask as is, an additive one where it is not -inf (or the
    dtype's minimum)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2
