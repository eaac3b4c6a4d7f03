"""A vocabulary-parallel embedding's weight gradient is the whole table on every TP rank.

torch 2.13's DTensor runs the backward of a ``RowwiseParallel`` embedding (weight ``Shard(0)``, token
ids ``Replicate``) as ``embedding_dense_backward`` with a ``Replicate`` strategy: each rank computes
the gradient of all ``vocab`` rows from the replicated output gradient and ids, and ``AccumulateGrad``
keeps it as ``.grad`` in that placement, ``[vocab, d]`` where the weight holds ``[vocab / tp, d]``
(checked on gloo with and without sequence parallelism: placements ``(Replicate(),)``, the full shape).
It stays so through gradient accumulation and the optimizer step, whose foreach ops take this rank's
chunk of it on each read; FSDP2 redistributes it to the weight's ``Shard(0)`` at its post-backward
before the reduce-scatter (``FSDPParam._get_grad_inner_tensor``).

The TP rank's traced program computes the local rows only (the masked lookup's backward); this pass
makes that node the full table, so the gradient's bytes and the kernel's work are the runtime's.

Known limitations: the optimizer's per-read chunk copies (one local-sized temporary per foreach
argument reading the gradient, ``Replicate -> Shard(0)``) and FSDP's redistribute copy are not added;
an embedding tied to the head (the gradient is a sum) keeps the local rows.
"""

from __future__ import annotations

from typing import Mapping

import torch

from boomfx.core.program import PHASE_BACKWARD, Program
from boomfx.distributed.graph_edit import meta_tensor

aten = torch.ops.aten


def replicated_embedding_grads(local: Program, full_rows: Mapping[str, int]) -> Program:
    """``local`` (a TP rank's traced program) with each vocabulary-parallel embedding's gradient node
    computing all ``full_rows[fqn]`` rows (``fqn``: the embedding weight's name)."""
    targets = {name: full_rows[fqn] for name, fqn in local.grad_nodes.items() if fqn in full_rows}
    nodes = [n for n in local.graph.nodes if n.name in targets and n.target is aten.embedding_dense_backward.default
             and local.phase_of(n) == PHASE_BACKWARD]
    if not nodes:
        return local
    graph, val_map = local.copied_graph()
    for old in nodes:
        node = val_map[old]
        rows = targets[old.name]
        args = list(node.args)
        args[2] = rows  # num_weights: the whole vocabulary
        node.args = tuple(args)
        val = old.meta["val"]
        node.meta["val"] = meta_tensor((rows, *val.shape[1:]), val.dtype)
    return local.rewritten(graph)
