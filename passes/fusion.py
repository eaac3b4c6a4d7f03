"""Fusion pass: which nodes of a program ``torch.compile`` (Inductor) would run as one kernel.

``fusion_pass(program, am) -> FusionInfo`` partitions the kernel-launching nodes of each phase into
groups; ``passes/compiled.py`` rewrites every non-extern group into one ``FusedKernel`` node.

The rule set (a model of Inductor's lowering + scheduler; checked against Inductor's own decisions
by ``inductor_groups`` in ``tests/test_fusion.py``):

1. **Classes.** Every call node is one of
   - ``none``: views and bookkeeping (``kernels.kernel_pass`` launches nothing for them). Views are
     free: Inductor folds them into index expressions, so they never break a fusion;
   - ``extern``: matmul / conv / attention (``kernels.op_class``) and ops Inductor has no lowering
     for (``_FALLBACK``): library calls, never fused;
   - ``pointwise`` (op tagged ``pointwise``, copies, factories, gathers such as ``embedding``,
     ``cat``), ``reduction`` (sums, softmax, norms, losses), ``scatter`` (index_put, embedding
     backward: a zero fill and an atomic scatter, kept apart) and ``foreach`` (``_foreach_*``).
2. **Phases.** Inductor compiles the forward and the backward graph separately: groups never cross a
   phase boundary. ``torch.compile(model)`` leaves the optimizer step eager: its ops stay one kernel
   each (kind "separate").
3. **Vertical fusion.** A pointwise or reduction node joins the group of a producer (an input,
   seen through views) when that group is not extern/scatter and iterates over the same number of
   elements (``total`` = numel of the largest tensor it touches, so ``sum(x)`` after ``exp(x)``,
   the normalisation after a ``var_mean`` and softmax's ``amax -> exp -> sum -> div`` all share
   one space), and joining creates no cycle (no path from the group to the node through a node
   outside it). ``foreach`` ops fuse with ``foreach`` producers over lists of the same length.
   A pure-pointwise producer whose only consumer is the node is inlined whatever its size (Inductor
   computes unrealised pointwise values inside their consumer: ``arange`` and ``embedding`` gathers
   end up in the kernel that adds them). A gather's space is its output's numel.
4. **Horizontal fusion.** The other producer groups of the node with the same space are merged in
   when neither depends on the other.

Known limitations (differences from Inductor, measured on CPU in ``tests/test_fusion.py``):
- Inductor *recomputes* a cheap pointwise result in each consumer kernel instead of storing it when
  it has several consumers (``realize_reads_threshold``); we store it once (one extra buffer and
  fewer re-reads).
- Inductor's CPU backend additionally fuses loops with a common outer loop
  (``OuterLoopFusedSchedulerNode``) and its GPU backend splits very large reductions; both are
  approximated by the equal-space rule.
- Templates (matmul epilogue fusion, ``max_autotune``) are not modelled: matmuls stay extern.
- Measured against Inductor (CPU, torch 2.13): MLP+GELU+bias, LayerNorm+residual, softmax and the
  plain MLP match exactly. GPT-tiny inference differs in one group per layer (Inductor recomputes the
  residual sum feeding ``ln_2`` instead of fusing it there); Llama-tiny differs around the rotary
  embedding / ``repeat_interleave`` inputs of attention (Inductor fuses them into the kernels that
  feed SDPA, we keep the ``neg``/``cat`` of ``rotate_half`` with their consumer only).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx

from boomfx.passes.aliasing import MAYBE_COPY_OPS, is_view_node
from boomfx.passes.kernels import _NO_KERNEL, OP_CLASS_MEMORY, op_class
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.specs import to_sympy
from boomfx.program import PHASE_OPTIMIZER, Program

aten = torch.ops.aten

CLASS_NONE = "none"
CLASS_EXTERN = "extern"
CLASS_POINTWISE = "pointwise"
CLASS_REDUCTION = "reduction"
CLASS_SCATTER = "scatter"
CLASS_FOREACH = "foreach"
FUSIBLE = (CLASS_POINTWISE, CLASS_REDUCTION, CLASS_FOREACH)


def _packets(*names: str) -> frozenset:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# Not tagged pointwise, but lowered by Inductor as a pointwise loop (copies, factories, gathers).
_POINTWISE = _packets(
    "clone", "_to_copy", "copy", "copy_", "to", "contiguous", "reshape", "lift_fresh_copy", "arange", "full",
    "full_like", "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor", "fill", "fill_", "masked_fill",
    "masked_fill_", "where", "embedding", "index", "gather", "index_select", "cat", "stack", "constant_pad_nd",
    "slice_scatter", "select_scatter", "repeat", "repeat_interleave", "triu", "tril", "native_dropout",
    "bernoulli", "rand_like", "randn_like", "_unsafe_index", "alias_copy", "expand_copy", "permute_copy",
    "view_copy", "t_copy", "transpose_copy", "split_with_sizes_copy", "unsqueeze_copy", "squeeze_copy",
    "native_dropout_backward", "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward",
    "tanh_backward", "_unsafe_view",
)
_REDUCTION = _packets(
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "var_mean", "std", "std_mean", "prod",
    "any", "all", "norm", "linalg_vector_norm", "_softmax", "softmax", "_log_softmax", "log_softmax",
    "_safe_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm", "layer_norm",
    "native_layer_norm_backward", "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward", "nll_loss_forward",
    "nll_loss", "nll_loss_nd", "cross_entropy_loss", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "native_batch_norm_backward",
    "mse_loss", "mse_loss_backward", "logsumexp", "cumsum", "cumprod",
)
_GATHER = _packets("embedding", "index", "gather", "index_select", "_unsafe_index")
_SCATTER = _packets(
    "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put", "scatter", "scatter_", "scatter_add",
    "scatter_add_", "scatter_reduce", "index_add", "index_add_", "embedding_dense_backward",
    "nll_loss_backward", "nll_loss2d_backward",
)
# Ops Inductor leaves to ATen (fallback kernels): library calls like matmuls.
_FALLBACK = _packets("sort", "argsort", "topk", "kthvalue", "nonzero", "_unique2", "masked_select", "median",
                     "mode", "multinomial", "upsample_bilinear2d", "_local_scalar_dense")


def node_class(node: torch.fx.Node) -> str:
    """The fusion class of one node (see the module docstring, rule 1)."""
    if node.op != "call_function":
        return CLASS_NONE
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket in _NO_KERNEL:
        return CLASS_NONE
    packet = target.overloadpacket
    if target in MAYBE_COPY_OPS:
        return CLASS_NONE if is_view_node(node) else CLASS_POINTWISE
    if is_view_node(node):
        return CLASS_NONE
    if op_class(target) != OP_CLASS_MEMORY or packet in _FALLBACK:
        return CLASS_EXTERN
    if any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments):
        return CLASS_SCATTER      # in-place / out= ops write a live storage: never fused (one kernel each)
    if str(packet).split(".")[-1].startswith("_foreach_"):
        return CLASS_FOREACH
    if packet in _SCATTER:
        return CLASS_SCATTER
    if packet in _REDUCTION:
        return CLASS_REDUCTION
    if torch.Tag.pointwise in target.tags or packet in _POINTWISE:
        return CLASS_POINTWISE
    return CLASS_EXTERN


# ---------------------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusionGroup:
    """One kernel of the compiled program: its member node names in graph order."""

    members: tuple[str, ...]
    kind: str                   # "fused" (generated by Inductor) | "extern" | "separate" (one op, one kernel)
    phase: str


@dataclass(frozen=True)
class FusionInfo:
    groups: tuple[FusionGroup, ...]
    group_of: Mapping[str, int] = field(default_factory=dict)   # member node name -> index in groups

    def node_sets(self, kinds: Sequence[str] = ("fused", "extern", "separate")) -> list[frozenset[str]]:
        return [frozenset(g.members) for g in self.groups if g.kind in kinds]


# ---------------------------------------------------------------------------------------------------------
# The modelled rules
# ---------------------------------------------------------------------------------------------------------


def _numel(val: Any) -> Optional[sympy.Expr]:
    if isinstance(val, torch.Tensor):
        n = sympy.Integer(1)
        for s in val.shape:
            n = n * to_sympy(s)
        return sympy.expand(n)
    return None


def _space(node: torch.fx.Node, cls: str) -> Any:
    """The iteration space a kernel of this node runs over: the numel of its largest tensor."""
    if cls == CLASS_FOREACH:
        val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        lists = [a for a in node.args if isinstance(a, (list, tuple))]
        return ("foreach", len(lists[0]) if lists else (len(val) if isinstance(val, (list, tuple)) else 0))
    sizes = []
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    for v in vals:
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            n = _numel(t)
            if n is not None:
                sizes.append(n)
    if node.target.overloadpacket in _GATHER or not sizes:
        return _numel(node.meta.get("val")) or sympy.Integer(1)
    best = sizes[0]
    for s in sizes[1:]:
        try:
            if bool(sympy.simplify(s - best) > 0) if (s - best).free_symbols else s > best:
                best = s
        except TypeError:
            # symbolic sizes that sympy cannot order: prefer the one with more factors
            if len(sympy.Mul.make_args(s)) > len(sympy.Mul.make_args(best)):
                best = s
    return best


def _same_space(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return a == b
    return sympy.expand(a - b) == 0


def _producers(node: torch.fx.Node, cls_of: Mapping[torch.fx.Node, str]) -> list[torch.fx.Node]:
    """Kernel nodes whose values ``node`` reads, looking through views and getitems."""
    out: list[torch.fx.Node] = []
    stack = list(node.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while stack:
        n = stack.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function":
            continue
        if cls_of.get(n, CLASS_NONE) == CLASS_NONE:
            stack.extend(n.all_input_nodes)
        else:
            out.append(n)
    return out


def fusion_groups(program: Program) -> FusionInfo:
    """The modelled Inductor fusion of ``program`` (rules 1-4 of the module docstring)."""
    nodes = list(program.graph.nodes)
    cls_of = {n: node_class(n) for n in nodes}
    group_members: list[list[torch.fx.Node]] = []
    group_kind: list[str] = []
    group_space: list[Any] = []
    group_phase: list[str] = []
    group_pointwise: list[bool] = []
    group_of: dict[torch.fx.Node, int] = {}
    alive: list[bool] = []
    # anc[n]: bitmask of the groups node n depends on (including its own); cycles are checked with it
    anc: dict[torch.fx.Node, int] = {}

    def find(g: int) -> int:
        while not alive[g]:
            g = redirect[g]
        return g

    redirect: dict[int, int] = {}

    def ancestors_of(node: torch.fx.Node) -> int:
        mask = 0
        for inp in node.all_input_nodes:
            mask |= anc.get(inp, 0)
        return mask

    def canonical(mask: int) -> int:
        # fold merged groups into their survivors
        out = 0
        while mask:
            low = mask & -mask
            g = low.bit_length() - 1
            out |= 1 << find(g)
            mask ^= low
        return out

    def no_outside_path(src: int, dst: int) -> bool:
        """No member of ``dst`` reads a node outside src/dst that depends on ``src``."""
        for member in group_members[dst]:
            for inp in member.all_input_nodes:
                if inp in group_of and find(group_of[inp]) in (src, dst):
                    continue
                if canonical(anc.get(inp, 0)) >> src & 1:
                    return False
        return True

    for node in nodes:
        cls = cls_of[node]
        if node.op != "call_function" or cls == CLASS_NONE:
            anc[node] = ancestors_of(node)
            continue
        phase = program.phase_of(node)
        if phase == PHASE_OPTIMIZER and cls in FUSIBLE:
            cls = CLASS_SCATTER       # rule 2: the optimizer step runs eagerly, one kernel per op
        space = _space(node, cls)
        target_group: Optional[int] = None
        if cls in FUSIBLE:
            for prod in _producers(node, cls_of):
                g = group_of.get(prod)
                if g is None:
                    continue
                g = find(g)
                if group_kind[g] != "fused" or group_phase[g] != phase:
                    continue
                inline = group_pointwise[g] and all(u is node for u in prod.users)
                if not (_same_space(group_space[g], space) or inline):
                    continue
                # no cycle: no other input of the node may depend on the group through an outside node
                ok = True
                for inp in node.all_input_nodes:
                    if inp in group_of and find(group_of[inp]) == g:
                        continue
                    if canonical(anc.get(inp, 0)) >> g & 1:
                        ok = False
                        break
                if ok:
                    target_group = g
                    group_space[g] = space if inline else group_space[g]
                    break
        if target_group is None:
            kind = "fused" if cls in FUSIBLE else ("separate" if cls == CLASS_SCATTER else "extern")
            group_members.append([node])
            group_kind.append(kind)
            group_space.append(space)
            group_phase.append(phase)
            group_pointwise.append(cls == CLASS_POINTWISE)
            alive.append(True)
            target_group = len(group_members) - 1
        else:
            group_members[target_group].append(node)
            group_pointwise[target_group] &= cls == CLASS_POINTWISE
        group_of[node] = target_group
        own = ancestors_of(node)
        anc[node] = own | (1 << target_group)
        # rule 4: merge the node's other independent producer groups of the same space
        if cls in FUSIBLE:
            for prod in _producers(node, cls_of):
                if prod not in group_of:
                    continue
                g = find(group_of[prod])
                t = find(target_group)
                if g == t or group_kind[g] != "fused" or group_phase[g] != phase:
                    continue
                inline = group_pointwise[g] and all(u is node for u in prod.users)
                if not (_same_space(group_space[g], group_space[t]) or inline):
                    continue
                if not (no_outside_path(g, t) and no_outside_path(t, g)):
                    continue
                lo, hi = min(g, t), max(g, t)
                group_members[lo].extend(group_members[hi])
                group_space[lo] = group_space[t]
                group_pointwise[lo] = group_pointwise[g] and group_pointwise[t]
                alive[hi] = False
                redirect[hi] = lo
    order = {n: i for i, n in enumerate(nodes)}
    groups: list[FusionGroup] = []
    name_to_group: dict[str, int] = {}
    for g, members in enumerate(group_members):
        if not alive[g]:
            continue
        members = sorted(members, key=order.__getitem__)
        for m in members:
            name_to_group[m.name] = len(groups)
        groups.append(FusionGroup(tuple(m.name for m in members), group_kind[g], group_phase[g]))
    return FusionInfo(tuple(groups), name_to_group)


def fusion_pass(program: Program, am: Optional[AnalysisManager] = None) -> FusionInfo:
    """Pass-manager entry point of ``fusion_groups``."""
    return fusion_groups(program)


# ---------------------------------------------------------------------------------------------------------
# Inductor's own decisions (the reference the rules are tested against; CPU backend, no compilation)
# ---------------------------------------------------------------------------------------------------------

_ORIGIN = "boomfx_origin"


class _SchedulerCaptured(Exception):
    pass


def inductor_groups(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[frozenset[str]]:
    """Inductor's kernels for ``gm`` as sets of ``gm``'s node names, read from its scheduler.

    ``gm`` is decomposed with Inductor's decomposition table (each new node remembers the node it
    came from), lowered by ``compile_fx_inner`` and stopped right after the scheduler has fused its
    nodes (nothing is compiled or run). A kernel's nodes are the origins of the buffers it writes;
    an extern kernel counts only the node that called it. A node computed by several kernels (Inductor
    recomputes cheap pointwise values in each consumer) belongs to the first, so the result is a
    partition. ``example_inputs``
    may be fake tensors with static shapes.

    Example::

        groups = inductor_groups(program.gm, fake_inputs)   # [{'gelu', 'add'}, {'linear'}, ...]
    """
    from unittest import mock

    import torch._inductor.scheduler as scheduler
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = torch.fx.GraphModule(gm, gm.graph)  # a shallow copy; only meta["custom"] is added below
    for n in gm.graph.nodes:
        n.meta["custom"] = dict(n.meta.get("custom") or {}, **{_ORIGIN: n.name})

    def run(*args: Any) -> Any:
        return torch.fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta():
        decomposed = make_fx(run, decomposition_table=select_decomp_table(), tracing_mode="fake")(*example_inputs)
    origin = {n.name: (n.meta.get("custom") or {}).get(_ORIGIN) for n in decomposed.graph.nodes}
    kernels: list[set[str]] = []
    original_init = scheduler.Scheduler.__init__

    def capture(self: Any, nodes: Any) -> None:
        original_init(self, nodes)
        for snode in self.nodes:
            names: set[str] = set()
            for sub in snode.get_nodes():
                ir_node = sub.node
                if ir_node is None or isinstance(sub, scheduler.NopKernelSchedulerNode):
                    continue
                fx_nodes = list(ir_node.origins)
                if isinstance(sub, scheduler.ExternKernelSchedulerNode):
                    src = getattr(ir_node, "origin_node", None)
                    fx_nodes = [src] if src is not None else [f for f in fx_nodes if _is_extern_fx(f)]
                names |= {origin[f.name] for f in fx_nodes if origin.get(f.name)}
            if names:
                kernels.append(names)
        raise _SchedulerCaptured()

    with mock.patch.object(scheduler.Scheduler, "__init__", capture), config.patch(fx_graph_cache=False):
        try:
            compile_fx_inner(decomposed, list(example_inputs))
        except Exception:  # noqa: BLE001 - the capture stops lowering on purpose
            if not kernels:
                raise
    return _first_owner(kernels)


def _is_extern_fx(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and op_class(node.target) != OP_CLASS_MEMORY


def _first_owner(kernels: list[set[str]]) -> list[frozenset[str]]:
    """Each node belongs to the first kernel that computes it (later kernels recompute it inline)."""
    seen: set[str] = set()
    out: list[frozenset[str]] = []
    for names in kernels:
        own = frozenset(names - seen)
        seen |= names
        if own:
            out.append(own)
    return out


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
