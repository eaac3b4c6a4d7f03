"""``boomfx/core/fx_copy.py`` copies nodes as fx's ``node_copy`` / ``graph_copy`` do (names, arguments, uses and
users, type, meta), without the per-node pytree walk torch 2.13's ``create_node`` adds."""
from __future__ import annotations

import operator

import torch
import torch.fx

from boomfx.core.fx_copy import copy_graph, copy_node


class _Block(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.cat([x, y], dim=1)
        b = torch.nn.functional.softmax(a, dim=-1)
        c = torch.add(b, x.sum(dim=1, keepdim=True), alpha=2.0)
        return c, a.shape[0] + b


def _signature(graph: torch.fx.Graph) -> list[tuple]:
    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: ("node", n.name))
    return [(n.op, n.name, n.target, arg(n.args), arg(n.kwargs), sorted(u.name for u in n.users), n.type)
            for n in graph.nodes]


def test_copy_graph_equals_fx_graph_copy() -> None:
    source = torch.fx.symbolic_trace(_Block()).graph
    for node in source.nodes:
        node.meta["tag"] = [node.name]
    expected, mine = torch.fx.Graph(), torch.fx.Graph()
    expected.output(expected.graph_copy(source, {}))
    val_map: dict = {}
    mine.output(copy_graph(mine, source, val_map))
    assert _signature(mine) == _signature(expected)
    assert len(val_map) == len(source.nodes) - 1                 # every node but the output
    copied = {n.name: n for n in mine.nodes}
    for node in source.nodes:
        if node.op != "output":
            assert val_map[node] is copied[node.name]
            assert copied[node.name].meta == node.meta
            assert copied[node.name].meta is not node.meta         # a shallow copy, as node_copy makes
    mine.lint()


def test_copy_node_maps_arguments_and_makes_names_unique() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(operator.add, (x, 1), {})
    target = torch.fx.Graph()
    tx = target.placeholder("x")
    first = copy_node(target, y, lambda a: tx)
    second = copy_node(target, y, lambda a: first)
    assert first.args == (tx, 1) and second.args == (first, 1)
    assert first.name == "add" and second.name != first.name
    assert set(tx.users) == {first} and set(first.users) == {second}
    kw = graph.call_function(torch.sum, (x,), {"dim": 0})
    third = copy_node(target, kw, lambda a: second)
    assert third.args == (second,) and third.kwargs == {"dim": 0} and second in third.all_input_nodes
