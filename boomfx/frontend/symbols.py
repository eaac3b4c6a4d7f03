"""The size symbols of a captured graph: their exported ranges, example hints, and roles (batch / seq).

Shared by the ExportedProgram path (boomfx/frontend/capture.py) and the GraphModule path
(boomfx/frontend/graphmodule.py), so neither imports the other.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import sympy
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.utils._sympy.numbers import int_oo

from boomfx.core.program import ROLE_INPUT, SymbolInfo


def symbol_ranges(ep: ExportedProgram) -> dict[sympy.Symbol, tuple[int, Optional[int]]]:
    ranges: dict[sympy.Symbol, tuple[int, Optional[int]]] = {}
    for sym, vr in ep.range_constraints.items():
        if not isinstance(sym, sympy.Symbol):
            continue
        lo = int(vr.lower) if vr.lower not in (-int_oo, -sympy.oo) else 0
        hi = None if vr.upper in (int_oo, sympy.oo) else int(vr.upper)   # int_oo claims to be finite
        ranges[sym] = (lo, hi)
    return ranges


def user_input_vals(gm: torch.fx.GraphModule, roles: Mapping[str, str]) -> list[torch.Tensor]:
    vals = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and roles.get(node.name) == ROLE_INPUT:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                vals.append(val)
    return vals


def infer_symbol_roles(user_inputs: Sequence[torch.Tensor]) -> dict[sympy.Symbol, str]:
    """Batch is the first symbolic dim 0 of a user input; seq is dim 1 of token ids ([B, T] ints) or of [B, T, C]."""
    roles: dict[sympy.Symbol, str] = {}
    for val in user_inputs:
        if val.ndim == 0:
            continue
        d0 = val.shape[0]
        if isinstance(d0, torch.SymInt) and isinstance(d0.node.expr, sympy.Symbol) and "batch" not in roles.values():
            roles[d0.node.expr] = "batch"
        tokenish = (val.ndim == 2 and not val.dtype.is_floating_point) or val.ndim == 3
        if tokenish and "seq" not in roles.values():
            d1 = val.shape[1]
            if isinstance(d1, torch.SymInt) and isinstance(d1.node.expr, sympy.Symbol) and d1.node.expr not in roles:
                roles[d1.node.expr] = "seq"
    return roles


def symbol_hints(user_inputs: Sequence[torch.Tensor]) -> dict[sympy.Symbol, int]:
    hints: dict[sympy.Symbol, int] = {}
    for val in user_inputs:
        for size in val.shape:
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                try:
                    hints[size.node.expr] = int(size.node.hint)
                except (TypeError, AttributeError):
                    pass
    return hints


def symbols_of(ep: ExportedProgram, roles: Mapping[str, str]) -> dict[str, SymbolInfo]:
    user_inputs = user_input_vals(ep.graph_module, roles)
    sym_roles = infer_symbol_roles(user_inputs)
    hints = symbol_hints(user_inputs)
    return {
        str(sym): SymbolInfo(sym, lo, hi, hints.get(sym), sym_roles.get(sym))
        for sym, (lo, hi) in symbol_ranges(ep).items()
    }
