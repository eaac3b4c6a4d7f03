"""Names a user can bind a symbolic size by, besides the export's own ``s77``.

Why: ``torch.export`` calls every dynamic size ``sNN``; a user who exported with
``Dim("dec_seq")`` has to guess which ``sNN`` is the decoder's length. Two kinds of names are given:

1. **The Dim names given at export**, when the program is still in memory: the export's
   ``ShapeEnv`` maps each input size's source (``L['dec'].size()[1]``) to the Dim's name. A ``.pt2``
   file does not record them (torch 2.13 saves only ``sNN`` and the ranges).
2. **Input and dimension**, always: ``dec.1`` is dimension 1 of the user input ``dec`` (the graph
   placeholder's name, which is the forward argument's name). A symbol that several inputs share
   gets every such name (``x.0`` and ``dec.0``).

Only dimensions that are exactly one symbol get names (a size ``2*s0`` names no symbol).

Example::

    names = symbol_names(ep)          # {s58: ("batch", "x.0", "dec.0"), s34: ("dec_seq", "dec.1"), ...}
"""
from __future__ import annotations

import re
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

# ``L['dec'].size()[1]``: the source name torch gives dimension 1 of local argument ``dec``.
_SIZE_SOURCE = re.compile(r"^L\['(?P<arg>[^']+)'\]\.size\(\)\[(?P<dim>\d+)\]$")


def _user_inputs(ep: ExportedProgram) -> list[tuple[str, torch.Tensor]]:
    """(placeholder name, fake value) of each tensor user input, in signature order."""
    names = [spec.arg.name for spec in ep.graph_signature.input_specs
             if spec.kind == InputKind.USER_INPUT and hasattr(spec.arg, "name")]
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    return [(name, vals[name]) for name in names if isinstance(vals.get(name), torch.Tensor)]


def _dim_symbol(size: Any) -> sympy.Symbol | None:
    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
        return size.node.expr
    return None


def _export_dim_names(inputs: list[tuple[str, torch.Tensor]]) -> dict[sympy.Symbol, list[str]]:
    """Dim names recorded by the export's ShapeEnv (present for in-memory programs only)."""
    out: dict[sympy.Symbol, list[str]] = {}
    by_name = dict(inputs)
    env = next((s.node.shape_env for _, v in inputs for s in v.shape if isinstance(s, torch.SymInt)), None)
    debug_names = getattr(env, "source_name_to_debug_name", None) or {}
    for source, dim_name in debug_names.items():
        m = _SIZE_SOURCE.match(source)
        val = by_name.get(m.group("arg")) if m else None
        if val is None or int(m.group("dim")) >= val.ndim:
            continue
        sym = _dim_symbol(val.shape[int(m.group("dim"))])
        if sym is not None and dim_name not in out.setdefault(sym, []):
            out[sym].append(dim_name)
    return out


def symbol_names(ep: ExportedProgram) -> dict[sympy.Symbol, tuple[str, ...]]:
    """Each symbol's names: export Dim names first, then ``<input>.<dim>`` for every input size it is."""
    inputs = _user_inputs(ep)
    names = _export_dim_names(inputs)
    for input_name, val in inputs:
        for dim, size in enumerate(val.shape):
            sym = _dim_symbol(size)
            if sym is not None:
                names.setdefault(sym, []).append(f"{input_name}.{dim}")
    return {sym: tuple(dict.fromkeys(n)) for sym, n in names.items()}
