"""Inductor's ``reorder_for_locality``: in an inference graph, each value is computed right before its consumer.

Inductor's post-grad passes (torch/_inductor/fx_passes/post_grad.py, torch 2.13, ``config.reorder_for_locality``,
on by default, inference graphs only) walk the graph from its end; at each node, every producer whose users have
all been passed already (the node itself and nodes after it) is moved right before the node, in argument order,
and the walk goes on from the moved producer, pulling its own producers after it. A value is thus computed as
late as its first consumer allows, never across a mutation (producer and node in one mutation region), never a
``getitem`` of a multi-output op alone, and never an op that draws random numbers.

Why it matters: a value computed early but read late moves the *liveness* of everything it reads. BLOOM splits
its fused q/k/v projection into three copies; the value copy's only reader is the attention-probabilities
matmul after the softmax, so Inductor copies it there, and the 1.5 MiB fused projection stays alive through
the scores (a 1 MiB buffer) to that point: its compiled inference peak, 10.2% over our prediction from the
export's order (read in Inductor's output code: ``cpp_fused__softmax_..._clone_...`` writes the value copy).

``reorder_for_locality(program)`` applies the same walk to a compiled inference program before fusion (the
post-grad graph is what Inductor's scheduler then fuses, in this order). The export's metadata asserts, which
Inductor removes, neither hold a producer back nor move; each is put back after its input. As in Inductor, the
nodes from the first ``copy_`` on (the epilogue writing mutated inputs back) are left where they are.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from boomfx.core.program import PHASE_BACKWARD, Program
from boomfx.passes.fusion import _is_assert
from boomfx.passes.op_sets import draws_random, mutates


def reorder_for_locality(program: Program) -> Program:
    """``program`` (a compiled inference program) in Inductor's locality order; unchanged for training
    programs (Inductor's pass is inference-only) and where nothing moves."""
    if program.options.train or PHASE_BACKWARD in set(program.phases.values()):
        return program
    graph, _ = program.copied_graph()
    region: dict[torch.fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op == "call_function" and mutates(node.target):
            current += 1
        region[node] = current
    asserts = [n for n in graph.nodes if _is_assert(n)]
    before = [n.name for n in graph.nodes]
    seen: set[torch.fx.Node] = set()

    def users(n: torch.fx.Node) -> list[torch.fx.Node]:
        return [u for u in n.users if not _is_assert(u)]

    first_copy = next(iter(graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)), None)
    past_epilogue = first_copy is None          # nodes after the first copy_ (input mutations) stay as they are
    node = next(iter(reversed(graph.nodes)))
    while node is not None and node.op != "root":
        seen.add(node)
        if not past_epilogue:
            past_epilogue = node is first_copy
        elif not _is_assert(node):
            for producer in _argument_nodes(node):
                if (producer.op == "call_function" and producer.target is not operator.getitem
                        and not _is_assert(producer) and all(u in seen for u in users(producer))
                        and region[producer] == region[node] and not draws_random(producer.target)):
                    node.prepend(producer)
        node = node.prev
    position = {n: i for i, n in enumerate(graph.nodes)}
    for check in asserts:                      # after the last of its inputs
        last = max(check.all_input_nodes, key=position.__getitem__, default=None)
        if last is not None:
            last.append(check)
    if [n.name for n in graph.nodes] == before:
        return program
    graph.lint()
    return program.rewritten(graph)


def _argument_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes of ``node``'s arguments in the order ``torch.fx.map_arg`` visits them (repeats included)."""
    found: list[torch.fx.Node] = []
    torch.fx.map_arg((node.args, node.kwargs), found.append)
    return found
