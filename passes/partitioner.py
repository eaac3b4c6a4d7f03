"""A model of AOTAutograd's min-cut partitioner for compiled training: cheap pointwise values whose inputs
are saved for the backward anyway are recomputed in the backward instead of saved (a Program rewrite
applied by passes/compiled.py before fusion)."""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx

from boomfx.core.fx_copy import copy_node
from boomfx.core.program import Program
from boomfx.passes.aliasing import is_view_node
from boomfx.passes.fusion import CLASS_NONE, fusion_groups, node_class
from boomfx.passes.specs import to_sympy

# Row normalisers: Inductor decomposes them into per-row statistics (reductions, small) and a pointwise
# expression of the input and those statistics, so the partitioner can recompute their output in the
# backward from the input, saving the input (and the statistics) instead of the output.
_NORMALISERS = frozenset((torch.ops.aten._log_softmax.default, torch.ops.aten._softmax.default))
# Views that leave the value as it is: eager autograd saves a ``detach`` of an activation's output (``tanh``,
# ``sigmoid``) for its backward, which the min-cut partitioner sees through
_ALIASES = frozenset(getattr(torch.ops.aten, n).default for n in ("detach", "alias"))
# Kept whole by Inductor's decompositions and absent from AOTAutograd's recomputation allowlist
# (torch 2.13; ``cat`` stays whole where it concatenates several tensors, ``stack`` becomes a ``cat``)
_NOT_RECOMPUTED = frozenset(getattr(torch.ops.aten, n) for n in (
    "embedding", "cat", "stack", "constant_pad_nd", "_unsafe_index", "repeat") if hasattr(torch.ops.aten, n))
_RANDOM = frozenset(getattr(torch.ops.aten, n) for n in (
    "native_dropout", "bernoulli", "rand_like", "randn_like", "rand", "randn", "randint", "randperm", "normal",
    "uniform", "exponential", "multinomial") if hasattr(torch.ops.aten, n))


def recomputable(node: torch.fx.Node) -> bool:
    """Whether the min-cut partitioner may recompute ``node`` in the backward. It recomputes only ops on
    AOTAutograd's allowlist (``get_default_op_list().recomputable_ops``: pointwise ops, views, cheap
    reductions, index and gather; ``functorch.config.ban_recompute_not_in_allowlist``, on by default),
    after Inductor's decompositions (softmax, norms and GELU reach it as allowlisted pieces). The ops we
    fuse as pointwise that reach it whole and are not on the list (``_NOT_RECOMPUTED``) are saved: a
    decoder's embedding output is saved for its first norm's backward (read in Inductor's output code
    of a compiled Qwen2 step: recomputed, the predicted peak was 512 KiB low)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.overloadpacket not in _NOT_RECOMPUTED


def recompute_for_backward(program: Program) -> Program:
    """Model AOTAutograd's min-cut partitioner: cheap pointwise values are recomputed in the backward
    graph instead of being saved, when recomputing needs no extra saved tensor.

    A forward pointwise node ``o`` of a fused group whose backward users are all fusible (pointwise or
    reduction: the value is not materialised for a matmul/extern in backward) is recomputed when its
    chain of pointwise/view ancestors in generated kernels (any group: the partitioner runs before fusion and
    knows none; a reduction inside an expression, ConvNeXt V2's global response norm, splits ours) reads only
    "free" leaves: parameters and inputs,
    values saved for backward anyway, or values at most a quarter of its size (norm statistics). The
    chain is copied in front of its first backward user (phase backward, so it fuses there) and the
    backward users read the copy; the forward value then dies in the forward pass. A value the backward
    reads through autograd's ``detach`` of it (a tanh's saved output) is recomputed like one it reads
    directly; other forward views of it only for the normalisers and for values of the graph's inputs
    alone (a rotary cos/sin table, read in the backward through its ``unsqueeze``: Phi-3's compiled
    backward recomputes it, read in Inductor's output code). Random ops are never
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
    kinds = [g.kind for g in fusion.groups] + [None]     # [-1]: a node in no group
    order = {n: i for i, n in enumerate(graph.nodes)}
    recomputed: set[torch.fx.Node] = set()

    def numel(n: torch.fx.Node) -> Any:
        v = n.meta.get("val")
        return _numel_of(v) if isinstance(v, torch.Tensor) else None

    def saved_anyway(leaf: torch.fx.Node) -> bool:
        base = view_base(leaf)
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

    def fused_away(o: torch.fx.Node, g: int) -> bool:
        """Whether ``o`` is no buffer of the forward: every forward reader (through views) is in its group."""
        stack = [o]
        while stack:
            for u in stack.pop().users:
                if phase(u) != PHASE_FORWARD:
                    continue
                if node_class(u) == CLASS_NONE and is_view_node(u):
                    stack.append(u)
                elif group_of.get(u.name) != g:
                    return False
        return True

    for o in list(graph.nodes):
        if phase(o) != PHASE_FORWARD or not _is_tensor(o):
            continue
        normaliser = o.target in _NORMALISERS
        if node_class(o) != CLASS_POINTWISE and not normaliser:
            continue
        g = group_of.get(o.name)
        if g is None or kinds[g] != "fused" or o.target.overloadpacket in _RANDOM or not recomputable(o):
            continue
        if normaliser and not fused_away(o, g):
            continue
        # backward readers, directly or through forward views of ``o`` (each view re-applied to the copy)
        fw_views = [u for u in o.users if phase(u) == PHASE_FORWARD and node_class(u) == CLASS_NONE
                    and is_view_node(u) and u.args and u.args[0] is o
                    and any(phase(w) == PHASE_BACKWARD for w in u.users)]
        # read in backward through a forward view: a normaliser, a detach (autograd's saved output), or a
        # value of parameters, buffers and constants alone (checked on its leaves below)
        through_view = not normaliser and any(v.target not in _ALIASES for v in fw_views)
        if any(any(phase(w) == PHASE_FORWARD and node_class(w) == CLASS_NONE for w in v.users) for v in fw_views):
            continue   # a view of a view: not handled
        bw_users = [u for u in o.users if phase(u) == PHASE_BACKWARD]
        bw_reads = bw_users + [w for v in fw_views for w in v.users if phase(w) == PHASE_BACKWARD]
        if not bw_reads or any(node_class(u) not in FUSIBLE and not (node_class(u) == CLASS_NONE and is_view_node(u))
                               for u in bw_reads):
            continue
        if any(phase(u) == PHASE_FORWARD and node_class(u) == CLASS_NONE and u not in fw_views and
               any(phase(w) == PHASE_BACKWARD for w in u.users) for u in o.users):
            continue
        chain: list[torch.fx.Node] = []
        leaves: list[torch.fx.Node] = []
        stack, seen, ok = [o], set(), True
        while stack and ok:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            inner = (n.op == "call_function" and phase(n) == PHASE_FORWARD and isinstance(n.target, torch._ops.OpOverload)
                     and ((node_class(n) == CLASS_POINTWISE and kinds[group_of.get(n.name, -1)] == "fused"
                           and recomputable(n))
                          or (node_class(n) == CLASS_NONE and is_view_node(n))))
            if n is o or (inner and not saved_anyway(n)):   # a value saved anyway is a leaf
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
        if through_view and any(_is_tensor(leaf) and view_base(leaf).op != "placeholder" for leaf in leaves):
            continue   # only a value of the graph's inputs alone is recomputed through a view (rotary tables)
        size = numel(o)
        free = True
        extra: Any = sympy.Integer(0)    # elements newly saved so that ``o`` need not be
        for leaf in leaves:
            if saved_anyway(leaf):
                continue
            small = numel(leaf)
            try:
                if small is not None and size is not None and bool(4 * small <= size):
                    continue
            except TypeError:
                pass
            if normaliser and small is not None:
                extra = extra + small
                continue
            free = False
            break
        if normaliser and free:
            try:   # the min-cut weighs saving a value its forward never stores as twice its size
                free = size is not None and bool(extra < 2 * size)
            except TypeError:
                free = False
        if not free:
            continue
        first = min(bw_reads, key=order.__getitem__)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        with graph.inserting_before(first):
            for n in sorted(chain, key=order.__getitem__) + fw_views:
                copy = copy_node(graph, n, lambda a: env.get(a, a))
                env[n] = copy
                phases[copy.name] = PHASE_BACKWARD
        for u in bw_users:
            u.replace_input_with(o, env[o])
        for v in fw_views:
            for w in [w for w in v.users if phase(w) == PHASE_BACKWARD]:
                w.replace_input_with(v, env[v])
        recomputed.add(o)
    _recompute_batch_norm_outputs(graph, phases, phase)
    return program.rewritten(graph, phases=phases)


def _recompute_batch_norm_outputs(graph: torch.fx.Graph, phases: dict, phase: Any) -> None:
    """A training batch norm's output read in the backward (ReLU6's ``hardtanh_backward`` reads its
    input) is recomputed there as ``(x - mean) * invstd * weight + bias`` from tensors the batch norm's
    own backward keeps anyway (its input and the saved statistics): Inductor decomposes the op into
    reductions and that pointwise tail, and the partitioner saves the small statistics, not the output.
    A pointwise op of the output alone read in the backward only by fusible ops (a ReLU, read by its
    ``threshold_backward``) is recomputed from that recomputation too (a compiled ResNet's stem ReLU)."""
    from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD
    from boomfx.passes.fusion import CLASS_POINTWISE, FUSIBLE, _is_training_batch_norm
    order = {n: i for i, n in enumerate(graph.nodes)}
    for bn in list(graph.nodes):
        if bn.op != "call_function" or phase(bn) != PHASE_FORWARD or not isinstance(bn.target, torch._ops.OpOverload) \
                or not _is_training_batch_norm(bn):
            continue
        outs = {u.args[1]: u for u in bn.users if u.target is operator.getitem}
        y, mean, invstd = outs.get(0), outs.get(1), outs.get(2)
        if y is None or mean is None or invstd is None:
            continue
        bw_users = [u for u in y.users if phase(u) == PHASE_BACKWARD]
        if any(node_class(u) not in FUSIBLE for u in bw_users):
            continue
        # a pointwise op of the output alone (ReLU, whose backward reads the ReLU's output) is recomputed
        # from the recomputed output the same way when the backward reads it only in fusible ops
        chain: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for c in y.users:
            if phase(c) != PHASE_FORWARD or node_class(c) != CLASS_POINTWISE or c.all_input_nodes != [y]:
                continue
            reads = _backward_reads(c, phase)       # c and the forward views of it (detach) the backward reads
            if reads and all(_fusible_read(u) for us in reads.values() for u in us):
                chain.update(reads)
        if not bw_users and not chain:
            continue
        x, weight, bias = bn.args[0], bn.args[1], bn.args[2]
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 2:
            continue
        shape = [1, -1] + [1] * (val.dim() - 2)
        env: list[torch.fx.Node] = []

        def call(target: Any, *args: Any) -> torch.fx.Node:
            node = graph.call_function(target, args)
            with val.fake_mode:
                node.meta["val"] = target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
            phases[node.name] = PHASE_BACKWARD
            env.append(node)
            return node
        first = min(bw_users + [u for us in chain.values() for u in us], key=order.__getitem__)
        with graph.inserting_before(first):
            out = call(aten.mul.Tensor, call(aten.sub.Tensor, x, call(aten.view.default, mean, shape)),
                       call(aten.view.default, invstd, shape))
            if isinstance(weight, torch.fx.Node):
                out = call(aten.mul.Tensor, out, call(aten.view.default, weight, shape))
            if isinstance(bias, torch.fx.Node):
                out = call(aten.add.Tensor, out, call(aten.view.default, bias, shape))
            copies: dict[torch.fx.Node, torch.fx.Node] = {y: out}
            for c in sorted(chain, key=order.__getitem__):      # producers before their views
                copies[c] = copy_node(graph, c, lambda a: copies.get(a, a))
                copies[c].meta = dict(c.meta)
                phases[copies[c].name] = PHASE_BACKWARD
        for u in bw_users:
            u.replace_input_with(y, out)
        for c, us in chain.items():
            for u in us:
                u.replace_input_with(c, copies[c])


aten = torch.ops.aten


def _backward_reads(node: torch.fx.Node, phase: Any) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """``node`` and each forward view of it (a ``detach`` chain), with the backward nodes reading each;
    empty when the backward reads none of them (nothing to recompute)."""
    from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD
    out: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        out[n] = [u for u in n.users if phase(u) == PHASE_BACKWARD]
        stack.extend(u for u in n.users if phase(u) == PHASE_FORWARD and u.target in _DETACHES)
    return out if any(out.values()) else {}


_DETACHES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _fusible_read(node: torch.fx.Node) -> bool:
    """A backward read that does not materialise its input: a fusible op, or a detach read only by such."""
    from boomfx.passes.fusion import FUSIBLE
    if node.target in _DETACHES:
        return all(_fusible_read(u) for u in node.users)
    return node_class(node) in FUSIBLE


def view_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` reads: ``node`` itself, or the base under its chain of views."""
    while (isinstance(node.target, torch._ops.OpOverload) and node_class(node) == CLASS_NONE and is_view_node(node)
           and node.args and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
    return node


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _numel_of(v: torch.Tensor) -> Any:
    n = sympy.Integer(1)
    for d in v.shape:
        n = n * to_sympy(d)
    return sympy.expand(n)
