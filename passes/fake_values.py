"""The fake tensors a program's nodes carry (``meta["val"]``), for the rewrites that rerun ops on them to
learn a new node's value (its shape, strides and dtype) in the program's own fake mode."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch.fx

if TYPE_CHECKING:
    from boomfx.core.program import Program


def graph_fake_mode(graph: torch.fx.Graph) -> Optional[Any]:
    """The fake mode of the first fake value in ``graph`` (None in a graph without any)."""
    return next((v.fake_mode for n in graph.nodes for v in [n.meta.get("val")] if hasattr(v, "fake_mode")), None)


def fake_values(args: Any) -> Any:
    """``args`` with each node replaced by its fake value: what rerunning its consumer on fakes needs."""
    return torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))


def copy_to_rewrite(program: "Program") -> Optional[tuple[torch.fx.Graph, dict[str, str], Any]]:
    """A copy of ``program``'s graph to rewrite, its phases by node name (a new node takes the phase of the
    node it replaces) and its fake mode; None when the graph carries no fake values (nothing can be rerun)."""
    graph, _ = program.copied_graph()
    mode = graph_fake_mode(graph)
    return None if mode is None else (graph, dict(program.phases), mode)
