"""AOTAutograd's functionalisation of in-place pointwise ops on the graph's own values, in a compiled program.

``torch.export``'s IR keeps a Python ``x += y`` as ``aten.add_(x, y)``. Eagerly that is one ATen kernel
writing over ``x``. ``torch.compile`` hands Inductor a functional graph instead (AOTAutograd functionalises
every mutation): the write becomes ``add(x, y)``, later readers of ``x`` read the sum, and the add is a
pointwise op like any other, fused into the kernel of its producers. Inductor's output code of a
transformers ResNet's inference shows the residual ``hidden_state += residual`` inside one kernel with both
batch norms and the ReLU (``cpp_fused__native_batch_norm_legit_no_training_add_mean_relu``), where the
fusion pass kept it a kernel of its own (an in-place op writes a live storage, ``fusion.node_class``).

``functional_inplace(program)`` rewrites such an op of the compiled phases (the optimizer stays eager) as its
functional form when what it writes is a fresh value of the graph (no input, parameter or buffer: their
mutations stay writes, as AOTAutograd copies them back) that nothing else aliases; readers after the write
read the new value.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from boomfx.core.program import Program
from boomfx.passes.fake_values import copy_to_rewrite, fake_values
from boomfx.passes.aliasing import output_aliases
from boomfx.passes.operands import StorageRoots

aten = torch.ops.aten


def functional_inplace(program: Program) -> Program:
    """``program`` with its in-place pointwise ops on fresh values functionalised (module docstring); the same
    program when there are none."""
    compiled = {n.name for n in program.graph.nodes if not program.runs_eagerly(n)}   # not the optimizer's
    if not any(n.name in compiled and _functional_form(n, StorageRoots()) is not None for n in program.graph.nodes):
        return program
    copy = copy_to_rewrite(program)
    if copy is None:
        return program
    graph, phases, mode = copy
    order = {n: i for i, n in enumerate(graph.nodes)}
    roots = StorageRoots()
    changed = False
    for node in list(graph.nodes):
        functional = _functional_form(node, roots) if node.name in compiled else None
        if functional is None:
            continue
        with mode:
            val = functional(*fake_values(node.args), **fake_values(dict(node.kwargs)))
        written = node.args[0]
        old = written.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != old.dtype or val.shape != old.shape:
            continue        # a type promotion or a broadcast the in-place op refused: not the same value
        with graph.inserting_before(node):
            new = graph.call_function(functional, node.args, dict(node.kwargs))
        new.meta = dict(node.meta)
        new.meta["val"] = val
        order[new] = order[node]
        if node.name in phases:
            phases[new.name] = phases[node.name]
        for user in list(written.users):
            if user is not node and user is not new and order[user] > order[node]:
                user.replace_input_with(written, new)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    return program.rewritten(graph, phases=phases) if changed else program


def _functional_form(node: torch.fx.Node, roots: StorageRoots) -> Optional[Any]:
    """The functional overload of an in-place pointwise op writing its first argument, when that argument is
    a fresh value of the graph (its own storage: ``roots``; an output of a multi-output op counts) that no
    view or other in-place op aliases; None otherwise."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    schema = node.target._schema
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_") or not schema.arguments:
        return None
    first = schema.arguments[0].alias_info
    if first is None or not first.is_write or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    packet = getattr(aten, name[:-1], None)
    functional = getattr(packet, node.target._overloadname, None) if packet is not None else None
    if functional is None or torch.Tag.pointwise not in functional.tags:
        return None
    written = node.args[0]
    if written.op != "call_function" or roots(written) != written.name \
            or not isinstance(written.meta.get("val"), torch.Tensor):
        return None     # an input, a parameter or a buffer (copied back), or a view of another value
    if any(_aliases(user, written) for user in written.users if user is not node):
        return None
    return functional


def _aliases(user: torch.fx.Node, value: torch.fx.Node) -> bool:
    """``user`` makes a view of ``value`` or writes it: the write would reach it through a storage."""
    if user.op != "call_function":
        return False
    return any(a is not None and a[0] is value for a in output_aliases(user))

