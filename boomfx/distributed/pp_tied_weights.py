"""Weights tied across pipeline stages (a tied embedding and head): each stage holds its own copy, and
its gradient is summed over those stages once a step.

Why: GPT-2, Gemma, small Llama-3 and Qwen models share ``lm_head.weight`` with the token embedding. Cut
into pipeline stages, the embedding runs on the first stage and the head on the last, so both ranks hold
the weight, its gradient and its AdamW state. ``torch.distributed.pipelining``'s tracer frontend copies
such a parameter into every stage that reads it; Megatron-LM keeps the copies equal by all-reducing
their gradients over its *embedding group* (the first and last pipeline ranks) after the pipeline's
last backward (``finalize_model_grads``), which a manual torchtitan-style split needs as well to train
the tied model it was given. That is what is modelled: the copies on every stage that reads the
weight, each stage's own share of the gradient accumulated over its micro-batches, then one in-place
``all_reduce`` of it over ``mesh_groups.PP_TIED_GROUP`` before the optimizer step.

In the single-device training graph the tied weight's gradient is an ``add`` of the contributions of
its readers (autograd sums them before ``AccumulateGrad``). ``tied_gradients`` finds the adds that join
contributions of different stages, takes them out of the stages' backwards, and gives each stage the
root of its own contributions (its partial gradient).

Known limitations: a weight two chunks of one rank read (interleaved 1F1B) is refused, as is a
gradient that is not a tree of adds over the readers' contributions.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx

from boomfx.core.errors import OptionError
from boomfx.core.program import ROLE_PARAM, Program
from boomfx.distributed.mesh_groups import PP_TIED_GROUP

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def shared_weights(program: Program, graph: torch.fx.Graph, fwd: Sequence[Sequence[torch.fx.Node]]
                   ) -> dict[torch.fx.Node, tuple[int, ...]]:
    """Each parameter the forwards of more than one stage read -> those stages, in order."""
    stage_of = {n: s for s, nodes in enumerate(fwd) for n in nodes}
    shared = {}
    for p in graph.nodes:
        if p.op != "placeholder" or program.input_roles.get(p.name) != ROLE_PARAM:
            continue
        stages = tuple(sorted({stage_of[u] for u in p.users if u in stage_of}))
        if len(stages) > 1:
            shared[p] = stages
    return shared


def tied_gradients(program: Program, shared: Mapping[torch.fx.Node, tuple[int, ...]],
                   bwd: list[list[torch.fx.Node]]) -> dict[torch.fx.Node, dict[int, torch.fx.Node]]:
    """For each shared weight's gradient node (``program.grad_nodes``): stage -> the node of that stage's
    backward that sums its own contributions. The adds joining different stages' contributions leave
    ``bwd``; an add of one stage's contributions moves to that stage's backward."""
    if not shared:
        return {}
    by_name = {n.name: n for n in program.graph.nodes}
    grad_of = {program.param_names.get(p.name, p.name): p for p in shared}
    out: dict[torch.fx.Node, dict[int, torch.fx.Node]] = {}
    for name, fqn in program.grad_nodes.items():
        if fqn not in grad_of or name not in by_name:
            continue
        root = by_name[name]
        stage_of = {n: s for s, nodes in enumerate(bwd) for n in nodes}
        stages_of: dict[torch.fx.Node, frozenset[int]] = {}

        def walk(n: torch.fx.Node) -> frozenset[int]:
            """The stages whose contributions ``n`` sums (an add of the tree, or a contribution)."""
            if n.target is aten.add.Tensor and all(isinstance(a, torch.fx.Node) for a in n.args[:2]) \
                    and (n is root or len(n.users) == 1):
                stages_of[n] = walk(n.args[0]) | walk(n.args[1])
            elif n in stage_of:
                stages_of[n] = frozenset({stage_of[n]})
            else:
                raise OptionError(f"pipeline parallelism: the gradient of {fqn}, a weight stages "
                                  f"{_stages(shared[grad_of[fqn]])} share, is not a sum of their contributions "
                                  f"({n.name} belongs to no stage's backward)")
            return stages_of[n]

        if len(walk(root)) == 1:     # one stage's contributions only (the others read it without a gradient)
            continue
        partials: dict[int, torch.fx.Node] = {}
        for n, stages in stages_of.items():
            if len(stages) > 1:      # joins stages: each keeps its own sum
                if n in stage_of:
                    bwd[stage_of[n]].remove(n)
                continue
            (s,) = stages
            parent_joins = n is root or any(len(stages_of.get(u, ())) > 1 for u in n.users)
            if n.target is aten.add.Tensor and stage_of.get(n) != s:
                _move(n, s, stage_of, bwd)
            if parent_joins:
                if s in partials:
                    raise OptionError(f"pipeline parallelism: stage {s} adds its share of the gradient of {fqn} "
                                      "into another stage's (not modelled)")
                partials[s] = n
        out[root] = partials
    return out


def _move(n: torch.fx.Node, s: int, stage_of: dict[torch.fx.Node, int], bwd: list[list[torch.fx.Node]]) -> None:
    """``n`` (an add of stage ``s``'s contributions, placed on another stage) into ``s``'s backward, after
    its arguments."""
    if n in stage_of:
        bwd[stage_of[n]].remove(n)
    nodes = bwd[s]
    args = {a for a in n.all_input_nodes}
    at = max((i for i, m in enumerate(nodes) if m in args), default=len(nodes) - 1)
    nodes.insert(at + 1, n)
    stage_of[n] = s


def _stages(stages: Sequence[int]) -> str:
    return " and ".join(str(s) for s in stages)


def resize_tied_reductions(graph: torch.fx.Graph) -> None:
    """Each tied-weight all-reduce (and its wait) sized as the gradient it now reads: after FSDP's rewrite
    that is the rank's shard of it (what a rank's sync reduces: the DTensor's local part)."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target is c10d.all_reduce_.default and n.args[2] == PP_TIED_GROUP:
            n.meta["val"] = n.args[0].meta["val"]
            for u in n.users:
                u.meta["val"] = n.meta["val"]
