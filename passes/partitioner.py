"""A model of AOTAutograd's min-cut partitioner for compiled training: cheap pointwise values whose inputs
are saved for the backward anyway are recomputed in the backward instead of saved (a Program rewrite
applied by passes/compiled.py before fusion)."""
from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx

from boomfx.core.program import Program
from boomfx.passes.aliasing import is_view_node
from boomfx.passes.fusion import CLASS_NONE, fusion_groups, node_class
from boomfx.passes.specs import to_sympy

_RANDOM = frozenset(getattr(torch.ops.aten, n) for n in (
    "native_dropout", "bernoulli", "rand_like", "randn_like", "rand", "randn", "randint", "randperm", "normal",
    "uniform", "exponential", "multinomial") if hasattr(torch.ops.aten, n))


def recompute_for_backward(program: Program) -> Program:
    """Model AOTAutograd's min-cut partitioner: cheap pointwise values are recomputed in the backward
    graph instead of being saved, when recomputing needs no extra saved tensor.

    A forward pointwise node ``o`` of a fused group whose backward users are all fusible (pointwise or
    reduction: the value is not materialised for a matmul/extern in backward) is recomputed when its
    chain of pointwise/view ancestors inside the group reads only "free" leaves: parameters and inputs,
    values saved for backward anyway, or values at most a quarter of its size (norm statistics). The
    chain is copied in front of its first backward user (phase backward, so it fuses there) and the
    backward users read the copy; the forward value then dies in the forward pass. Random ops are never
    recomputed. Not modelled: the min-cut's trade-offs when recomputing would save a *new* tensor (we
    keep the eager choice), its banning of long recompute chains and of reductions.
    """
    from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD
    from boomfx.passes.fusion import CLASS_POINTWISE, FUSIBLE
    if PHASE_BACKWARD not in set(program.phases.values()):
        return program
    fusion = fusion_groups(program)
    graph, val_map = program.copied_graph()
    phases = dict(program.phases)

    def phase(n: torch.fx.Node) -> str:
        return phases.get(n.name, PHASE_FORWARD)

    group_of = {graph_node_name: g for graph_node_name, g in fusion.group_of.items()}
    kinds = [g.kind for g in fusion.groups]
    order = {n: i for i, n in enumerate(graph.nodes)}
    recomputed: set[torch.fx.Node] = set()

    def numel(n: torch.fx.Node) -> Any:
        v = n.meta.get("val")
        return _numel_of(v) if isinstance(v, torch.Tensor) else None

    def base_of(n: torch.fx.Node) -> torch.fx.Node:
        while (isinstance(n.target, torch._ops.OpOverload) and node_class(n) == CLASS_NONE and is_view_node(n)
               and n.args and isinstance(n.args[0], torch.fx.Node)):
            n = n.args[0]
        return n

    def saved_anyway(leaf: torch.fx.Node) -> bool:
        base = base_of(leaf)
        if base.op == "placeholder" or not _is_tensor(base):
            return True
        if base in recomputed:
            return False
        stack, seen = [base], set()
        while stack:           # the base or one of its views is read by a backward node
            cur = stack.pop()
            for u in cur.users:
                if u in seen:
                    continue
                seen.add(u)
                if phase(u) == PHASE_BACKWARD:
                    return True
                if node_class(u) == CLASS_NONE and is_view_node(u):
                    stack.append(u)
        return False

    for o in list(graph.nodes):
        if phase(o) != PHASE_FORWARD or node_class(o) != CLASS_POINTWISE or not _is_tensor(o):
            continue
        g = group_of.get(o.name)
        if g is None or kinds[g] != "fused" or o.target.overloadpacket in _RANDOM:
            continue
        bw_users = [u for u in o.users if phase(u) == PHASE_BACKWARD]
        if not bw_users or any(node_class(u) not in FUSIBLE for u in bw_users):
            continue
        if any(phase(u) == PHASE_FORWARD and node_class(u) == CLASS_NONE and
               any(phase(w) == PHASE_BACKWARD for w in u.users) for u in o.users):
            continue   # read in backward through a forward view: not handled
        chain: list[torch.fx.Node] = []
        leaves: list[torch.fx.Node] = []
        stack, seen, ok = [o], set(), True
        while stack and ok:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            inner = (n.op == "call_function" and phase(n) == PHASE_FORWARD and isinstance(n.target, torch._ops.OpOverload)
                     and ((node_class(n) == CLASS_POINTWISE and group_of.get(n.name) == g)
                          or (node_class(n) == CLASS_NONE and is_view_node(n))))
            if n is o or inner:
                if n.target.overloadpacket in _RANDOM:
                    ok = False
                chain.append(n)
                stack.extend(n.all_input_nodes)
            else:
                leaves.append(n)
            if len(chain) > 16:
                ok = False
        if not ok:
            continue
        size = numel(o)
        free = True
        for leaf in leaves:
            if saved_anyway(leaf):
                continue
            small = numel(leaf)
            try:
                if small is not None and size is not None and bool(4 * small <= size):
                    continue
            except TypeError:
                pass
            free = False
            break
        if not free:
            continue
        first = min(bw_users, key=order.__getitem__)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        with graph.inserting_before(first):
            for n in sorted(chain, key=order.__getitem__):
                copy = graph.node_copy(n, lambda a: env.get(a, a))
                env[n] = copy
                phases[copy.name] = PHASE_BACKWARD
        for u in bw_users:
            u.replace_input_with(o, env[o])
        recomputed.add(o)
    return program.rewritten(graph, phases=phases)


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _numel_of(v: torch.Tensor) -> Any:
    n = sympy.Integer(1)
    for d in v.shape:
        n = n * to_sympy(d)
    return sympy.expand(n)
