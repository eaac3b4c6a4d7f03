"""Small helpers the per-rank rewrites share: new nodes with meta values, phases and module stacks.

A rewrite works on ``Program.copied_graph()``; every node it adds gets a ``meta["val"]`` (a meta
tensor of its exact shape, so the liveness pass and the cost formulas read it like any other node),
the phase of where it runs and the module stack of the node it is attached to (so the report groups
its time and memory by layer). The rewrite records which nodes keep which others alive beyond their
arguments (``RuntimeUses``: FSDP frees an unsharded parameter at its unit's post-forward, not at its
last use), which ``boomfx/analyze.py`` merges into the liveness.
"""

from __future__ import annotations

import math
from typing import Any, Container, Iterable, Optional, Sequence

import torch
import torch.fx



def meta_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(int(s) for s in shape), dtype=dtype, device="meta")


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(list(shape)):
        strides.append(acc)
        acc *= max(int(size), 1)
    return list(reversed(strides))


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


class GraphEditor:
    """Adds nodes to a copied graph and keeps the program's side tables (phases, extra uses) in step."""

    def __init__(self, graph: torch.fx.Graph, phases: dict[str, str]) -> None:
        self.graph = graph
        self.phases = phases
        self.extra_uses: dict[str, list[str]] = {}

    def call(
        self,
        anchor: torch.fx.Node,
        target: Any,
        args: tuple,
        val: Any,
        phase: str,
        kwargs: Optional[dict] = None,
        like: Optional[torch.fx.Node] = None,
        after: bool = False,
    ) -> torch.fx.Node:
        """A ``call_function`` node right before (or after) ``anchor``, with ``meta["val"] = val``."""
        ctx = self.graph.inserting_after(anchor) if after else self.graph.inserting_before(anchor)
        with ctx:
            node = self.graph.call_function(target, args, kwargs or {})
        node.meta["val"] = val
        source = like if like is not None else anchor
        # from_node: a lowered op comes from the export node it replaces (pipeline_stages._model_output
        # tells the model's ops from the loss's by it)
        for key in ("nn_module_stack", "stack_trace", "from_node"):
            if key in source.meta:
                node.meta[key] = source.meta[key]
        self.phases[node.name] = phase
        return node

    def wait(self, anchor: torch.fx.Node, collective: torch.fx.Node, phase: str,
             like: Optional[torch.fx.Node] = None, after: bool = False) -> torch.fx.Node:
        """The ``wait_tensor`` of ``collective`` (placed as ``call`` places nodes), holding its result."""
        return self.call(anchor, torch.ops._c10d_functional.wait_tensor.default, (collective,),
                         collective.meta["val"], phase, like=like, after=after)

    def keep_alive(self, at: torch.fx.Node, nodes: Iterable[torch.fx.Node]) -> None:
        """``at`` also keeps ``nodes`` alive: their storages are freed after ``at`` at the earliest."""
        names = self.extra_uses.setdefault(at.name, [])
        for n in nodes:
            if n.name not in names:
                names.append(n.name)


def owning_layer(path: str, layers: Container[str]) -> Optional[str]:
    """The layer whose module ``path`` is or is inside (``layers`` do not nest), else None: one lookup per
    prefix of the path, not one path test per layer (quadratic in depth: 20 s on 80 layers)."""
    parts = path.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if prefix in layers:
            return prefix
    return None
