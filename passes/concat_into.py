"""Inductor's ``ConcatKernel``: the kernels computing a ``cat``'s inputs write them straight into its slices.

A ``cat`` Inductor does not inline into its consumers (every ``cat`` on a CPU, lowering.py ``cat``) is a
``ConcatKernel``: one buffer of the whole output, and for each input ``ConcatKernel.realize_into`` a slice
of it. An input that is a kernel's own output whose layout is still free (``FlexibleLayout``: a generated
kernel's buffer or an ``out=`` matmul's, no extern kernel has read yet, of the cat's dtype) is given that
slice as its layout
(``NonOwningLayout``): its kernel writes into the concat buffer and it has no buffer of its own
(``buf11 = reinterpret_tensor(buf13, ...)  # alias`` in the output code). Every other input (a view, a
graph input, a buffer an extern already read) is copied into its slice by a small
kernel. The concat buffer is allocated where its first input is written.

Why it matters: rotary embeddings are built from cats (``rotate_half``: ``cat(-x2, x1)``; Phi-3's partial
rotary appends an empty pass-through part to the rotated query and key), and each input counted as a
buffer of its own was a query- or key-sized buffer too many (Phi-3's compiled training step +3.4%).

``realize_concat_inputs(program)`` marks each such ``cat`` node of a compiled program with the inputs its
producers write in place (``META_CONCAT_INTO``: position, kernel node name, output index);
``passes/liveness.py`` gives those producers' outputs the concat's storage. Such an output is never also written over a dying input: a
``NonOwningLayout`` buffer is not allocated, so Inductor's in-place update skips it
(scheduler.py ``decide_inplace_update``: ``should_allocate``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx

from boomfx.core.program import META_CONCAT_INTO, Program
from boomfx.passes.aliasing import is_view_node
from boomfx.passes.buffer_reuse import OUT_EXTERNS
from boomfx.passes.fusion import CLASS_EXTERN, node_class

aten = torch.ops.aten

# a cat of only these dtypes is an eager fallback on a CPU (lowering.py ``cat``): no ConcatKernel
_FALLBACK_DTYPES = (torch.int8, torch.uint8)


def realize_concat_inputs(program: Program) -> Program:
    """``program`` (compiled: ``FusedKernel`` nodes) with ``META_CONCAT_INTO`` on each ``cat`` whose inputs a
    kernel writes into the concat buffer (module docstring). Returns the same program object."""
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    claimed: set[tuple[torch.fx.Node, int]] = set()      # an output has one layout: the first cat's slice
    for cat in program.graph.nodes:
        if cat.op != "call_function" or getattr(cat.target, "overloadpacket", None) is not aten.cat:
            continue
        inputs = list(cat.args[0]) if cat.args else []
        tensors = [a for a in inputs if isinstance(a, torch.fx.Node)]
        val = cat.meta.get("val")
        if len(set(tensors)) <= 1 or not isinstance(val, torch.Tensor) \
                or all(t.meta["val"].dtype in _FALLBACK_DTYPES for t in tensors):
            continue
        written: list[tuple[int, str, int]] = []
        seen: set[torch.fx.Node] = set()
        for p, inp in enumerate(inputs):
            if not isinstance(inp, torch.fx.Node) or inp in seen:
                continue        # a repeated input: its layout is the first slice's now, copied into the second
            seen.add(inp)
            output = _kernel_output(inp) or _slice_copy(inp, cat)
            if output is None or output in claimed or inp.meta["val"].dtype != val.dtype \
                    or program.phase_of(output[0]) != program.phase_of(cat) \
                    or _read_by_extern_before(inp, cat, order):
                continue
            written.append((p, output[0].name, output[1]))
            claimed.add(output)
            kernel, index = output[0].target, output[1]
            inplace = getattr(kernel, "inplace", ())
            if index < len(inplace) and inplace[index] is not None:
                kernel.inplace = tuple(None if i == index else j for i, j in enumerate(kernel.inplace))
        if written:
            cat.meta[META_CONCAT_INTO] = tuple(written)
    return program


def _kernel_output(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int]]:
    """(the kernel node, its output index) when ``node`` is a generated kernel's output itself, or that of a
    matmul Inductor calls with ``out=`` (its layout is free too: ``extern_kernels.mm(..., out=buf0)`` with
    ``buf0`` a slice of the concat buffer)."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
        if getattr(source.target, "boomfx_fused", False) and isinstance(node.args[1], int):
            return source, node.args[1]
        return None
    if (getattr(node.target, "boomfx_fused", False) or getattr(node.target, "overloadpacket", None) in OUT_EXTERNS) \
            and isinstance(node.meta.get("val"), torch.Tensor):
        return node, 0
    return None


def _slice_copy(node: torch.fx.Node, cat: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int]]:
    """(kernel, output index) when ``node`` is a view, read by ``cat`` only, of the output of the kernel that
    Inductor's ConcatKernel generates to copy that view into its slice (``FusedKernel.into_concat``: the
    inlined values the view reads, computed straight into the slice)."""
    base = node
    while base.op == "call_function" and len(base.users) == 1 and base.target is not operator.getitem \
            and _is_view(base):
        base = base.args[0]
    output = _kernel_output(base) if base is not node and len(base.users) == 1 else None
    if output is None or getattr(output[0].target, "into_concat", None) != cat.name:
        return None
    return output


def _read_by_extern_before(node: torch.fx.Node, cat: torch.fx.Node, order: dict) -> bool:
    """Whether an extern kernel reads ``node`` (or a view of it) before ``cat``: lowering it fixed the
    buffer's layout (``ExternKernel.realize_input`` freezes it), so the cat copies it."""
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user is cat or order[user] > order[cat]:
                continue
            if user.target is operator.getitem or _is_view(user):
                stack.append(user)
            elif node_class(user) == CLASS_EXTERN:
                return True
    return False


def _is_view(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and is_view_node(node)
