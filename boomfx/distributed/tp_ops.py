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

import operator
from typing import Optional

import torch
import torch.fx

from boomfx.distributed.graph_edit import GraphEditor
from boomfx.core.program import META_RUNTIME_USES, META_TP_LINEAR, PHASE_FORWARD, Program

aten = torch.ops.aten
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


@torch.library.custom_op("boomfx_tp::reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """A ``"sum"`` or ``"max"`` over the TP group with no gradient of its own (loss parallel's reductions,
    inside its autograd function; traced only, lowered to ``_c10d_functional.all_reduce``)."""
    return x.clone()


@tp_reduce.register_fake
def _(x: torch.Tensor, op: str) -> torch.Tensor:
    return torch.empty_like(x)


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

@torch.library.custom_op("boomfx_tp::all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, dim: int, world: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The TP group's shards of ``x`` joined along ``dim`` (``Shard(dim) -> Replicate``; traced only).
    ``keep``: a tensor the runtime holds until the gather is done (the head module's own input)."""
    return torch.cat([x] * world, dim)


@tp_all_gather.register_fake
def _(x: torch.Tensor, dim: int, world: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * world
    return x.new_empty(shape)


def _all_gather_setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    x, dim = inputs[:2]
    ctx.dim, ctx.local = dim, x.shape[dim]


def _all_gather_backward(ctx: object, grad: torch.Tensor) -> tuple:
    # Replicate -> Shard(dim): each rank keeps its own block of the gradient, no communication
    return grad.narrow(ctx.dim, 0, ctx.local), None, None, None


tp_all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)

@torch.library.custom_op("boomfx_tp::sp_gather", mutates_args=())
def sp_gather(x: torch.Tensor, dim: int, world: int, full: int) -> torch.Tensor:
    """Sequence parallelism's ``Shard(dim) -> Replicate`` before the colwise projections: ``full`` is
    the whole sequence length (a graph size, so the result's shape is the model's own symbol)."""
    return torch.cat([x] * world, dim)


@sp_gather.register_fake
def _(x: torch.Tensor, dim: int, world: int, full: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = full
    return x.new_empty(shape)


@torch.library.custom_op("boomfx_tp::sp_scatter", mutates_args=())
def sp_scatter(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """Sequence parallelism's ``Partial -> Shard(dim)`` after the rowwise projections (reduce-scatter)."""
    return x.narrow(dim, 0, x.shape[dim] // world).clone()


@sp_scatter.register_fake
def _(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] // world
    return x.new_empty(shape)


def _sp_gather_setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dim, ctx.world = inputs[1], inputs[2]


def _sp_gather_backward(ctx: object, grad: torch.Tensor) -> tuple:
    # the colwise projections' input gradients sum (as Partial) and are reduce-scattered once
    return torch.ops.boomfx_tp.sp_scatter(grad, ctx.dim, ctx.world), None, None, None


def _sp_scatter_setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    x, ctx.dim, ctx.world = inputs
    ctx.full = x.shape[ctx.dim]


def _sp_scatter_backward(ctx: object, grad: torch.Tensor) -> tuple:
    return torch.ops.boomfx_tp.sp_gather(grad, ctx.dim, ctx.world, ctx.full), None, None


sp_gather.register_autograd(_sp_gather_backward, setup_context=_sp_gather_setup)
sp_scatter.register_autograd(_sp_scatter_backward, setup_context=_sp_scatter_setup)

SP_GATHER = torch.ops.boomfx_tp.sp_gather.default
SP_SCATTER = torch.ops.boomfx_tp.sp_scatter.default
ALL_REDUCE = torch.ops.boomfx_tp.all_reduce.default
REDUCE = torch.ops.boomfx_tp.reduce.default
REGION_ENTER = torch.ops.boomfx_tp.region_enter.default
ALL_GATHER = torch.ops.boomfx_tp.all_gather.default


def lower_tp_ops(program: Program, group: str = TP_GROUP, gather_scratch: bool = False) -> Program:
    """``program`` with ``region_enter`` removed, each TP all-reduce as c10d all_reduce + wait, each
    TP all-gather as DTensor runs one on a dimension other than 0: ``all_gather_into_tensor`` (which
    stacks the shards on dim 0) + wait, then ``chunk`` + ``cat`` along the gathered dimension.
    ``gather_scratch``: gloo's output-sized temporary held during the collective (fsdp.py)."""
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
        elif node.target in (ALL_REDUCE, REDUCE):
            phase = program.phases.get(node.name, PHASE_FORWARD)
            val = node.meta["val"]
            op = node.args[1] if node.target is REDUCE else "sum"
            reduced = edit.call(
                node, c10d.all_reduce.default, (node.args[0], op, group), val, phase, like=node
            )
            if node.target is ALL_REDUCE:   # a parallel linear's (not loss parallel's): its DTensor host work
                reduced.meta[META_TP_LINEAR] = True
            waited = edit.wait(node, reduced, phase, like=node)
            node.replace_all_uses_with(waited)
            graph.erase_node(node)
            phases.pop(node.name, None)
        elif node.target in (ALL_GATHER, SP_GATHER):
            _lower_all_gather(edit, node, program.phases.get(node.name, PHASE_FORWARD), group, gather_scratch)
            graph.erase_node(node)
            phases.pop(node.name, None)
        elif node.target is SP_SCATTER:
            _lower_reduce_scatter(edit, node, program.phases.get(node.name, PHASE_FORWARD), group)
            graph.erase_node(node)
            phases.pop(node.name, None)
    leftover = [
        n.name for n in graph.nodes if n.op == "call_function" and n.target in (ALL_REDUCE, REDUCE, REGION_ENTER, ALL_GATHER, SP_GATHER, SP_SCATTER)
    ]
    assert not leftover, leftover
    out = program.rewritten(graph, phases=phases)
    if edit.extra_uses:
        uses = dict(program.gm.meta.get(META_RUNTIME_USES, {}))
        uses.update({k: tuple(v) for k, v in edit.extra_uses.items()})
        out.gm.meta[META_RUNTIME_USES] = uses
    return out


def _lower_all_gather(edit: GraphEditor, node: torch.fx.Node, phase: str, group: str, scratch: bool) -> None:
    x, dim, world = node.args[:3]
    local = x.meta["val"]
    stacked_shape = [local.shape[0] * world, *local.shape[1:]]
    stacked_val = local.new_empty(stacked_shape)
    gathered = edit.call(node, c10d.all_gather_into_tensor.default, (x, world, group), stacked_val, phase, like=node)
    if scratch:  # (shaped like the output it copies through: empty_like keeps a symbolic batch out of the args)
        temp = edit.call(node, aten.empty_like.default, (gathered,), stacked_val, phase, like=node)
    waited = edit.wait(node, gathered, phase, like=node)
    if scratch:
        edit.keep_alive(waited, [temp])
    out = waited
    if dim != 0:
        parts = edit.call(node, aten.chunk.default, (waited, world, 0), list(stacked_val.chunk(world, 0)), phase, like=node)
        pieces = [edit.call(node, operator.getitem, (parts, i), stacked_val.chunk(world, 0)[i], phase, like=node)
                  for i in range(world)]
        out = edit.call(node, aten.cat.default, (pieces, dim), node.meta["val"], phase, like=node)
    # DTensor's redistribute holds the local shard until the gathered result exists (measured: the
    # local logits are freed after the ``cat``); the head module's input lives as long (the caller's
    # frame holds it: measured under sequence parallelism, the final norm's seq-split output)
    keep = node.args[3] if len(node.args) > 3 and node.args[3] is not None else None
    edit.keep_alive(out, [x] + ([keep] if keep is not None else []))
    node.replace_all_uses_with(out)



def _lower_reduce_scatter(edit: GraphEditor, node: torch.fx.Node, phase: str, group: str) -> None:
    """As ``funcol.reduce_scatter_tensor`` on a dimension other than 0: the input's ``world`` chunks
    along ``dim`` stacked on dim 0 (a copy), ``reduce_scatter_tensor`` + wait."""
    x, dim, world = node.args
    full = x.meta["val"]
    src = x
    if dim != 0:
        piece = full.narrow(dim, 0, full.shape[dim] // world)  # (the sequence divides by world)
        chunks = [piece] * world
        parts = edit.call(node, aten.chunk.default, (x, world, dim), chunks, phase, like=node)
        pieces = [edit.call(node, operator.getitem, (parts, i), chunks[i], phase, like=node) for i in range(world)]
        src = edit.call(node, aten.cat.default, (pieces, 0), torch.cat(chunks, 0), phase, like=node)
    out_val = node.meta["val"]
    scattered = edit.call(node, c10d.reduce_scatter_tensor.default, (src, "sum", world, group), out_val, phase, like=node)
    waited = edit.wait(node, scattered, phase, like=node)
    node.replace_all_uses_with(waited)
