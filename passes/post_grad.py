"""Inductor's post-grad rewrites that change what a compiled graph runs and how long tensors live.

Inductor pattern-matches the AOTAutograd graphs before lowering them (torch/_inductor/fx_passes/
post_grad.py, torch 2.13). One rewrite moves work: ``add(mm(a, b), c)`` (either operand order) becomes
``addmm(c, a, b)`` at the position of the ``add`` (pattern ``addmm``, check ``is_valid_addmm_fusion``:
``c`` a tensor expandable to the product's shape, all three of one dtype, and, on a GPU, not every
user of the sum pointwise). The product is then computed where the sum was, so its inputs stay alive
until there and the product itself is never stored on its own. In a training step this is how a
weight used twice gets its gradient: GPT-2's tied ``lm_head``/``wte`` gradient is one ``addmm`` at the
end of the backward (the embedding gradient plus ``grad_logits^T @ h``), which keeps the logits'
gradient alive through the whole backward instead of a weight-sized product from its start.

``fuse_addmm(program, backend)`` applies it to the program's graph. Not modelled: the GPU-only reverse
rewrite (``unfuse_bias_add_to_pointwise``: a bias ``addmm`` whose users are all pointwise becomes
``mm`` + a bias add fused into them; same buffers, a few bytes less traffic).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx

from boomfx.passes.fusion import CLASS_POINTWISE, node_class
from boomfx.core.program import Program

_aten = torch.ops.aten


def _tensor(node: object) -> Optional[torch.Tensor]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _expandable(shape: torch.Size, to: tuple) -> bool:
    if len(shape) > len(to):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(tuple(shape)), reversed(to)))


_TRANSPOSES = (_aten.t.default, _aten.transpose.int, _aten.permute.default)


def _through_pointless_transposes(node: object) -> tuple[object, list[torch.fx.Node]]:
    """The node under a chain of single-use transposes that compose to the identity (``t(t(x))``: the
    joint-graph pass ``pointless_permute_pair`` removes them before the post-grad patterns run), and the
    chain; ``node`` itself when there is no such chain."""
    chain: list[torch.fx.Node] = []
    cur = node
    val = _tensor(node)
    order = list(range(val.dim())) if val is not None else []
    while isinstance(cur, torch.fx.Node) and cur.target in _TRANSPOSES and len(cur.users) == 1 and order:
        if cur.target is _aten.permute.default:
            perm = list(cur.args[1])
        else:
            perm = list(range(len(order)))
            i, j = (0, 1) if cur.target is _aten.t.default else (cur.args[1] % len(order), cur.args[2] % len(order))
            perm[i], perm[j] = perm[j], perm[i]
        order = [perm[d] for d in order]
        chain.append(cur)
        cur = cur.args[0]
    if chain and order == sorted(order):
        return cur, chain
    return node, []


def _addmm_operands(add: torch.fx.Node, backend: str) -> Optional[tuple[torch.fx.Node, torch.fx.Node, list]]:
    """(mm, c, transposes between them) when ``add`` matches Inductor's ``addmm`` pattern, else None."""
    if add.op != "call_function" or add.target is not _aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    for operand, c in (add.args, add.args[::-1]):
        mm, chain = _through_pointless_transposes(operand)
        if not (isinstance(mm, torch.fx.Node) and mm.target is _aten.mm.default and len(mm.users) == 1):
            continue
        out, inp = _tensor(mm), _tensor(c)
        a, b = _tensor(mm.args[0]), _tensor(mm.args[1])
        if out is None or inp is None or a is None or b is None:
            continue
        if not _expandable(inp.shape, (a.shape[0], b.shape[1])) or len({inp.dtype, a.dtype, b.dtype}) != 1:
            continue
        if backend == "gpu" and add.users and all(node_class(u) == CLASS_POINTWISE for u in add.users):
            continue        # should_prefer_unfused_addmm: the sum fuses into its pointwise users instead
        return mm, c, chain
    return None


def fuse_addmm(program: Program, backend: str) -> Program:
    """``program`` with every ``add(mm(a, b), c)`` Inductor rewrites as ``addmm(c, a, b)`` so rewritten;
    the same Program object when nothing matches."""
    matches = [(n, m) for n in program.graph.nodes if (m := _addmm_operands(n, backend)) is not None]
    if not matches:
        return program
    graph, val_map = program.copied_graph()
    phases = dict(program.phases)
    grad_nodes = dict(program.grad_nodes)
    for add, (mm, c, chain) in matches:
        add, mm, c = val_map[add], val_map[mm], val_map[c]
        with graph.inserting_before(add):
            fused = graph.call_function(_aten.addmm.default, (c, mm.args[0], mm.args[1]))
        fused.meta = dict(add.meta)
        phases[fused.name] = program.phase_of(add)
        if add.name in grad_nodes:
            grad_nodes[fused.name] = grad_nodes.pop(add.name)
        add.replace_all_uses_with(fused)
        graph.erase_node(add)
        for dead in [val_map[t] for t in chain] + [mm]:
            graph.erase_node(dead)
    return program.rewritten(graph, phases=phases, grad_nodes=grad_nodes)
