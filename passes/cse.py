"""AOTAutograd's common-subexpression elimination of a compiled training step's joint graph.

Before it partitions the joint forward-backward graph, AOTAutograd's min-cut partitioner replaces every
node that repeats an earlier node's op on the same arguments by that earlier node
(``fx_graph_cse`` in torch/_functorch/compile_utils.py, called by ``min_cut_rematerialization_partition``
when ``functorch.config.cse`` is on, its default in torch 2.13). Random ops, ``empty``, nodes that alias a
graph output and nodes in different mutation regions (an in-place op between them) are kept.

Why it matters: models compute the same value twice where eager Python calls a helper twice. Phi-3's
export builds its causal mask twice (``where`` and ``where_1``, 256 KiB each at batch 4 x 128 tokens) and
saves both for the attention backwards; the compiled step computes and saves one (read in Inductor's
output code: one mask buffer), so without this pass the predicted training peak was 256 KiB high.

Only training programs are rewritten (inference graphs are not partitioned), and only the nodes inside
``torch.compile``'s graphs: the optimizer and ``META_EAGER`` nodes run eagerly, each call its own. A pipeline
stage's program runs each micro-batch through its own call of the compiled regions (``META_ACTION``): a
value is merged only with one of the same micro-batch (its forward or its backward: one joint graph).
"""
from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.fx

from boomfx.core.fx_copy import copy_node
from boomfx.core.program import META_ACTION, PHASE_BACKWARD, Program
from boomfx.passes.op_sets import draws_random, mutates

aten = torch.ops.aten

# what fx_graph_cse never merges besides random ops: an uninitialised buffer (each call a new one)
_NEVER_MERGED = frozenset((aten.empty, aten.empty_like, aten.empty_strided))


def eliminate_common_subexpressions(program: Program) -> Program:
    """``program`` with every compiled node that repeats an earlier one (same op, same arguments, no
    mutation between them) replaced by that earlier node; the same program when nothing repeats."""
    if not program.options.train or PHASE_BACKWARD not in set(program.phases.values()):
        return program
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    seen: dict[Hashable, torch.fx.Node] = {}
    kept = _never_merged(program)
    region = 0
    merged = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and mutates(node.target):
            region += 1                       # fx_graph_cse's mutation regions: no merge across a write
        if node.op == "call_function" and node not in kept:
            action = node.meta.get(META_ACTION)   # a pipeline stage's micro-batch: its own joint graph
            token = _token(node, env, (region, tuple(action[1:]) if action else None))
            if token is not None and token in seen:
                env[node] = seen[token]
                merged += 1
                continue
            new = copy_node(graph, node, lambda a: env[a])
            if token is not None:
                seen[token] = new
            env[node] = new
            continue
        env[node] = copy_node(graph, node, lambda a: env[a])
    if not merged:
        return program
    return program.rewritten(graph)


def _never_merged(program: Program) -> set[torch.fx.Node]:
    """Nodes kept as they are: eager ones, random ops, uninitialised buffers, the graph's outputs and the
    nodes whose values the program names (gradients), and views of those outputs."""
    out: set[torch.fx.Node] = set()
    outputs = {a for n in program.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    named = set(program.grad_nodes)
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        packet = getattr(node.target, "overloadpacket", None)
        if (program.runs_eagerly(node) or node in outputs or node.name in named or packet in _NEVER_MERGED
                or draws_random(node.target)):
            out.add(node)
    return out


def _token(node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node], region: Hashable) -> Hashable:
    """What identifies ``node``'s value: its op, its arguments (nodes by what they were merged into, values
    with their types: ``1`` and ``1.0`` differ) and its region (mutation region, micro-batch); None when an
    argument cannot be compared."""
    try:
        return (node.target, _key(node.args, env), _key(node.kwargs, env), region)
    except TypeError:
        return None


def _key(value: Any, env: dict[torch.fx.Node, torch.fx.Node]) -> Hashable:
    if isinstance(value, torch.fx.Node):
        return ("node", env[value].name)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v, env) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v, env)) for k, v in value.items())))
    hash(value)                               # raises TypeError for what cannot be compared
    return (type(value).__name__, value)
