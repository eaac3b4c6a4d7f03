"""Megatron's two tensor-parallel operators as traceable custom ops, and their lowering to c10d nodes.

Why custom ops: the TP rewrite edits the *forward* export (``tensor_parallel.py``) and lets the
training trace derive the backward, so the collective a column-parallel linear issues in backward
must come out of autograd. ``region_enter`` (Megatron's ``f``; DTensor's ``from_local`` of a
``Replicate`` input in ``ColwiseParallel``) is the identity forward and all-reduces its gradient;
``region_exit`` (``g``; ``RowwiseParallel``'s ``Partial -> Replicate`` output) all-reduces forward
and passes its gradient through. Custom ops must return fresh tensors, so ``region_enter``'s forward
is a copy at trace time; ``lower_tp_ops`` removes it (the real runtime copies nothing) and turns
every ``boomfx_tp.all_reduce`` into ``_c10d_functional.all_reduce`` + ``wait_tensor`` on the ``tp``
group, the nodes the liveness pass, the collective pricer and the stream scheduler already read.
"""

from __future__ import annotations

import torch
import torch.fx

from boomfx.distributed.graph_edit import GraphEditor
from boomfx.core.program import PHASE_FORWARD, Program

c10d = torch.ops._c10d_functional
TP_GROUP = "tp"  # the mesh dimension name (boomfx/distributed/mesh_groups.py)


@torch.library.custom_op("boomfx_tp::all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """A sum over the TP group (traced only; lowered to ``_c10d_functional.all_reduce``)."""
    return x.clone()


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _all_reduce_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad  # g's backward: the replicated gradient is already every rank's


tp_all_reduce.register_autograd(_all_reduce_backward)


@torch.library.custom_op("boomfx_tp::region_enter", mutates_args=())
def tp_region_enter(x: torch.Tensor) -> torch.Tensor:
    """Identity into a column-parallel linear (traced only; removed by ``lower_tp_ops``)."""
    return x.clone()


@tp_region_enter.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _region_enter_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return torch.ops.boomfx_tp.all_reduce(grad)  # f's backward: the input gradient is partial per rank


tp_region_enter.register_autograd(_region_enter_backward)

ALL_REDUCE = torch.ops.boomfx_tp.all_reduce.default
REGION_ENTER = torch.ops.boomfx_tp.region_enter.default


def lower_tp_ops(program: Program, group: str = TP_GROUP) -> Program:
    """``program`` with ``region_enter`` removed and each TP all-reduce as c10d all_reduce + wait."""
    graph, _ = program.copied_graph()
    phases = dict(program.phases)
    edit = GraphEditor(graph, phases)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is REGION_ENTER:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            phases.pop(node.name, None)
        elif node.target is ALL_REDUCE:
            phase = program.phases.get(node.name, PHASE_FORWARD)
            val = node.meta["val"]
            reduced = edit.call(
                node, c10d.all_reduce.default, (node.args[0], "sum", group), val, phase, like=node
            )
            waited = edit.call(node, c10d.wait_tensor.default, (reduced,), val, phase, like=node)
            node.replace_all_uses_with(waited)
            graph.erase_node(node)
            phases.pop(node.name, None)
    leftover = [n.name for n in graph.nodes if n.op == "call_function" and n.target in (ALL_REDUCE, REGION_ENTER)]
    assert not leftover, leftover
    return program.rewritten(graph, phases=phases)

