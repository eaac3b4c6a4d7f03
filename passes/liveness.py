"""Liveness pass: every tensor storage's allocation step, last use, size and memory category.

Keyed by storage, not by fx value: views and in-place results share their base's storage (see
``aliasing``), so aliases are counted once. A storage is allocated at the step of the node that
creates it and freed after the last step that uses any alias of it, exactly as the code fx generates
for a GraphModule drops references (``x = None`` after last use). Inputs of the graph (parameters,
optimizer state, user inputs) are resident for the whole step; graph outputs live to its end.

Known limitations:
- Temporaries that a single aten op allocates internally (e.g. ``layer_norm``'s mean/rstd when only
  the output is used, kernel workspaces) are not storages of the graph; the kernel database measures them.
- Memory policy (rounding, caching, fragmentation) belongs to the allocator model, not here.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx

from boomfx.passes.aliasing import output_aliases
from boomfx.passes.python_locals import python_locals_held
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.specs import dtype_itemsize, to_sympy
from boomfx.core.program import (
    META_BUFFER_REUSE, META_CONCAT_INTO, META_RUNTIME_USES, PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, PHASE_RECOMPUTE, ROLE_BUFFER, ROLE_CONSTANT, ROLE_GRAD, ROLE_INPUT, ROLE_LABEL,
    ROLE_OPT_STATE, ROLE_PARAM, Program,
)


class Category(str, enum.Enum):
    PARAM = "parameter"
    BUFFER = "buffer"
    GRAD = "gradient"
    OPT = "optimizer_state"
    ACT = "activation"
    TEMP = "temporary"
    INPUT = "input"
    OTHER = "other"


_ROLE_CATEGORY = {
    ROLE_PARAM: Category.PARAM, ROLE_BUFFER: Category.BUFFER, ROLE_OPT_STATE: Category.OPT,
    ROLE_INPUT: Category.INPUT, ROLE_LABEL: Category.INPUT, ROLE_CONSTANT: Category.OTHER, ROLE_GRAD: Category.GRAD,
}


@dataclass(frozen=True)
class StorageInterval:
    storage_id: int
    node: str                 # the node that created the storage (or the placeholder)
    start_step: int           # -1: resident before the step begins
    end_step: int             # last step at which it is alive
    nbytes: sympy.Expr
    category: Category

    @property
    def resident(self) -> bool:
        return self.start_step < 0


@dataclass(frozen=True)
class MemoryPoint:
    step: int
    live_bytes: int
    by_category: Mapping[Category, int]


@dataclass(frozen=True)
class LivenessInfo:
    intervals: tuple[StorageInterval, ...]
    order: tuple[str, ...]          # node name at each step
    # node name -> the storage ids its outputs hold (a view: its base's), for rules that extend lifetimes
    node_storages: Mapping[str, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    def extended(self, ends: Mapping[int, int]) -> "LivenessInfo":
        """The same liveness with each storage of ``ends`` (storage id -> step) alive at least to that
        step: what the rules that hold tensors longer than their last use return (resident ones stay)."""
        if not ends:
            return self
        return replace(self, intervals=tuple(
            replace(iv, end_step=max(iv.end_step, ends[iv.storage_id]))
            if iv.storage_id in ends and not iv.resident else iv for iv in self.intervals))

    def timeline(self, ev: Evaluator) -> list[int]:
        """Live bytes at each step: a difference array over the intervals, prefix-summed."""
        n = len(self.order)
        diff = [0] * (n + 1)
        base = 0
        for iv in self.intervals:
            size = ev(iv.nbytes)
            if iv.resident:
                base += size
                continue
            diff[iv.start_step] += size
            diff[iv.end_step + 1] -= size
        live, out = base, []
        for i in range(n):
            live += diff[i]
            out.append(live)
        return out

    def peak(self, ev: Evaluator, timeline: Optional[list[int]] = None) -> MemoryPoint:
        """``timeline``: ``self.timeline(ev)`` when the caller has it (a long step's costs seconds)."""
        timeline = self.timeline(ev) if timeline is None else timeline
        step = max(range(len(timeline)), key=timeline.__getitem__) if timeline else 0
        by_cat: dict[Category, int] = {}
        for iv in self.intervals:
            if iv.start_step <= step <= iv.end_step:
                by_cat[iv.category] = by_cat.get(iv.category, 0) + ev(iv.nbytes)
        return MemoryPoint(step, timeline[step] if timeline else 0, by_cat)

    def resident_bytes(self, ev: Evaluator) -> int:
        return sum(ev(iv.nbytes) for iv in self.intervals if iv.resident)

    def events(self) -> Iterator[tuple[int, str, StorageInterval]]:
        """(step, "alloc"|"free", interval) in execution order: a node's outputs are allocated before
        the storages whose last use it was are freed. Resident storages are not included."""
        by_start: dict[int, list[StorageInterval]] = {}
        by_end: dict[int, list[StorageInterval]] = {}
        for iv in self.intervals:
            if iv.resident:
                continue
            by_start.setdefault(iv.start_step, []).append(iv)
            by_end.setdefault(iv.end_step, []).append(iv)
        for step in range(len(self.order)):
            for iv in by_start.get(step, ()):
                yield step, "alloc", iv
            for iv in by_end.get(step, ()):
                yield step, "free", iv


class _NbytesMemo:
    """Bytes of a fresh storage per value object, for one pass run (deep graphs share values). Owned by the
    run, so it dies with it: a process-wide dict keyed by id() kept every analysed graph's fake tensors
    alive (and could hand a dead value's bytes to a new object at the same address)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, sympy.Expr]] = {}

    def __call__(self, val: torch.Tensor) -> sympy.Expr:
        hit = self._by_id.get(id(val))
        if hit is not None and hit[0] is val:
            return hit[1]
        nbytes = _compute_nbytes(val)
        self._by_id[id(val)] = (val, nbytes)
        return nbytes


def _compute_nbytes(val: torch.Tensor) -> sympy.Expr:
    numel = sympy.Integer(1)
    for size in val.shape:
        numel = numel * to_sympy(size)
    return numel * dtype_itemsize(val.dtype)


def _storage_key(val: torch.Tensor) -> Optional[int]:
    """Identity of the (fake) storage behind an input, so tied parameters are counted once."""
    try:
        return val.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _concat_targets(nodes: Sequence[torch.fx.Node]) -> dict[tuple[torch.fx.Node, int], torch.fx.Node]:
    """(kernel node, output index) -> the ``cat`` that output is written into (``META_CONCAT_INTO``)."""
    by_name = {n.name: n for n in nodes}
    return {(by_name[kernel], index): cat for cat in nodes
            for _, kernel, index in cat.meta.get(META_CONCAT_INTO, ())}


def liveness_pass(program: Program, am: Optional[AnalysisManager] = None,
                  uses: Optional[Mapping[torch.fx.Node, Sequence[torch.fx.Node]]] = None,
                  buffer_reuse: bool = True) -> LivenessInfo:
    """``uses``: for the nodes it names, the nodes they keep alive in place of ``all_input_nodes``
    (boomfx/analysis/analysis.py ``_eager_autograd_liveness``: eager autograd's release points), so a variant of
    the liveness needs no copy of a deep graph. Aliasing still follows the node's own arguments.
    ``buffer_reuse``: give an output the dead buffer Inductor's wrapper hands it (``META_BUFFER_REUSE``);
    False: every buffer its own storage, as Inductor's peak estimate counts them."""
    graph = program.graph
    inputs_of = _inputs_of(uses)
    fresh_nbytes = _NbytesMemo()
    nodes = list(graph.nodes)
    order = tuple(n.name for n in nodes)
    step_of = {n: i for i, n in enumerate(nodes)}
    last_step = len(nodes) - 1

    storage_nodes: list[torch.fx.Node] = []           # creator of each storage id
    storage_bytes: list[sympy.Expr] = []
    storage_start: list[int] = []
    storage_end: list[int] = []
    storage_cat: list[Optional[Category]] = []
    out_sids: dict[torch.fx.Node, list[Optional[int]]] = {}   # per output index
    resident_by_storage: dict[int, int] = {}                     # fake storage -> storage id (ties)
    by_name = {n.name: n for n in nodes}

    concat_of = _concat_targets(nodes)       # (kernel, output index) -> the cat it is written into
    concat_sid: dict[torch.fx.Node, int] = {}

    def new_storage(node: torch.fx.Node, nbytes: sympy.Expr, start: int, cat: Optional[Category]) -> int:
        storage_nodes.append(node)
        storage_bytes.append(nbytes)
        storage_start.append(start)
        storage_end.append(start if start >= 0 else last_step)
        storage_cat.append(cat)
        return len(storage_nodes) - 1

    for node in nodes:
        step = step_of[node]
        if node.op in ("placeholder", "get_attr"):
            val = node.meta.get("val")
            if node.op == "get_attr" and not isinstance(val, torch.Tensor):
                val = getattr(program.gm, str(node.target), None)
            role = program.input_roles.get(node.name, ROLE_PARAM if node.op == "get_attr" else ROLE_INPUT)
            if isinstance(val, torch.Tensor):
                # synthesised layers (boomfx/training/expand.py) share fake values but not storages
                key = node.meta.get("boomfx.storage_key") or _storage_key(val)
                if key is not None and key in resident_by_storage:     # tied weights: one storage
                    out_sids[node] = [resident_by_storage[key]]
                    continue
                sid = new_storage(node, fresh_nbytes(val), -1, _ROLE_CATEGORY.get(role, Category.OTHER))
                if key is not None:
                    resident_by_storage[key] = sid
                out_sids[node] = [sid]
            else:
                out_sids[node] = [None]
            continue
        if node.op == "output":
            for inp in node.all_input_nodes:     # graph outputs live to the end of the step
                for sid in _sids(out_sids, inp):
                    storage_end[sid] = last_step
            continue
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        if node in concat_sid:       # a ConcatKernel: its buffer was made by the first input written into it
            vals = []
            out_sids[node] = [concat_sid[node]]
        aliases = output_aliases(node) if node.op == "call_function" else [None] * len(vals)
        reused = (node.meta.get(META_BUFFER_REUSE) or ()) if buffer_reuse else ()
        sids: list[Optional[int]] = []
        for k, v in enumerate(vals):
            alias = aliases[k] if k < len(aliases) else None
            t = sum(1 for s in sids if s is not None)      # META_BUFFER_REUSE counts the storages made so far
            held = _held_storage(reused[t] if t < len(reused) else None, by_name, out_sids)
            concat = concat_of.get((node, k))
            if concat is not None and concat in concat_sid:
                sids.append(concat_sid[concat])     # the concat buffer itself, made by its first writer
            elif concat is not None and isinstance(v, torch.Tensor):
                # written into its slice of a concat buffer, allocated here (passes/concat_into.py)
                sid = held if held is not None else new_storage(node, fresh_nbytes(concat.meta["val"]), step, None)
                concat_sid[concat] = sid
                sids.append(sid)
            elif alias is None and held is not None and isinstance(v, torch.Tensor):
                sids.append(held)     # a dead buffer Inductor's wrapper held for this output
            elif alias is not None:
                src, _ = alias
                if node.target.__name__ == "getitem" if callable(node.target) else False:
                    idx = node.args[1]
                    src_sids = out_sids.get(src, [])
                    sids.append(src_sids[idx] if isinstance(idx, int) and idx < len(src_sids) else None)
                else:
                    src_list = out_sids.get(src, [])
                    sids.append(src_list[0] if src_list else None)
            elif isinstance(v, torch.Tensor):
                sids.append(new_storage(node, fresh_nbytes(v), step, None))
            else:
                sids.append(None)
        if vals or node not in concat_sid:
            out_sids[node] = sids
        for inp in inputs_of(node):
            for sid in _sids(out_sids, inp):
                if storage_start[sid] >= 0 and storage_end[sid] < step:
                    storage_end[sid] = step

    _assign_categories(program, nodes, out_sids, storage_nodes, storage_cat, step_of, inputs_of)
    intervals = tuple(
        StorageInterval(i, storage_nodes[i].name, storage_start[i], storage_end[i], storage_bytes[i],
                        storage_cat[i] or Category.TEMP)
        for i in range(len(storage_nodes))
    )
    node_storages = {n.name: tuple(s for s in sids if s is not None) for n, sids in out_sids.items()}
    return LivenessInfo(intervals, order, node_storages)


def _held_storage(reuse: Optional[tuple[str, int]], by_name: Mapping[str, torch.fx.Node],
                  out_sids: Mapping[torch.fx.Node, list[Optional[int]]]) -> Optional[int]:
    """The storage id of the buffer ``META_BUFFER_REUSE`` names (passes/buffer_reuse.py), None if unknown. Its
    index counts the node's storages as ``LivenessInfo.node_storages`` lists them (outputs that are not
    tensors left out)."""
    if reuse is None:
        return None
    name, index = reuse
    src = by_name.get(name)
    sids = [s for s in out_sids.get(src, []) if s is not None] if src is not None else []
    return sids[index] if index < len(sids) else None


def _inputs_of(uses: Optional[Mapping[torch.fx.Node, Sequence[torch.fx.Node]]]
               ) -> Callable[[torch.fx.Node], Sequence[torch.fx.Node]]:
    if not uses:
        return lambda node: node.all_input_nodes
    return lambda node: uses.get(node, node.all_input_nodes)


def _sids(out_sids: Mapping[torch.fx.Node, list[Optional[int]]], node: torch.fx.Node) -> list[int]:
    return [s for s in out_sids.get(node, []) if s is not None]


def _assign_categories(program: Program, nodes: list[torch.fx.Node],
                       out_sids: Mapping[torch.fx.Node, list[Optional[int]]], storage_nodes: list[torch.fx.Node],
                       storage_cat: list[Optional[Category]], step_of: Mapping[torch.fx.Node, int],
                       inputs_of: Callable[[torch.fx.Node], Sequence[torch.fx.Node]] = _inputs_of(None)) -> None:
    """Gradients by the grad-producing nodes; activations are forward storages a backward node reads."""
    by_name = {node.name: node for node in nodes} if program.grad_nodes else {}
    for name, _fqn in program.grad_nodes.items():
        node = by_name.get(name)
        if node is not None:
            for sid in _sids(out_sids, node):
                if storage_cat[sid] is None:
                    storage_cat[sid] = Category.GRAD
    if not program.options.train:
        return
    for node in nodes:
        if node.op != "call_function" or program.phase_of(node) != PHASE_BACKWARD:
            continue
        for inp in inputs_of(node):
            if inp.op != "call_function" or program.phase_of(inp) not in (PHASE_FORWARD, PHASE_RECOMPUTE):
                continue
            for sid in _sids(out_sids, inp):
                if storage_cat[sid] is None and program.phase_of(storage_nodes[sid]) == PHASE_FORWARD:
                    storage_cat[sid] = Category.ACT


# ---------------------------------------------------------------------------------------------------
# The step's liveness: what an eager training step really keeps alive (used by the analysis driver)
# ---------------------------------------------------------------------------------------------------
def step_liveness_pass(program: Program, am: Optional[AnalysisManager] = None) -> LivenessInfo:
    """The liveness of one step as PyTorch runs it: ``liveness_pass`` for inference; for training, eager
    autograd's release rules (``_eager_autograd_liveness``), gradients held by ``.grad`` to the step's
    end (``_grads_held_to_step_end``) and the per-parameter optimizer loop's locals held until the next
    parameter rebinds them (``_loop_locals_held``); in inference, the model's own Python locals and
    arguments (``passes/python_locals.py``). Every rule that decides a tensor's lifetime lives in
    this module."""
    if not program.options.train:
        return python_locals_held(am.get(liveness_pass) if am is not None else liveness_pass(program), program)
    return _loop_locals_held(_grads_held_to_step_end(_eager_autograd_liveness(program), program), program)


aten = torch.ops.aten
_SIZE_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}


def _eager_autograd_liveness(program: Program) -> LivenessInfo:
    """cpu-accuracy fix (benchmarks/cpu_accuracy.py): the liveness of a training step as eager autograd
    frees memory: the liveness pass with two changes to what a node keeps alive:

    1. size queries (``sym_size``/``sym_numel``/...) are not uses: eager reads a size off a live tensor's
       metadata and never keeps a tensor alive for it, while in the traced graph a backward
       ``sym_size`` of a forward value extended its life into the backward (Llama: the K/V
       projections, +1 MiB at the training peak);
    2. a backward autograd node (the run of backward graph nodes sharing a ``seq_nr``) releases its
       saved tensors and incoming gradients when it finishes, not at their last use inside it
       (MmBackward0 keeps its input until both of its mm's are done: the real step's peak); the
       temporaries its own formula makes die at their last use (loss parallel's Python backward frees
       ``exp(logp)`` once added, measured on gloo). Not in a compiled backward graph: there autograd
       runs one node for the whole graph and Inductor's wrapper ``del``s each saved tensor after its
       last reader (a Falcon layer's GELU output is freed between the two mm's of its MLP's backward,
       read in the output code; held to the second mm, the predicted peak was 2 MiB, 7%, high).
    Measured against the profiler peak of real CPU steps (tests/test_cpu_memory_accuracy.py).

    Scale: the changed uses go to ``liveness_pass(uses=...)``; the graph is not copied (an 80-layer
    training graph's copy and its GraphModule cost seconds)."""
    uses: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] = {}
    runtime = program.gm.meta.get(META_RUNTIME_USES)
    if runtime:   # per-rank programs (boomfx/distributed): frees a runtime does after the last use
        by_name = {n.name: n for n in program.graph.nodes}
        for name, kept in runtime.items():
            node = by_name[name]
            uses[node] = tuple(dict.fromkeys(tuple(node.all_input_nodes) + tuple(by_name[k] for k in kept)))

    def inputs(node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
        hit = uses.get(node)
        return hit if hit is not None else tuple(node.all_input_nodes)

    def close(nodes: list[torch.fx.Node]) -> None:
        if len(nodes) > 1:
            used: dict[torch.fx.Node, None] = {}
            for n in nodes:
                if n.target not in _SIZE_QUERIES:
                    used.update(dict.fromkeys(inputs(n)))
            last = nodes[-1]
            own = inputs(last)
            made = set(nodes)   # the node's own temporaries die at their last use, as in its formula
            extra = tuple(u for u in used if u is not last and u not in own and u not in made)
            if extra:
                uses[last] = tuple(dict.fromkeys(own + extra))
    group: list[torch.fx.Node] = []
    phases = program.phases

    def compiled(node: torch.fx.Node) -> bool:   # Inductor's wrapper frees each buffer after its last reader
        return program.options.compile and not program.runs_eagerly(node)
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SIZE_QUERIES:     # a size query reads metadata: not a use of its tensor
            rest: dict[torch.fx.Node, None] = {}
            torch.fx.node.map_arg((tuple(node.args[1:]), node.kwargs), lambda a: rest.setdefault(a))
            rest.update(dict.fromkeys(u for u in uses.get(node, ()) if u not in node.all_input_nodes))
            uses[node] = tuple(rest)
        seq = node.meta.get("seq_nr") if phases.get(node.name) == PHASE_BACKWARD and not compiled(node) else None
        if group and (seq is None or group[-1].meta.get("seq_nr") != seq):
            close(group)
            group = []
        if seq is not None:
            group.append(node)
    close(group)
    return liveness_pass(program, uses=uses)


def _grads_held_to_step_end(info: LivenessInfo, program: Program) -> LivenessInfo:
    """cpu-accuracy fix (benchmarks/cpu_accuracy.py): in an eager step (``loss.backward();
    opt.step(); opt.zero_grad(set_to_none=True)``) every gradient is held by its parameter's
    ``.grad`` until ``zero_grad``, i.e. to the end of the optimizer phase, not to its last use inside
    the traced optimizer (AdamW's foreach ``sqrt`` temporaries coexist with all gradients: the
    profiler peak of a real CPU step sits there). Gradient storages end at the last optimizer op.
    Not with ``resident_grads``: there the ``.grad`` buffers are resident and each new gradient is a
    temporary that its AccumulateGrad ``add_`` frees (boomfx/training/trace.py)."""
    if not program.options.train or not program.grad_nodes or program.options.resident_grads:
        return info
    opt_steps = [i for i, name in enumerate(info.order) if program.phases.get(name) == PHASE_OPTIMIZER]
    if not opt_steps:
        return info
    return info.extended({iv.storage_id: opt_steps[-1] for iv in info.intervals if iv.category == Category.GRAD})


def _loop_locals_held(info: LivenessInfo, program: Program) -> LivenessInfo:
    """CPU-accuracy fix (tests/test_cpu_memory_accuracy.py, ``foreach=False``): torch.optim's per-parameter
    loop (``_single_tensor_adamw``, eager's default on CPU) binds ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``
    to a Python local. It lives until the next parameter's ``denom = ...`` rebinds it, not to its last use in
    that parameter's ``addcdiv_``: the next parameter's ``sqrt`` and division temporaries coexist with it
    (measured: +16 KiB, one [128, 32] fp32 embedding's denominator, at a small GPT's profiler peak).

    The loop's locals are taken to be the temporaries that each parameter's last in-place update reads
    (Adam/AdamW's ``denom``); each is held until the same argument of the next parameter's last update
    is made, the last one to the end of the optimizer phase. SGD's loop rebinds its local
    (``grad = grads[i]``, then ``grad.add(param, alpha=weight_decay)``) at the top of the next
    iteration, before it allocates anything: its temporaries die at their last use, as traced."""
    options = program.options
    if not options.train or options.uses_foreach or options.optimizer not in ("adam", "adamw"):
        return info
    opt_steps = [i for i, name in enumerate(info.order) if program.phases.get(name) == PHASE_OPTIMIZER]
    if not opt_steps:
        return info
    param_storages = {sid for n in program.graph.nodes if n.op == "placeholder"
                      and program.input_roles.get(n.name) == ROLE_PARAM for sid in info.node_storages.get(n.name, ())}
    final_update: dict[int, torch.fx.Node] = {}    # parameter storage -> its last in-place update
    for node in program.graph.nodes:
        updated = info.node_storages.get(node.name, ())
        if (node.op == "call_function" and program.phases.get(node.name) == PHASE_OPTIMIZER
                and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name.endswith("_")
                and len(updated) == 1 and updated[0] in param_storages):
            final_update[updated[0]] = node
    step_of = {name: i for i, name in enumerate(info.order)}
    updates = sorted(final_update.values(), key=lambda n: step_of[n.name])
    temp_of = {iv.storage_id: iv for iv in info.intervals if not iv.resident and iv.category == Category.TEMP}
    held: dict[int, int] = {}      # storage id -> new end step
    for k, update in enumerate(updates):
        following = updates[k + 1] if k + 1 < len(updates) else None
        for j, arg in enumerate(update.args[1:], start=1):
            storages = info.node_storages.get(arg.name, ()) if isinstance(arg, torch.fx.Node) else ()
            iv = temp_of.get(storages[0]) if len(storages) == 1 else None
            if iv is None or program.phases.get(iv.node) != PHASE_OPTIMIZER:
                continue
            rebinding = following.args[j] if following is not None and j < len(following.args) else None
            held[iv.storage_id] = step_of[rebinding.name] if isinstance(rebinding, torch.fx.Node) else opt_steps[-1]
    return info.extended(held)
