"""DDP's ``gradient_as_bucket_view=True``: each gradient is copied into its bucket when it is ready, and
``.grad`` is the bucket's view from then on.

As torch 2.13's reducer runs it (``Reducer::mark_variable_ready_dense``, called from the parameter's
AccumulateGrad post-hook, i.e. once the autograd node producing the gradient has finished): the
gradient is written into the parameter's slice of the resident flat bucket, scaled by 1 / world
(``at::mul_out(bucket_view, grad, 1 / div_factor)``), and with the option the hook then sets
``grad = bucket_view``: the gradient autograd produced is freed right there, and every later reader
(the optimizer; in a pipeline stage also ``scale_grads``) reads the view of the bucket. Without the
option the gradient is copied back from the bucket after the all-reduce, so both stay alive
(``fsdp.ddp_rank_program``'s default).

With ``zero_grad(set_to_none=True)`` (the default) the gradients are None at the start of every step
under either option (the reducer copies again because ``grad`` no longer aliases the bucket); the
buckets stay allocated.

Example::

    >>> views = copy_into_bucket(edit, bucket, grads, world=8)      # doctest: +SKIP
    >>> read_bucket_views(graph, {g: g for g in grads}, views)       # doctest: +SKIP
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx

from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD
from boomfx.distributed.graph_edit import GraphEditor, meta_tensor, numel

aten = torch.ops.aten


def hook_point(node: torch.fx.Node, phases: Mapping[str, str]) -> torch.fx.Node:
    """The last graph node of the autograd node producing ``node`` (the run of backward nodes sharing its
    ``seq_nr``): AccumulateGrad, and DDP's hook after it, run once that autograd node has finished."""
    seq = node.meta.get("seq_nr")
    end = node
    if seq is None:
        return end
    while (end.next.op == "call_function" and end.next.meta.get("seq_nr") == seq
           and phases.get(end.next.name) == PHASE_BACKWARD):
        end = end.next
    return end


def copy_into_bucket(
    edit: GraphEditor, bucket: torch.fx.Node, grads: Sequence[torch.fx.Node], world: int
) -> list[torch.fx.Node]:
    """For each gradient of ``bucket`` (in bucket order), ``mul.Scalar_out(grad, 1 / world,
    out=view(narrow(bucket, 0, offset, numel), shape))`` right after its hook point; returns, per
    gradient, the copy node (an alias of the bucket's view: what ``.grad`` is from then on).

    The views are made once, right after the bucket (the reducer's ``bucket_views_in``, built with
    the buckets) and belong to no module: a layer's copies then differ from another layer's only in
    which outside view they write, so the layers stay one repeated block."""
    dtype = bucket.meta["val"].dtype
    anchors = [hook_point(g, edit.phases).next for g in grads]   # fixed before anything is inserted
    at_bucket = bucket.next
    copies, offset = [], 0
    for g, anchor in zip(grads, anchors):
        shape = [int(s) for s in g.meta["val"].shape]
        size = numel(shape)
        part = _moduleless(edit.call(at_bucket, aten.narrow.default, (bucket, 0, offset, size),
                                     meta_tensor([size], dtype), PHASE_FORWARD))
        view = _moduleless(edit.call(at_bucket, aten.view.default, (part, shape), meta_tensor(shape, dtype),
                                     PHASE_FORWARD))
        copies.append(edit.call(anchor, aten.mul.Scalar_out, (g, 1.0 / world), meta_tensor(shape, dtype),
                                PHASE_BACKWARD, kwargs={"out": view}, like=g))
        offset += size
    return copies


def _moduleless(node: torch.fx.Node) -> torch.fx.Node:
    for key in ("nn_module_stack", "stack_trace"):
        node.meta.pop(key, None)
    return node


def read_bucket_views(
    graph: torch.fx.Graph, grad_of: Mapping[torch.fx.Node, torch.fx.Node], copies: Mapping[torch.fx.Node, torch.fx.Node]
) -> None:
    """Every reader of a gradient after its copy reads the bucket's view instead (``grad = bucket_view``).
    ``grad_of``: ready node -> the parameter's ``.grad`` node (the same node, or in a pipeline stage the
    first micro-batch's gradient that the ready ``add_`` accumulates into); ``copies``: ready node -> copy."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    for ready, copy in copies.items():
        after = position[copy]
        for old in dict.fromkeys((ready, grad_of[ready])):
            old.replace_all_uses_with(copy, delete_user_cb=lambda user: position[user] > after)
