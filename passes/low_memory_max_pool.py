"""Inductor's low-memory max pool, in a compiled program.

Inductor decomposes ``max_pool2d_with_indices`` (torch/_inductor/decomposition.py, torch 2.13) into
``_low_memory_max_pool_with_offsets`` when the window has at most 25 elements (else it falls back to
ATen: ``should_fallback_max_pool_with_indices``): the forward stores each output's offset inside its
window as int8, not an int64 index, and the backward turns the offsets back into indices inside its
kernel. Its ``max_pool2d_with_indices_backward`` lowering reads the gradient and the indices, and of the
pooled input only its size. Two consequences for memory, both read in the output code of a compiled
transformers ResNet step: the saved indices take 1 byte per element instead of 8, and the pooled input
(the stem's ReLU output) is not kept for the backward (its batch norm and ReLU are recomputed there from
the saved convolution output, where the ReLU's backward needs them).

``low_memory_max_pool(program)`` gives such a pool's indices an int8 value and hands its backward a
zero-stride stand-in of the input's shape (an ``expand`` of a scalar: a size, no storage), so the
partitioner and the liveness see what Inductor's graphs hold.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx

from boomfx.core.program import PHASE_BACKWARD, Program
from boomfx.passes.fake_values import graph_fake_mode

aten = torch.ops.aten
_POOLS = (aten.max_pool2d_with_indices.default,)
_BACKWARDS = (aten.max_pool2d_with_indices_backward.default,)
FALLBACK_WINDOW = 25          # should_fallback_max_pool_with_indices: a larger window runs ATen's kernel


def _window(node: torch.fx.Node) -> int:
    kernel = node.args[1] if len(node.args) > 1 else node.kwargs.get("kernel_size")
    kernel = list(kernel) * (2 // len(kernel)) if len(kernel) == 1 else list(kernel)
    return int(math.prod(int(k) for k in kernel))


def _dilated(node: torch.fx.Node) -> bool:
    dilation = node.args[4] if len(node.args) > 4 else node.kwargs.get("dilation", 1)
    return any(int(d) != 1 for d in (dilation if isinstance(dilation, (list, tuple)) else [dilation]))


def low_memory_max_pool(program: Program) -> Program:
    """``program`` with Inductor's low-memory max pools (see the module docstring); unchanged without any."""
    pools = [n for n in program.graph.nodes if n.op == "call_function" and n.target in _POOLS
             and _window(n) <= FALLBACK_WINDOW and not _dilated(n)]
    if not pools:
        return program
    graph, val_map = program.copied_graph()
    phases = dict(program.phases)
    mode = graph_fake_mode(graph)
    for original in pools:
        pool = val_map[original]
        values, indices = pool.meta["val"]
        with mode:
            offsets = torch.empty_strided(indices.shape, indices.stride(), dtype=torch.int8, device=indices.device)
        pool.meta["val"] = (values, offsets)
        for user in list(pool.users):
            if user.target is operator.getitem and user.args[1] == 1:
                user.meta["val"] = offsets
        pooled_input = pool.args[0]
        for backward in [u for u in pooled_input.users if u.target in _BACKWARDS and u.args[1] is pooled_input]:
            val = pooled_input.meta["val"]
            with graph.inserting_before(backward):
                zero = graph.call_function(aten.scalar_tensor.default, (0.0,),
                                           {"dtype": val.dtype, "device": val.device})
                shape = graph.call_function(aten.expand.default, (zero, list(val.shape)))
            with mode:
                zero.meta["val"] = torch.scalar_tensor(0.0, dtype=val.dtype, device=val.device)
                shape.meta["val"] = zero.meta["val"].expand(*val.shape)
            phases[zero.name] = phases[shape.name] = phases.get(backward.name, PHASE_BACKWARD)
            backward.replace_input_with(pooled_input, shape)
    return program.rewritten(graph, phases=phases)
