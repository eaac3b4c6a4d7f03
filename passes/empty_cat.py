"""Inductor's ``cat`` decomposition: inputs empty along the cat dimension dropped, a lone input cloned.

Inductor hands AOTAutograd its own decomposition of ``aten.cat`` (torch/_inductor/decomposition.py ``cat``):
inputs of size 0 along the cat dimension are dropped, and a cat left with one input becomes
``clone(input)``, which keeps the input's layout (``preserve_format``). Eagerly, that cat makes a contiguous
tensor. The layout difference travels: the CPU flash attention's output follows its query's layout, so a
query that is such a cat keeps the projection's sequence-major layout under ``torch.compile``, the output's
``transpose(1, 2)`` is contiguous and the ``.contiguous()`` copy the eager trace recorded after it becomes a
clone of an identical tensor, which Inductor's post-grad ``remove_noop_ops`` deletes (same size, stride and
dtype: ``same_meta``). Phi-3 builds its query and key this way (``cat((q_rot, q_pass), -1)`` with an empty
pass-through part): counting that copy, saved for the output projection's weight gradient, put its compiled
training step 3.4% over the real one.

``drop_empty_cat_inputs(program)`` applies the decomposition, recomputes the values downstream of a changed
layout (each op rerun on fake tensors in the program's fake mode; propagation stops where a value comes out
as it was) and removes the clones that became no-ops.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from boomfx.core.program import Program
from boomfx.passes.fake_values import copy_to_rewrite, fake_values

aten = torch.ops.aten


def drop_empty_cat_inputs(program: Program) -> Program:
    """``program`` with Inductor's ``cat`` decomposition applied (module docstring); the same program when
    no cat has an empty input."""
    if not any(_kept_inputs(n) is not None for n in program.graph.nodes):
        return program
    copy = copy_to_rewrite(program)
    if copy is None:
        return program
    graph, phases, mode = copy
    changed: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        kept = _kept_inputs(node)
        if kept is None:
            continue
        with graph.inserting_before(node):
            if len(kept) == 1:
                new = graph.call_function(aten.clone.default, (kept[0],))
            else:
                new = graph.call_function(aten.cat.default, (kept, *node.args[1:]), dict(node.kwargs))
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        with mode:
            new.meta["val"] = new.target(*fake_values(new.args), **fake_values(dict(new.kwargs)))
        if node.name in phases:
            phases[new.name] = phases[node.name]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed.add(new)
    dirty = _repropagate(graph, changed, mode)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.clone.default and node.args \
                and node.args[0] in dirty and _same_meta(node, node.args[0]):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return program.rewritten(graph, phases=phases)


def _kept_inputs(node: torch.fx.Node) -> Any:
    """For a ``cat`` with an input empty along its dimension (or a legacy 1-D empty), the inputs Inductor's
    decomposition keeps, when at least one of the cat's dtype remains; None otherwise."""
    if node.op != "call_function" or getattr(node.target, "overloadpacket", None) is not aten.cat:
        return None
    inputs = list(node.args[0]) if node.args else []
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not inputs or not all(isinstance(i, torch.fx.Node) for i in inputs):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    kept = []
    for inp in inputs:
        shape = inp.meta["val"].shape
        d = dim % len(shape) if len(shape) else 0
        empty = (len(shape) == 1 and _is_zero(shape[0])) or (len(shape) > d and _is_zero(shape[d]))
        if not empty:
            kept.append(inp)
    if len(kept) == len(inputs) or not kept or (len(kept) == 1 and kept[0].meta["val"].dtype != val.dtype):
        return None
    return kept


def _is_zero(size: Any) -> bool:
    return isinstance(size, int) and size == 0


def _layout(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), tuple(val.stride()), val.dtype
    if isinstance(val, (list, tuple)):
        return tuple(_layout(v) for v in val)
    return None


def _same_meta(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and _layout(va) == _layout(vb)


def _repropagate(graph: torch.fx.Graph, changed: set[torch.fx.Node], mode: Any) -> set[torch.fx.Node]:
    """Recompute the fake values downstream of ``changed`` (graph order). A node whose value comes out with
    the layout it had stops the propagation; an op that cannot rerun on fake tensors keeps its old value.
    Returns the nodes whose value changed."""
    dirty = set(changed)
    for node in graph.nodes:
        if node in dirty or node.op != "call_function" or not any(i in dirty for i in node.all_input_nodes):
            continue
        if not (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem):
            continue
        old = node.meta.get("val")
        try:
            with mode:
                new = node.target(*fake_values(node.args), **fake_values(dict(node.kwargs)))
        except Exception:       # noqa: BLE001  (an op fake tensors cannot rerun: keep what the trace recorded)
            continue
        if _layout(new) != _layout(old):
            node.meta["val"] = new
            dirty.add(node)
    return dirty

