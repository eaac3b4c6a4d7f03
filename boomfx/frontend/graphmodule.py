"""Capture from a ``torch.fx.GraphModule``: use its aten graph as is when it carries fake values,
otherwise export it (symbolically traced or Dynamo graphs hold module calls and torch functions)."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx
from torch.export import ExportedProgram

from boomfx.core.errors import BoomfxError
from boomfx.core.program import ROLE_INPUT, ROLE_PARAM, Program, SymbolInfo
from boomfx.frontend.symbols import infer_symbol_roles, symbol_hints


def _is_aten_graph_with_values(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            return False
        if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload) \
                and getattr(node.target, "__module__", "") != "_operator":
            return False
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            return False
    return True


def program_from_graph_module(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Program | ExportedProgram:
    """The Program of an aten graph with fake values; any other GraphModule exported (the caller,
    ``capture``, turns that ExportedProgram into a Program)."""
    if _is_aten_graph_with_values(gm):
        roles = {n.name: ROLE_INPUT for n in gm.graph.nodes if n.op == "placeholder"}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                roles[node.name] = ROLE_PARAM
        vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        sym_roles = infer_symbol_roles(vals)
        hints = symbol_hints(vals)
        symbols = {str(s): SymbolInfo(s, 0, None, hints.get(s), sym_roles.get(s)) for s in hints}
        return Program(gm, symbols, roles, source="GraphModule")
    if not example_inputs:
        raise BoomfxError("this GraphModule has no fake values on its nodes; pass example inputs so it can be exported")
    try:
        ep = torch.export.export(gm, tuple(example_inputs), strict=False)
    except Exception as exc:  # export errors are long; keep the first line
        raise BoomfxError(f"could not export the GraphModule: {str(exc).splitlines()[0]}") from exc
    return ep
