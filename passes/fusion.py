"""Fusion pass: which nodes of a program ``torch.compile`` (Inductor) would run as one kernel.

``fusion_pass(program, am) -> FusionInfo`` partitions the kernel-launching nodes of each phase into
groups; ``passes/compiled.py`` rewrites every non-extern group into one ``FusedKernel`` node.

The rule set (a model of Inductor's lowering + scheduler for its GPU (Triton) backend; checked against
Inductor's own decisions by ``inductor_groups`` in ``tests/test_fusion.py``; torch 2.13 sources named
relative to ``torch/_inductor``):

1. **Classes.** Every call node is one of
   - ``none``: views and bookkeeping (``kernels.kernel_pass`` launches nothing for them). Views are
     free: Inductor folds them into index expressions, so they never break a fusion;
   - ``extern``: matmul / conv / attention (``kernels.op_class``) and ops Inductor has no lowering
     for (``_FALLBACK``): library calls, never fused;
   - ``pointwise`` (op tagged ``pointwise``, copies, factories, gathers such as ``embedding``,
     ``cat``; ops Inductor decomposes into pointwise ones: ``outer``, ``diff``, bitwise ops, batch
     norm with running statistics), ``reduction`` (sums, softmax, norms, losses), ``scatter``
     (index_put, embedding backward: a zero fill and an atomic scatter, kept apart; also a ``cat``
     lowered as a ``ConcatKernel``, rule 3) and ``foreach`` (``_foreach_*``).
   Nodes whose value nothing uses are dropped (Inductor's dead-code elimination): no group.
2. **Phases.** Inductor compiles the forward and the backward graph separately: groups never cross a
   phase boundary. ``torch.compile(model)`` leaves the optimizer step eager: its ops stay one kernel
   each (kind "separate"), as does the autograd engine's AccumulateGrad copy of a gradient the graph
   returned in another layout (``Program.runs_eagerly``).
3. **Stored or inlined.** A pointwise value is *inlined* (an unrealised ``ir.Pointwise``: every
   consumer kernel recomputes it) unless Inductor stores it (graph.py ``GraphLowering.run_node``,
   ir.py ``StorageBox.should_realize_on_reuse`` / ``has_exceeded_max_reads``): a consumer is no
   generated kernel (extern, scatter, graph output, another phase); it has several consumers (a
   LayerNorm / softmax input counts twice: their decompositions read it twice) and reads more than
   ``realize_reads_threshold`` = 4 buffers or has more than ``realize_opcount_threshold`` = 30 ops;
   it reads more than ``realize_acc_reads_threshold`` = 8 buffers. So ``arange``/``cos``/``sin``
   tables and embedding gathers are recomputed inside the kernels that use them, while GPT's residual
   sum is stored once it reads 5 buffers. A ``cat`` is a pointwise cat (inlined) for at most 8
   inputs none of which has another consumer, else a ``ConcatKernel`` whose direct inputs are stored
   into it (lowering.py ``cat``); a cat of one input repeated is an expand + copy (decomposition.py).
4. **Vertical fusion.** A stored pointwise or reduction node joins the group of a stored producer
   (an input, seen through views and inlined values) when that group is not extern/scatter and
   iterates over the same number of elements (``total`` = numel of the largest tensor it touches,
   so ``sum(x)`` after ``exp(x)``, the normalisation after a ``var_mean`` and softmax's ``amax ->
   exp -> sum -> div`` all share one space; codegen/simd.py ``can_fuse``: pointwise numel ==
   reduction numel * rnumel), or, for a pointwise node, as many elements as a reduction of the group
   outputs (``rsqrt`` of RMSNorm's mean when it is stored; simd.py: equal numel), and joining creates
   no cycle (no path from the group to the node through a node outside it). Two reductions with
   different output sizes (a row and a column reduction of one tensor: LayerNorm's input and weight
   gradients) share a group only as Triton's mix-order reduction (scheduler.py ``MixOrderReduction``:
   >= 5 Mi elements and twice as many rows as columns, provably so for symbolic sizes). ``foreach``
   ops fuse with ``foreach`` producers over lists of the same length.
5. **Horizontal fusion.** Independent groups of the same space merge when the node's producers are in
   them or when they read a common stored value, the same part of it (scheduler.py ``get_possible_fusions``
   pairs kernels sharing a buffer, ``score_fusion_memory`` needs equal memory dependencies: BLOOM's q, k and v
   copies, ``select``s of its fused projection, stay apart); ``can_fuse`` then needs equal numel/rnumel and
   no path between them).
6. **Inlined values** belong to the group of the first stored node (graph order) that computes them,
   as in Inductor's output, where later kernels recompute them (``FusionInfo.inlined``;
   ``compiled.recompute_inlined`` gives each other kernel its own copy). A ConcatKernel is no generated
   kernel: the inlined values each of its view inputs reads form a kernel of their own, the copy into
   that input's slice (``FusionGroup.into_concat``).
7. **Cross-entropy.** ``nll_loss_forward`` joins the group of the ``log_softmax`` it reads when nothing
   else of its phase reads it: Inductor computes per-row statistics and the gather evaluates the
   pointwise tail at the target only, so the log-probabilities are never stored
   (``partitioner.recompute_for_backward`` then saves the logits for the backward, not the log-probabilities).

GPU (default) and CPU (``fusion_groups(program, backend="cpu")``, Inductor's C++ backend, used by the
tests on machines without a GPU) differ in:
- ``cat``: the C++ backend always lowers it as a ``ConcatKernel`` (lowering.py ``cat``: "pointwise_cat
  ... disabled on CPU"): Llama's ``rotate_half`` ``neg`` and the copied half are two extra kernels.
- mix-order reductions (rule 4) are Triton-only (``MixOrderReduction.can_fuse``: GPU backends).
- thresholds: ``realize_cpu_opcount_threshold`` = 50, ``realize_cpu_acc_reads_threshold`` = 12, and a
  reused value computing ``exp``/``log``/``sigmoid``/``tanh`` is always stored on CPU.
- Not modelled on the CPU side (the tests list these cases as C++-only): a *stored* pointwise kernel
  followed by a reduction over its elements is fused by Triton, but by the C++ backend only when
  their loop nests share their outer loops (codegen/cpp.py ``_why_fuse_nodes``,
  ``can_fuse_vertical_outer_loop``), and never when the reduction runs over an outer dim (Triton
  reorders loops to fuse them, scheduler.py ``shared_data_after_reordering_loop``, GPU only).

Known limitations:
- ``compiled.recompute_inlined`` copies an inlined value only for kernels reading it directly; one
  read through a view still reads it from its first kernel's output (stored once).
- The GPU backend splits very large reductions (``split_reductions``); templates (matmul epilogue
  fusion, ``max_autotune``) are not modelled: matmuls stay extern. Op counts are approximated by the
  number of aten ops inlined (each is one or more Inductor ops). Inductor's fusion-size limits and
  tiling checks are not modelled.
- Measured against Inductor (CPU, torch 2.13): inference of MLP, CNN, GPT, Llama, HF GPT-2 and BERT
  (tests/conftest.py models) match exactly with the CPU rules, except one documented C++-only split
  in GPT, GPT-2 and BERT (stored residual/embedding sum + the next LayerNorm). Training graphs (per
  phase) of MLP, CNN and GPT match up to counted C++-only splits of the same kind; Llama training
  differs further (C++-only limits on horizontal fusion), not asserted. The GPU rules differ from
  the CPU ones only by the rules listed above.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx

from boomfx.passes.aliasing import MAYBE_COPY_OPS, is_view_node
from boomfx.passes.kernels import OP_CLASS_MEMORY, op_class
from boomfx.passes.op_sets import NO_KERNEL_OPS
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.specs import to_sympy
from boomfx.core.program import META_ACTION, Program

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
    "tanh_backward", "_unsafe_view", "hardtanh_backward", "hardswish_backward", "hardsigmoid_backward",
    "leaky_relu_backward", "elu_backward", "softplus_backward", "mish_backward",
    # a view's gradient: decomposed into zeros + slice_scatter / select_scatter / diagonal_scatter, each
    # lowered as a pointwise loop over the input's size (where(index in the view, grad, 0)); the gradients
    # of a fused q/k/v or gate/up projection's splits are summed in the consumer's kernel, never stored
    "slice_backward", "select_backward", "diagonal_backward",
    # decomposed into zeros + scatter(-1.0 at the target class) * grad: Inductor's joint-graph pass
    # ``scatter_upon_const_tensor`` (one index per row) rewrites that into a pointwise ``where(iota == target)``
    "nll_loss_backward", "nll_loss2d_backward",
    # kept whole by torch.export, decomposed by Inductor's table into ``constant_pad_nd`` (lowered as a
    # pointwise loop) or the reflection/replication pads' index loads: MobileNetV2's "same" padding runs
    # inside its batch norm's kernel (``cpp_fused__native_batch_norm_legit_no_training_constant_pad_nd_hardtanh``)
    "pad",
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
)
# Not memory-bound by ``kernels.op_class`` (or untagged), but Inductor lowers them as pointwise loops:
# ``outer`` is decomposed into a broadcasting mul, ``diff`` into a sub of two slices, the rest are
# bitwise ops and factories.
_DECOMPOSED_POINTWISE = _packets("outer", "ger", "diff", "__and__", "__or__", "__xor__", "bitwise_and",
                                 "bitwise_or", "bitwise_xor", "bitwise_not", "logical_and", "logical_or",
                                 "logical_not", "new_ones", "new_zeros", "new_full")
# Ops Inductor leaves to ATen (fallback kernels): library calls like matmuls.
_FALLBACK = _packets("sort", "argsort", "topk", "kthvalue", "nonzero", "_unique2", "masked_select", "median",
                     "mode", "multinomial", "upsample_bilinear2d", "_local_scalar_dense")


def node_class(node: torch.fx.Node) -> str:
    """The fusion class of one node (see the module docstring, rule 1)."""
    if node.op != "call_function":
        return CLASS_NONE
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket in NO_KERNEL_OPS:
        return CLASS_NONE
    packet = target.overloadpacket
    if target in MAYBE_COPY_OPS:
        return CLASS_NONE if is_view_node(node) else CLASS_POINTWISE
    if is_view_node(node):
        return CLASS_NONE
    if packet in _DECOMPOSED_POINTWISE or _is_inference_batch_norm(node) or _is_low_memory_max_pool(node):
        return CLASS_POINTWISE
    if op_class(target) != OP_CLASS_MEMORY or packet in _FALLBACK:
        return CLASS_EXTERN
    if _is_training_batch_norm(node):
        return CLASS_REDUCTION    # functionalised: its running-statistics updates become copies of two vectors
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


def generated_by_inductor(node: torch.fx.Node) -> bool:
    """An ATen op that Inductor lowers to generated code even where it stays one kernel of its own (a
    memory-class op that is not one of its ATen fallbacks: a max pool, a scatter): no library call runs,
    so none of eager ATen's internal temporaries (a max pool's int64 indices) exist in the compiled step."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    return op_class(target) == OP_CLASS_MEMORY and target.overloadpacket not in _FALLBACK


def _is_low_memory_max_pool(node: torch.fx.Node) -> bool:
    """A max pool given Inductor's low-memory lowering (``passes/low_memory_max_pool.py``: int8 offsets) whose
    offsets nothing reads (inference): a pointwise loop over its output reading each window, generated code
    fused with its producers (a transformers ResNet's stem: ``cpp_fused__native_batch_norm_legit_no_training_
    max_pool2d_with_indices_relu``). A training step's pool, whose offsets the backward reads, stays a kernel
    of its own: fused there, ResNet's compiled training peak came out 0.8% over its measured one (exact
    before), a case not read in Inductor's output code."""
    val = node.meta.get("val")
    return node.target is aten.max_pool2d_with_indices.default and isinstance(val, (list, tuple)) \
        and len(val) == 2 and getattr(val[1], "dtype", None) is torch.int8 \
        and not any(is_getitem(u) and u.args[1] == 1 for u in node.users)


def _is_inference_batch_norm(node: torch.fx.Node) -> bool:
    """Batch norm with running statistics: Inductor decomposes it into pointwise ops (no reduction)."""
    packet = node.target.overloadpacket
    if packet is getattr(aten, "_native_batch_norm_legit_no_training", None):
        return True
    training_arg = (aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit)
    if packet in training_arg and len(node.args) > 5:
        return node.args[5] is False
    return False


def _is_training_batch_norm(node: torch.fx.Node) -> bool:
    """Batch norm computing batch statistics (and updating running ones in place): AOTAutograd
    functionalises the updates, Inductor lowers the statistics as reductions and the normalisation as a
    pointwise tail, fused like LayerNorm's."""
    packet = node.target.overloadpacket
    return packet in (aten.native_batch_norm, aten._native_batch_norm_legit) and len(node.args) > 5 \
        and node.args[5] is True


# ---------------------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusionGroup:
    """One kernel of the compiled program: its member node names in graph order."""

    members: tuple[str, ...]
    kind: str                   # "fused" (generated by Inductor) | "extern" | "separate" (one op, one kernel)
    phase: str
    into_concat: Optional[str] = None    # a ConcatKernel's copy of a view input: the cat whose slice it writes


@dataclass(frozen=True)
class FusionInfo:
    groups: tuple[FusionGroup, ...]
    group_of: Mapping[str, int] = field(default_factory=dict)   # member node name -> index in groups
    # inlined values (rule 3): members of their first consumer's group, recomputed by the others
    inlined: frozenset[str] = frozenset()

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
        if _larger(s, best):
            best = s
    return best


def _larger(a: sympy.Expr, b: sympy.Expr) -> bool:
    """``a > b`` for numels, symbolic ones included."""
    diff = sympy.expand(a - b)
    if diff.is_number:
        return bool(diff > 0)
    if diff.is_positive is not None:          # sizes are positive symbols: usually decidable, cheaply
        return bool(diff.is_positive)
    # symbolic sizes that sympy cannot order: prefer the one with more factors
    return len(sympy.Mul.make_args(a)) > len(sympy.Mul.make_args(b))


def _same_space(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return a == b
    return sympy.expand(a - b) == 0


# Inductor thresholds (torch/_inductor/config.py) per backend: a multi-consumer pointwise value is
# stored when it reads more than REUSE_READS buffers or has more than OPCOUNT ops; any pointwise
# value is stored when it accumulated more than ACC_READS reads. The C++ backend tolerates larger
# bodies (``realize_cpu_opcount_threshold``, ``realize_cpu_acc_reads_threshold``).
_REUSE_READS = 4                                  # config.realize_reads_threshold
_OPCOUNT = {"gpu": 30, "cpu": 50}                 # config._realize_opcount_threshold_default / cpu
_ACC_READS = {"gpu": 8, "cpu": 12}                # config._realize_acc_reads_threshold_default / cpu
_MAX_POINTWISE_CAT = 8                            # config.max_pointwise_cat_inputs
# ir.StorageBox.should_realize_on_reuse, C++ only: a reused value computing one of these is stored.
_CPU_HEAVY = _packets("exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh")
BACKENDS = ("gpu", "cpu")
# Composite reductions Inductor decomposes into a reduction *and* a pointwise op both reading the input
# (var_mean and x - mean; amax and exp(x - max)): an input they read counts as read by two consumers.
_READS_INPUT_TWICE = _packets(
    "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
    "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "logsumexp", "native_batch_norm",
    "batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
)


_Visit = Callable[[torch.fx.Node], tuple[bool, Iterable[torch.fx.Node]]]


def _reachable(start: Iterable[torch.fx.Node], visit: _Visit, breadth_first: bool = False) -> list[torch.fx.Node]:
    """The nodes a walk from ``start`` collects, each node visited once: ``visit(n)`` says whether to
    collect ``n`` and which nodes to walk on to (the one graph walk behind the look-through helpers)."""
    out: list[torch.fx.Node] = []
    stack, seen = list(start), set()
    while stack:
        n = stack.pop(0) if breadth_first else stack.pop()
        if n in seen:
            continue
        seen.add(n)
        collect, more = visit(n)
        if collect:
            out.append(n)
        stack.extend(more)
    return out


def _consumers(node: torch.fx.Node, cls_of: Mapping[torch.fx.Node, str]) -> list[torch.fx.Node]:
    """The kernel nodes (or the graph output) reading ``node``, looking through views and getitems."""
    def visit(u: torch.fx.Node) -> tuple[bool, Iterable[torch.fx.Node]]:
        if u.op == "call_function" and cls_of.get(u, CLASS_NONE) == CLASS_NONE:
            return False, u.users
        return u.op != "call_function" or not _is_assert(u), ()
    return _reachable(node.users, visit, breadth_first=True)


def _is_assert(node: torch.fx.Node) -> bool:
    return "assert" in str(node.target)


def _is_pointwise_use(node: torch.fx.Node) -> bool:
    """Inductor's ``utils.is_pointwise_use``: the op is tagged pointwise (views: all their uses are)."""
    if node.op != "call_function":
        return False
    is_op = isinstance(node.target, torch._ops.OpOverload)
    if node.target is operator.getitem or (is_op and is_view_node(node)):
        return all(_is_pointwise_use(u) for u in node.users)
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags


def _cat_inputs(node: torch.fx.Node) -> Optional[list[Any]]:
    """The inputs of the ``cat`` a node is (or decomposes into: ``diff`` with prepend/append), or None."""
    packet = node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else None
    if packet is aten.cat:
        return list(node.args[0]) if node.args else []
    if packet is aten.diff:
        args = list(node.args) + [None] * 5
        prepend, append = node.kwargs.get("prepend", args[3]), node.kwargs.get("append", args[4])
        if prepend is not None or append is not None:
            return [a for a in (prepend, args[0], append) if a is not None]
    return None


def _concat_kernel(node: torch.fx.Node, cls_of: Mapping[torch.fx.Node, str], backend: str) -> bool:
    """Whether Inductor lowers this ``cat`` as a ``ConcatKernel`` (each input stored into its slice
    by its own kernel) rather than a pointwise cat inlined into its consumers (lowering.py ``cat``).

    A cat of one input repeated is decomposed into an expand + copy first (decomposition.py ``cat``),
    a plain pointwise op. Otherwise the C++ backend always uses a ConcatKernel; the GPU one uses a
    pointwise cat for at most ``max_pointwise_cat_inputs`` inputs, none of which has another consumer
    (it would be computed twice), when the cat feeds pointwise ops or none of its inputs is a reduction.
    """
    inputs = [a for a in (_cat_inputs(node) or ()) if isinstance(a, torch.fx.Node)]
    if len(set(inputs)) <= 1:
        return False
    if backend == "cpu":
        return True
    if len(inputs) > _MAX_POINTWISE_CAT:
        return True
    for inp in inputs:
        others = [u for u in inp.users if u is not node]
        if others and (cls_of.get(inp) == CLASS_POINTWISE or any(_is_pointwise_use(u) for u in others)):
            return True
    pointwise_uses = all(_is_pointwise_use(u) for u in node.users)
    return not pointwise_uses and any(cls_of.get(i) == CLASS_REDUCTION for i in inputs)


def _virtual_nodes(program: Program, cls_of: Mapping[torch.fx.Node, str], backend: str) -> set[torch.fx.Node]:
    """Pointwise nodes Inductor never stores: each consumer kernel computes them inline.

    Inductor keeps a pointwise value unrealised (a loader, ``ir.Pointwise``) and inlines it into every
    consumer, unless it is stored (graph.py ``GraphLowering.run_node``, ir.py
    ``StorageBox.should_realize_on_reuse`` / ``has_exceeded_max_reads``, lowering.py
    ``needs_realized_inputs``): a consumer is no generated kernel (matmul, attention, scatter, a
    ``ConcatKernel``, the graph output, another phase); it has several consumers and reads more than
    ``realize_reads_threshold`` buffers or has a large body; it reads more than
    ``realize_acc_reads_threshold`` buffers. ``reads`` counts the distinct stored values the inlined
    expression loads (a gather loads its weight and indices, ``arange`` nothing).
    """
    reads: dict[torch.fx.Node, frozenset] = {}
    body: dict[torch.fx.Node, frozenset] = {}     # the inlined pointwise nodes a value computes
    virtual: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        cls = cls_of.get(node, CLASS_NONE)
        inputs = node.all_input_nodes
        if node.op == "call_function" and cls in (CLASS_NONE, CLASS_POINTWISE):
            r = frozenset().union(*(reads.get(i, frozenset()) for i in inputs))
            b = frozenset().union(*(body.get(i, frozenset()) for i in inputs))
            b = b | {node} if cls == CLASS_POINTWISE else b
            if cls == CLASS_NONE or _stays_virtual(program, node, cls_of, backend, len(r), b):
                reads[node], body[node] = r, b
                if cls == CLASS_POINTWISE:
                    virtual.add(node)
                continue
        tensor = isinstance(node.meta.get("val"), torch.Tensor)
        stored = node.op != "output" and (node.op == "call_function" or tensor)
        reads[node], body[node] = (frozenset([node]) if stored else frozenset()), frozenset()
    return virtual


def _region(program: Program, node: torch.fx.Node) -> tuple:
    """What one call of a compiled region runs: a phase, and in a pipeline stage program one schedule
    action (each micro-batch's forward or backward is its own call; no kernel spans two)."""
    return program.phase_of(node), node.meta.get(META_ACTION)


def _stays_virtual(program: Program, node: torch.fx.Node, cls_of: Mapping[torch.fx.Node, str], backend: str,
                   n_reads: int, body: frozenset) -> bool:
    """The realisation rules of ``_virtual_nodes`` for one pointwise node."""
    if _cat_inputs(node) is not None and _concat_kernel(node, cls_of, backend):
        return False
    consumers = _consumers(node, cls_of)
    region = _region(program, node)
    if not consumers or program.runs_eagerly(node):
        return False
    for c in consumers:
        if c.op == "call_function" and _cat_inputs(c) is not None and _concat_kernel(c, cls_of, backend):
            if node in _cat_inputs(c):
                return False    # computed straight into its slice of the concat buffer: a kernel of its own
            continue            # a view of it is copied into the slice by a kernel that inlines it
        if c.op != "call_function" or _region(program, c) != region or program.runs_eagerly(c) or cls_of.get(
                c) not in (CLASS_POINTWISE, CLASS_REDUCTION):
            return False
    if n_reads > _ACC_READS[backend]:
        return False
    uses = sum(2 if c.target.overloadpacket in _READS_INPUT_TWICE and cls_of.get(c) == CLASS_REDUCTION else 1
               for c in consumers)
    if uses > 1:
        heavy = backend == "cpu" and any(b.target.overloadpacket in _CPU_HEAVY for b in body)
        # NB: each aten op is one or more Inductor ops: len(body) underestimates inner_fn_opcount
        if n_reads > _REUSE_READS or len(body) > _OPCOUNT[backend] or heavy:
            return False
    return True


def _producers(node: torch.fx.Node, cls_of: Mapping[torch.fx.Node, str],
               virtual: frozenset | set = frozenset()) -> list[torch.fx.Node]:
    """Stored kernel outputs ``node`` reads, looking through views, getitems and inlined values."""
    def visit(n: torch.fx.Node) -> tuple[bool, Iterable[torch.fx.Node]]:
        if n.op != "call_function":
            return False, ()
        if cls_of.get(n, CLASS_NONE) == CLASS_NONE or n in virtual:
            return False, n.all_input_nodes
        return True, ()
    return _reachable(node.all_input_nodes, visit, breadth_first=True)


_LOG_SOFTMAX = _packets("_log_softmax", "log_softmax")
_NLL_FORWARD = _packets("nll_loss_forward", "nll_loss2d_forward")


def _gathers_log_probs(node: torch.fx.Node, prod: torch.fx.Node, phase: str, program: Program) -> bool:
    """Rule 7: ``node`` is cross-entropy's ``nll_loss_forward`` reading a ``log_softmax`` no other node of
    its phase reads. Inductor decomposes the log-softmax into per-row statistics (max, log-sum-exp) and a
    pointwise tail that the loss's gather evaluates at the target index only: the log-probabilities are
    never stored, whatever the two kernels' iteration spaces."""
    if not (isinstance(node.target, torch._ops.OpOverload) and node.target.overloadpacket in _NLL_FORWARD
            and isinstance(prod.target, torch._ops.OpOverload) and prod.target.overloadpacket in _LOG_SOFTMAX):
        return False
    stack = [prod]
    while stack:
        cur = stack.pop()
        for user in cur.users:
            if user is node or program.phase_of(user) != phase:
                continue
            if is_view_node(user) and user.args and user.args[0] is cur:
                stack.append(user)
                continue
            return False
    return True


def _dead_nodes(nodes: Sequence[torch.fx.Node], cls_of: Mapping[torch.fx.Node, str]) -> set[torch.fx.Node]:
    """Kernel-class nodes whose value nothing uses (Inductor's dead-code elimination drops them)."""
    dead: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if cls_of.get(node) in (CLASS_SCATTER, CLASS_FOREACH) or _is_assert(node):
            continue
        if all(u in dead or _is_assert(u) for u in node.users):
            dead.add(node)
    return dead


def _rows(node: torch.fx.Node) -> Any:
    """A reduction's output numel (its smallest output: LayerNorm's mean, not its normalised copy;
    LayerNorm backward's row count, that of its ``mean`` argument)."""
    if node.target.overloadpacket is aten.native_layer_norm_backward and len(node.args) > 3:
        n = _numel(node.args[3].meta.get("val")) if isinstance(node.args[3], torch.fx.Node) else None
        if n is not None:
            return n
    val = node.meta.get("val")
    sizes = [_numel(v) for v in (val if isinstance(val, (list, tuple)) else [val])]
    sizes = [n for n in sizes if n is not None]
    best = sizes[0] if sizes else sympy.Integer(1)
    for n in sizes[1:]:
        if _larger(best, n):
            best = n
    return best


# scheduler.py ``MixOrderReduction.can_fuse`` (strict mode): at least 5 Mi elements, rows >= 2 * columns
_MIX_ORDER_MIN_NUMEL = 5 * 2 ** 20


def _mix_order_ok(rows_in_group: Sequence[Any], rows: Any, space: Any, backend: str) -> bool:
    """Whether a reduction with ``rows`` outputs may join a group holding reductions with ``rows_in_group``.

    Equal row counts: one reduction loop. Different ones (a row and a column reduction of the same
    tensor, e.g. LayerNorm's input gradient and its weight gradient): only Triton's mix-order reduction
    fuses them, for large tensors (>= 5 Mi elements, twice as many rows as columns); symbolic sizes
    that cannot be proven large are not fused.
    """
    for other in rows_in_group:
        if _same_space(other, rows):
            continue
        if backend != "gpu":
            return False
        big, small = (other, rows) if _larger(other, rows) else (rows, other)
        margins = (space - _MIX_ORDER_MIN_NUMEL, big - 2 * small)
        if not all(sympy.expand(d).is_nonnegative is True for d in margins):
            return False
    return True


# views that read part of their base: two kernels reading one buffer through different ones read different
# elements (BLOOM's q, k and v copies out of its fused projection)
_SELECTING_VIEWS = _packets("select", "slice", "narrow", "unbind", "split", "split_with_sizes", "chunk",
                            "as_strided", "diagonal")


def _stored_reads(node: torch.fx.Node, cls_of: Mapping[torch.fx.Node, str],
                  virtual: set[torch.fx.Node]) -> list[tuple[torch.fx.Node, tuple]]:
    """The stored values (graph inputs and kernel outputs) the kernel of ``node`` loads, each with the part read:
    the selecting views (op and constant arguments, a multi-output view's ``getitem`` index) on the way.
    Inductor pairs two kernels for a horizontal fusion only when they share data (scheduler.py
    ``score_fusion_memory``: equal memory dependencies); reads of different parts of a buffer share none."""
    out: list[tuple[torch.fx.Node, tuple]] = []
    seen: set[tuple[torch.fx.Node, tuple]] = set()
    stack = [(n, ()) for n in node.all_input_nodes]
    while stack:
        n, part = stack.pop()
        if (n, part) in seen:
            continue
        seen.add((n, part))
        if not isinstance(n.meta.get("val"), (torch.Tensor, list, tuple)):
            continue
        if n.op == "call_function" and (cls_of.get(n, CLASS_NONE) == CLASS_NONE or n in virtual):
            packet = getattr(n.target, "overloadpacket", None)
            if packet in _SELECTING_VIEWS or n.target is operator.getitem:
                constants = tuple(a for a in n.args[1:] if not isinstance(a, torch.fx.Node))
                part = part + ((str(n.target), repr(constants)),)
            stack.extend((i, part) for i in n.all_input_nodes)
            continue
        out.append((n, part))
    return out


def _inlined_into(node: torch.fx.Node, virtual: set[torch.fx.Node],
                 group_of: Mapping[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """The not yet owned inlined (virtual) values ``node`` computes: its kernel is their first."""
    return _inlined_from(node.all_input_nodes, virtual, group_of)


def _inlined_from(starts: Sequence[torch.fx.Node], virtual: set[torch.fx.Node],
                  group_of: Mapping[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """The not yet owned inlined values reachable from ``starts`` through views, getitems and each other."""
    def visit(n: torch.fx.Node) -> tuple[bool, Iterable[torch.fx.Node]]:
        if n.op != "call_function" or n in group_of:
            return False, ()          # an input, or a stored value / an inlined one already owned
        return n in virtual, n.all_input_nodes     # through views and getitems too
    return _reachable(starts, visit)


def backend_for(program: Program) -> str:
    """The Inductor backend that compiles ``program`` for its target: C++ for a CPU, Triton otherwise."""
    return "cpu" if program.options.target_kind == "cpu" else "gpu"


def fusion_groups(program: Program, backend: Optional[str] = None) -> FusionInfo:
    """The modelled Inductor fusion of ``program`` (rules 1-6 of the module docstring).

    ``backend``: "gpu" (Triton) or "cpu" (Inductor's C++ backend, whose few differing rules are listed
    in the module docstring); by default the one of the program's target (``backend_for``).
    """
    backend = backend_for(program) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    nodes = list(program.graph.nodes)
    cls_of = {n: node_class(n) for n in nodes}
    concat = {n for n in nodes if cls_of[n] == CLASS_POINTWISE and _cat_inputs(n) is not None
              and _concat_kernel(n, cls_of, backend)}
    dead = _dead_nodes(nodes, cls_of)
    virtual = _virtual_nodes(program, cls_of, backend)
    for n in concat:
        cls_of[n] = CLASS_SCATTER    # a ConcatKernel: its inputs are stored into it, nothing fuses with it
    group_members: list[list[torch.fx.Node]] = []
    group_kind: list[str] = []
    group_space: list[Any] = []
    group_phase: list[str] = []
    group_region: list[tuple] = []      # (phase, schedule action): what one call of a compiled region runs
    group_pointwise: list[bool] = []
    group_rows: list[list[Any]] = []     # output numels of the group's reductions
    readers: dict[torch.fx.Node, list[int]] = {}     # stored value -> groups reading it (rule 5)
    copy_into: dict[int, str] = {}                   # a ConcatKernel's copy kernel -> the cat's name
    group_of: dict[torch.fx.Node, int] = {}
    alive: list[bool] = []
    # anc[n]: bitmask of the groups a placed node n depends on (including its own); cycles are checked
    # with it. Views and inlined values are looked through on demand (``anc_of``): an inlined value's
    # owner is only known once its first consumer is placed.
    anc: dict[torch.fx.Node, int] = {}
    through: dict[torch.fx.Node, int] = {}     # memo of anc_of for the others, cleared on each ownership

    def new_group(members: list[torch.fx.Node], kind: str, space: Any, phase: str, region: tuple,
                  pointwise: bool) -> int:
        group_members.append(list(members))
        group_kind.append(kind)
        group_space.append(space)
        group_phase.append(phase)
        group_region.append(region)
        group_pointwise.append(pointwise)
        group_rows.append([])
        alive.append(True)
        return len(group_members) - 1

    def find(g: int) -> int:
        while not alive[g]:
            g = redirect[g]
        return g

    redirect: dict[int, int] = {}

    def anc_of(node: torch.fx.Node) -> int:
        if node in anc:
            return anc[node]
        if node not in through:
            mask = 1 << group_of[node] if node in group_of else 0
            through[node] = mask | ancestors_of(node)
        return through[node]

    def ancestors_of(node: torch.fx.Node) -> int:
        mask = 0
        for inp in node.all_input_nodes:
            mask |= anc_of(inp)
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

    def merge(g: int, t: int) -> None:
        """Merge groups ``g`` and ``t`` (``t``: the group of the node being placed) into the lower index."""
        lo, hi = min(g, t), max(g, t)
        group_members[lo].extend(group_members[hi])
        group_space[lo] = group_space[t]
        group_pointwise[lo] = group_pointwise[g] and group_pointwise[t]
        group_rows[lo] = group_rows[g] + group_rows[t]
        alive[hi] = False
        redirect[hi] = lo

    def via_outside(inp: torch.fx.Node, g: int, inside: tuple[int, ...]) -> bool:
        """Whether ``inp`` depends on group ``g`` through a kernel outside the groups ``inside``
        (views, getitems and inlined values of a member are looked through: they are the member)."""
        if inp in group_of and find(group_of[inp]) in inside:
            return False
        if inp.op == "call_function" and inp not in anc:       # a view, getitem or unowned inlined value
            return any(via_outside(i, g, inside) for i in inp.all_input_nodes)
        return bool(canonical(anc_of(inp)) >> g & 1)

    def no_outside_path(src: int, dst: int) -> bool:
        """No member of ``dst`` reads a node outside src/dst that depends on ``src``."""
        return not any(via_outside(inp, src, (src, dst)) for member in group_members[dst]
                       for inp in member.all_input_nodes)

    for node in nodes:
        cls = cls_of[node]
        if node.op != "call_function" or cls == CLASS_NONE or node in virtual or node in dead:
            continue
        phase = program.phase_of(node)
        region = _region(program, node)
        if program.runs_eagerly(node) and cls in FUSIBLE:
            cls = CLASS_SCATTER       # rule 2: the optimizer step (and AccumulateGrad) run eagerly, one kernel per op
        space = _space(node, cls)
        target_group: Optional[int] = None
        if cls in FUSIBLE:
            for prod in _producers(node, cls_of, virtual):
                g = group_of.get(prod)
                if g is None:
                    continue
                g = find(g)
                if group_kind[g] != "fused" or group_region[g] != region:
                    continue
                spaces_fit = (_same_space(group_space[g], space) or (
                    cls == CLASS_POINTWISE and any(_same_space(r, space) for r in group_rows[g]))) and not (
                    cls == CLASS_REDUCTION and not _mix_order_ok(group_rows[g], _rows(node), space, backend))
                # rule 7: cross-entropy's gather evaluates the log-softmax it reads, whatever the spaces
                if not (spaces_fit or _gathers_log_probs(node, prod, phase, program)):
                    continue
                # no cycle: no other input of the node may depend on the group through an outside node
                if not any(via_outside(inp, g, (g,)) for inp in node.all_input_nodes):
                    target_group = g
                    break
        if target_group is None:
            kind = "fused" if cls in FUSIBLE else ("separate" if cls == CLASS_SCATTER else "extern")
            target_group = new_group([node], kind, space, phase, region, cls == CLASS_POINTWISE)
        else:
            group_members[target_group].append(node)
            group_pointwise[target_group] &= cls == CLASS_POINTWISE
        group_of[node] = target_group
        if cls == CLASS_REDUCTION:
            group_rows[target_group].append(_rows(node))
        if node in concat:
            # a ConcatKernel copies each input that is a view into its slice with a kernel of its own, which
            # computes the inlined values the view reads (ir.py ``ConcatKernel.realize_into``)
            for inp in _cat_inputs(node) or ():
                owned = _inlined_from([inp], virtual, group_of) if isinstance(inp, torch.fx.Node) else []
                if not owned:
                    continue
                copy = new_group(owned, "fused", _space(owned[0], CLASS_POINTWISE), phase, region, True)
                copy_into[copy] = node.name
                for v in owned:
                    group_of[v] = copy
                through.clear()
        for v in _inlined_into(node, virtual, group_of):     # rule 6: first consumer owns inlined values
            group_of[v] = target_group
            group_members[target_group].append(v)
            through.clear()
        anc[node] = ancestors_of(node) | (1 << target_group)
        # rule 4: merge the node's other independent producer groups of the same space
        if cls in FUSIBLE:
            for prod in _producers(node, cls_of, virtual):
                if prod not in group_of:
                    continue
                g = find(group_of[prod])
                t = find(target_group)
                if g == t or group_kind[g] != "fused" or group_region[g] != region:
                    continue
                if not _same_space(group_space[g], group_space[t]):
                    continue
                if not all(_mix_order_ok(group_rows[g], r, group_space[t], backend) for r in group_rows[t]):
                    continue
                if not (no_outside_path(g, t) and no_outside_path(t, g)):
                    continue
                merge(g, t)
        # rule 5: horizontal fusion of independent kernels reading a common stored value (the same part of it)
        if cls in FUSIBLE:
            for buf in _stored_reads(node, cls_of, virtual):
                for g in list(readers.get(buf, ())):
                    g, t = find(g), find(target_group)
                    if g == t or group_kind[g] != "fused" or group_region[g] != region:
                        continue
                    mix_ok = all(_mix_order_ok(group_rows[g], r, group_space[t], backend)
                                 for r in group_rows[t])
                    if _same_space(group_space[g], group_space[t]) and mix_ok and no_outside_path(g, t) \
                            and no_outside_path(t, g):
                        merge(g, t)
                readers.setdefault(buf, []).append(find(target_group))
    for v in virtual - group_of.keys() - dead:     # no kernel consumer reached it: a kernel of its own
        group_of[v] = new_group([v], "fused", _space(v, CLASS_POINTWISE), program.phase_of(v), _region(program, v),
                                True)
    order = {n: i for i, n in enumerate(nodes)}
    groups: list[FusionGroup] = []
    name_to_group: dict[str, int] = {}
    for g, members in enumerate(group_members):
        if not alive[g]:
            continue
        members = sorted(members, key=order.__getitem__)
        for m in members:
            name_to_group[m.name] = len(groups)
        groups.append(FusionGroup(tuple(m.name for m in members), group_kind[g], group_phase[g], copy_into.get(g)))
    inlined = frozenset(v.name for v in virtual if v.name in name_to_group)
    return FusionInfo(tuple(groups), name_to_group, inlined)


def fusion_pass(program: Program, am: Optional[AnalysisManager] = None) -> FusionInfo:
    """Pass-manager entry point of ``fusion_groups``."""
    return fusion_groups(program)


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
