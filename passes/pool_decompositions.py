"""The decompositions AOTAutograd applies to the pooling ops ``torch.export`` keeps whole, in a compiled program.

``torch.export``'s IR keeps ``adaptive_avg_pool2d``/``adaptive_avg_pool1d`` and ``max_pool2d``, which are
CompositeImplicitAutograd in ATen: AOTAutograd traces through them, so Inductor never sees them whole.
- ``adaptive_avg_pool2d`` to a 1x1 output is ``mean`` over the last two dimensions (ATen's
  AdaptiveAveragePooling.cpp), and ``adaptive_avg_pool1d`` to 1 is that on an unsqueezed input: a reduction
  over the whole window, fused with its producers. Inductor's output code of a transformers ResNet's
  inference computes its last batch norm, the residual add, the ReLU and this mean in one kernel
  (``cpp_fused__native_batch_norm_legit_no_training_add_mean_relu``).
- ``max_pool2d`` is ``max_pool2d_with_indices`` whose indices nothing reads; ``passes/low_memory_max_pool.py``
  then gives it Inductor's own lowering, a generated kernel (Inductor drops the unread offsets).

``decompose_pools(program)`` rewrites those nodes; other output sizes keep ATen's op (Inductor lowers
``_adaptive_avg_pool2d`` itself, priced as the ATen kernel).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx

from boomfx.core.program import Program
from boomfx.passes.fake_values import copy_to_rewrite, fake_values

aten = torch.ops.aten


def decompose_pools(program: Program) -> Program:
    """``program`` with its whole-window adaptive average pools as means and its max pools with indices
    (module docstring); the same program when it has none."""
    if not any(_mean_dims(n) is not None or _is_max_pool(n) for n in program.graph.nodes):
        return program
    copy = copy_to_rewrite(program)
    if copy is None:
        return program
    graph, phases, mode = copy
    for node in list(graph.nodes):
        dims = _mean_dims(node)
        if dims is None and not _is_max_pool(node):
            continue
        x = node.args[0]
        with graph.inserting_before(node):
            if dims is not None:
                new = graph.call_function(aten.mean.dim, (x, dims, True))
                with mode:
                    val = aten.mean.dim(x.meta["val"], dims, True)
                added = [new]
            else:
                pool = graph.call_function(aten.max_pool2d_with_indices.default, node.args, dict(node.kwargs))
                with mode:
                    pool.meta["val"] = aten.max_pool2d_with_indices.default(
                        *fake_values(node.args), **fake_values(dict(node.kwargs)))
                pool.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                new = graph.call_function(operator.getitem, (pool, 0))
                val = pool.meta["val"][0]
                added = [pool, new]
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta["val"] = val
        for a in added:
            if node.name in phases:
                phases[a.name] = phases[node.name]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    return program.rewritten(graph, phases=phases)


def _mean_dims(node: torch.fx.Node) -> Optional[list[int]]:
    """The dimensions an adaptive average pool to a single output element per channel averages over."""
    if node.op != "call_function" or len(node.args) < 2:
        return None
    size = [int(s) if isinstance(s, int) else -1 for s in node.args[1]] if isinstance(node.args[1], (list, tuple)) \
        else None
    if node.target is aten.adaptive_avg_pool2d.default and size == [1, 1]:
        return [-1, -2]
    if node.target is aten.adaptive_avg_pool1d.default and size == [1]:
        return [-1]
    return None


def _is_max_pool(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten.max_pool2d.default
