"""Copy fx nodes between graphs without torch 2.13's per-node argument walk.

Why: ``torch.fx.Graph.create_node`` (torch 2.13) walks every new node's arguments with pytree to warn
about raw ``SymInt`` leaves, and ``node_copy`` / ``graph_copy`` go through it. The rank rewrites of
``--search`` copy ~1.3M nodes (pipeline stages, per-rank graphs, expanded layers); the walk was about
a sixth of a profiled 80-layer search (``benchmarks/results/search_speed.md``). The nodes copied here
come from graphs that fx built and checked, so the warning cannot fire: the node is created without
arguments and they are assigned after, which records uses and users exactly as ``create_node`` does.

Example::

    graph = torch.fx.Graph()
    env = {}
    for node in source.nodes:
        env[node] = copy_node(graph, node, lambda a: env[a])
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch.fx
from torch.fx.node import Argument, map_arg


def copy_node(graph: torch.fx.Graph, node: torch.fx.Node,
              arg_transform: Callable[[torch.fx.Node], Argument] = lambda a: a) -> torch.fx.Node:
    """What ``graph.node_copy(node, arg_transform)`` returns: the node at the insert point, its
    arguments mapped by ``arg_transform``, its name (made unique in ``graph``), type and a shallow
    copy of its meta."""
    args = map_arg(node.args, arg_transform)
    kwargs = map_arg(node.kwargs, arg_transform)
    new = graph.create_node(node.op, node.target, None, None, node.name, node.type)
    if args:
        new.args = args
    if kwargs:
        new.kwargs = kwargs
    new.meta = copy.copy(node.meta)
    return new


def copy_graph(graph: torch.fx.Graph, source: torch.fx.Graph,
               val_map: dict[torch.fx.Node, torch.fx.Node]) -> Optional[Argument]:
    """What ``graph.graph_copy(source, val_map)`` returns: every node of ``source`` not already in
    ``val_map`` copied into ``graph`` (``val_map`` filled), and the value its output returns (None
    without an output node; the output node itself is not copied)."""
    for node in source.nodes:
        if node in val_map:
            continue
        if node.op == "output":
            return map_arg(node.args[0], lambda a: val_map[a])
        val_map[node] = copy_node(graph, node, lambda a: val_map[a])
    return None
