"""Pipeline parallelism: one training program per stage, its micro-batches replayed in schedule order.

The main layer list (``boomfx/core/layers.py`` via ``find_layer_list``) is cut into ``pp`` stages as
``benchmarks/distributed_truth.py``'s ``stage_layer_ranges`` does (as even as possible, earlier
stages take the remainder; torchtitan's manual split): the embedding and everything before the
layers on the first stage, the final norm, head and loss on the last. Ops before the layers that
read no parameter (Llama's rotary tables) run on every stage that uses them, as a stage module
recomputes them. A stage's program, as ``torch.distributed.pipelining`` (torch 2.13) runs it:

- resident: its parameters and AdamW state, and ``PipelineStage``'s receive buffers, one per
  micro-batch (activations on every stage but the first, output gradients on every stage but the
  last), allocated at the first step and kept;
- per action of the schedule (``ScheduleGPipe``: all forwards, then all backwards;
  ``Schedule1F1B``: ``min(M, pp - stage)`` warm-up forwards, then one backward / one forward, then
  the remaining backwards; ``boomfx.simulate.pipeline.stage_orders`` gives the same order), the
  stage's forward on one micro-batch (``recv_`` into the buffer, the layers, ``send`` of the output)
  or its backward (``recv_`` of the output gradient, the layers' backward, ``send`` of the input's
  gradient). The output is held in ``fwd_cache`` until its backward ends; the saved activations of
  in-flight micro-batches live until their backward as in autograd;
- a sent tensor (the stage's output, the input's gradient, which ``stage_backward`` drops from
  ``.grad`` at once) lives while the schedule's local ``P2POp``/``Work`` lists reference it
  (``send_releases``: GPipe keeps every send until it returns; 1F1B replays its assignments);
- gradients: the first micro-batch's gradient becomes ``.grad``; each later one is added in place
  (``AccumulateGrad``) and freed; ``scale_grads`` divides them by M in place after the last backward;
- kept across steps (until the next step's ``clear_runtime_states``): the last stage's output chunks
  (one logits tensor per micro-batch). They are graph outputs here and are listed in
  ``gm.meta[META_CARRIED]``: a measured step starts with the previous step's copies alive and frees
  them first, so its peak above its start is ``peak_live - resident - carried``;
- the last stage concatenates its output chunks into the step's output (``_merge_outputs``) after its
  last backward; AdamW then steps the stage's own parameters.

Batch: the stage programs are per micro-batch (``micro_bindings``: the batch symbol bound to
``batch / M``).

Interleaved 1F1B (``ScheduleInterleaved1F1B``, ``--pp-stages-per-rank v``, default 2): the layers are
cut into ``pp x v`` virtual stages; rank s holds s, s + pp, ... (its chunks), with each chunk's
receive buffers, and runs its chunks' forwards and backwards in the order
``_get_1f1b_rank_ops`` gives (``(v - 1) pp + 2 (pp - 1 - s)`` warm-up forwards, micro-batches in
rounds of pp through the chunks, backwards through them in reverse; ``stage_orders("interleaved")``).
It runs on ``_PipelineScheduleRuntime``, which keeps every send's ``Work`` in ``send_ops`` until the
step ends: each sent activation and input gradient lives to the end of the step. Every node
carries its chunk (``META_CHUNK``), so the step's time is priced per virtual stage.

Known limitations:
- Interleaved 1F1B with dp_replicate is refused (OptionError): torch 2.13's DDP fails under
  ``ScheduleInterleaved1F1B`` (its reducer's bucket rebuild asserts, seen on gloo); with dp_shard it is
  built for any number of chunks per rank (``pp_fsdp.py``: the runtime keeps 3 gathered at a time).
- One activation crosses each stage boundary (the residual stream); a model that hands more is
  refused. A length the graph reads off an earlier stage's tensor is not a second activation: it is
  read off the received one. A parameter tied across stages (an embedding and head) is held by each
  stage that reads it, its gradient all-reduced over them before the step (``pp_tied_weights.py``);
  with a vocabulary-parallel TP plan it is refused.

Combinations (``ranks._pipeline_classes``): with ``tp`` the stages are cut from the TP rank's program
(``tensor_parallel.tp_rank_program``), so each micro-batch copy carries its TP all-reduces (with
torchtitan's plan: the vocabulary-parallel embedding on the first stage, the head and loss parallel
on the last, and under ``sp`` a sequence-split residual stream across the boundary; a backward size
the graph reads off another stage's tensor is read off the stage's own, ``_Split.sizes_in``); with
``dp_replicate`` each stage program is DDP-rewritten (``fsdp.ddp_rank_program``) with its gradients
ready at ``gm.meta[META_GRAD_READY]``: the last micro-batch's accumulations, the only backward
``PipelineStage`` runs outside ``DistributedDataParallel.no_sync``; with ``dp_shard`` each stage
program is FSDP-rewritten per shard (``pp_fsdp.fsdp_stage_program``: gathered once, or per action
when the layers reshard after forward; gradients accumulated unsharded, reduce-scattered after the last
backward).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx

from boomfx.core.errors import OptionError
from boomfx.core.fx_copy import copy_node
from boomfx.core.layers import module_path
from boomfx.core.program import (
    META_ACTION,
    META_RUNTIME_USES,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_OPTIMIZER,
    PHASE_RECOMPUTE,
    ROLE_PARAM,
    Program,
)
from boomfx.distributed.graph_edit import owning_layer
from boomfx.distributed.mesh_groups import PP_TIED_GROUP
from boomfx.distributed.p2p import p2p_ops
from boomfx.distributed.pp_tied_weights import shared_weights, tied_gradients
from boomfx.distributed.plan import ParallelConfig
from boomfx.passes.specs import to_sympy
from boomfx.simulate.pipeline import BACKWARD, FORWARD, stage_orders
from boomfx.training.expand import STORAGE_KEY
from boomfx.training.checkpointing import find_layer_list, layer_names

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_getitem = operator.getitem
ROLE_COMM_BUFFER = "comm_buffer"
META_CARRIED = "boomfx.pp_carried"  # node names held from one step into the next
META_GRAD_READY = "boomfx.pp_grad_ready"  # node name -> parameter: its .grad final (the last backward)
META_CHUNK = "boomfx.pp_chunk"  # a stage program node's virtual stage (its model chunk, interleaved 1F1B)
META_LAYOUT = "boomfx.pp_layout"  # gm.meta: the stage program's StageLayout (pipeline_compose.py reads it)
PP_GROUP = "pp"
_SEQ_STRIDE = 1_000_000  # each micro-batch's backward nodes get their own autograd seq_nr range


@dataclass(frozen=True)
class StageProgram:
    stage: int
    layers: tuple[str, ...]
    program: Program
    chunk_layers: tuple[tuple[str, ...], ...] = ()  # interleaved 1F1B: each chunk's layers

    def describe_layers(self) -> str:
        """``layers.0..layers.3``, or per chunk ``layers.0, layers.2`` (interleaved)."""
        groups = self.chunk_layers or (self.layers,)
        return ", ".join(g[0] if len(g) == 1 else f"{g[0]}..{g[-1]}" for g in groups)


@dataclass(frozen=True)
class StageLayout:
    """Where a stage program's schedule put things, by node name: what ``pipeline_compose`` needs to replay
    the program's micro-batches for another micro-batch count without building it."""

    stage: int
    pp: int
    microbatches: int
    order: tuple[tuple[str, int, int], ...]      # the actions (kind, micro-batch, virtual stage) in order
    action_ends: dict[tuple[str, int, int], str]  # action -> its last node (a send's anchor: send_releases)
    sent: dict[str, tuple[str, int, int]]         # node whose output an action sends -> that action
    backward_ends: dict[tuple[str, int, int], str]  # backward action -> its last layer node (fwd_cache)
    buffers: tuple[tuple[str, ...], ...]          # receive buffers, one group per (kind, chunk), one per micro-batch
    merge: Optional[str]                          # the last stage's _merge_outputs cat (its size grows with M)
    releases: str                                 # send_releases' rules: gpipe, 1f1b or runtime
    pipeline_end: str

    def renamed(self, moved: Mapping[str, str]) -> "StageLayout":
        """The layout after a rewrite erased the nodes ``moved`` names (each -> the node now in its place)."""
        def name(n: str) -> str:
            while n in moved:
                n = moved[n]
            return n

        return dataclasses.replace(
            self, action_ends={k: name(v) for k, v in self.action_ends.items()},
            sent={name(k): v for k, v in self.sent.items()},
            backward_ends={k: name(v) for k, v in self.backward_ends.items()},
            merge=name(self.merge) if self.merge is not None else None, pipeline_end=name(self.pipeline_end))


def stage_layer_ranges(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers per stage: as even as possible, earlier stages take the remainder."""
    base, extra = divmod(n_layers, stages)
    ranges, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def micro_bindings(program: Program, cfg: ParallelConfig, bindings: Mapping[sympy.Symbol, int]
                   ) -> dict[sympy.Symbol, int]:
    """The per-rank bindings with the batch symbol at one micro-batch (``batch / M``)."""
    out = dict(bindings)
    m = cfg.num_microbatches
    for info in program.symbols.values():
        if info.role == "batch" and info.symbol in out:
            batch = int(out[info.symbol])
            if batch % m:
                raise OptionError(f"--microbatches {m} does not divide the batch of {batch}")
            out[info.symbol] = batch // m
    return out


# -- splitting the training graph -----------------------------------------------------------------
@dataclass
class _Split:
    fwd: list[list[torch.fx.Node]]  # per stage, in graph order
    bwd: list[list[torch.fx.Node]]
    act_in: list[Optional[torch.fx.Node]]  # the activation a stage receives (None on the first)
    grad_in: list[Optional[torch.fx.Node]]  # the output gradient a stage receives (None on the last)
    output: torch.fx.Node  # the model's output (the last stage's output chunk)
    params: list[list[torch.fx.Node]]
    # per stage, backward sizes computed on another stage -> (a tensor of this stage, its dim) to read
    # them from (a stage's autograd reads its sizes off its own tensors)
    sizes_in: list[dict[torch.fx.Node, tuple[torch.fx.Node, int]]]
    # per stage, forward sizes the graph reads off an earlier stage's tensor (the tracer keeps one
    # ``sym_size`` per symbol, on whichever tensor it met first: Phi's layer 1 reads the sequence length
    # off layer 0's attention output) -> (the stage's received activation, its dim)
    fwd_sizes_in: list[dict[torch.fx.Node, tuple[torch.fx.Node, int]]]
    # weights tied across stages: their gradient node -> stage -> the node of its backward that sums the
    # stage's own contributions (``pp_tied_weights.tied_gradients``)
    tied: dict[torch.fx.Node, dict[int, torch.fx.Node]] = dataclasses.field(default_factory=dict)


def _split(program: Program, pp: int) -> tuple[_Split, list[tuple[str, ...]]]:
    graph = program.graph
    prefix = find_layer_list(graph)
    layers = layer_names(graph, prefix) if prefix else []
    if pp > len(layers):
        raise OptionError(f"--parallel: pp={pp} stages but the model has {len(layers)} layers "
                          f"(at most one stage per layer)")
    ranges = stage_layer_ranges(len(layers), pp)
    stage_of_layer = {layers[i]: s for s, (lo, hi) in enumerate(ranges) for i in range(lo, hi)}
    last = pp - 1

    def layer_stage(node: torch.fx.Node) -> Optional[int]:
        layer = owning_layer(module_path(node), stage_of_layer)
        return None if layer is None else stage_of_layer[layer]

    calls = [n for n in graph.nodes if n.op == "call_function"]
    first_bwd = next(i for i, n in enumerate(calls) if program.phase_of(n) == PHASE_BACKWARD)
    fwd_nodes = [n for n in calls[:first_bwd] if program.phase_of(n) == PHASE_FORWARD]
    # activation checkpointing's recomputation runs inside the backward of its layer (its stage)
    bwd_nodes = [n for n in calls if program.phase_of(n) in (PHASE_BACKWARD, PHASE_RECOMPUTE)]
    owner: dict[torch.fx.Node, int] = {}
    pre: list[torch.fx.Node] = []  # root ops before the first layer op
    seen_layer = False
    for n in fwd_nodes:
        s = layer_stage(n)
        if s is not None:
            seen_layer = True
            owner[n] = s
        elif not seen_layer:
            pre.append(n)
            owner[n] = 0
        else:
            owner[n] = last
    output = _model_output(fwd_nodes)
    fwd: list[list[torch.fx.Node]] = [[] for _ in range(pp)]
    for n in fwd_nodes:
        fwd[owner[n]].append(n)
    pre_set = set(pre)
    # parameter-free root ops before the layers run again on every later stage that reads them
    for s in range(1, pp):
        members = set(fwd[s])
        extra: set[torch.fx.Node] = set()
        stack = [a for n in fwd[s] for a in n.all_input_nodes if a in pre_set]
        while stack:
            a = stack.pop()
            if a in extra:
                continue
            extra.add(a)
            stack += [b for b in a.all_input_nodes if b in pre_set]
        extra -= {a for a in extra if _reads_param(program, a)}
        fwd[s] = [n for n in fwd_nodes if n in extra or n in members]
    # sizes (SymInt ops such as ``sym_size(idx, 0)``) are read off the stage's own inputs: copied
    for s in range(pp):
        fwd[s] = _with_sizes_read_by(fwd[s], fwd[s], fwd_nodes)
    act_in: list[Optional[torch.fx.Node]] = [None] * pp
    fwd_sizes_in: list[dict[torch.fx.Node, tuple[torch.fx.Node, int]]] = [{} for _ in range(pp)]
    for s in range(1, pp):
        members = set(fwd[s])
        crossing = {a for n in fwd[s] for a in n.all_input_nodes
                    if a.op == "call_function" and a not in members}
        if len(crossing) > 1:
            crossing = _resource_sizes(crossing, fwd[s], fwd_sizes_in[s], s)
        if len(crossing) != 1:
            raise OptionError(f"pipeline stage {s}: {len(crossing)} tensors cross into it from earlier stages "
                              f"({', '.join(sorted(a.name for a in crossing)[:4])}); one (the residual stream) "
                              "is modelled")
        (act_in[s],) = crossing
        if act_in[s] not in set(fwd[s - 1]):
            raise OptionError(f"pipeline stage {s}: its input {act_in[s].name} is not stage {s - 1}'s output")
    shared = shared_weights(program, graph, fwd)
    # backward: a layer's ops to its stage; the head's and norm's before any layer's to the last stage,
    # the embedding's after them to the first; ops of no module to the stage of the op before them
    bwd: list[list[torch.fx.Node]] = [[] for _ in range(pp)]
    current, seen_layer = last, False
    for n in bwd_nodes:
        s = layer_stage(n)
        if s is not None:
            seen_layer = True
            current = s
        elif module_path(n):
            current = 0 if seen_layer else last
        bwd[current].append(n)
    tied = tied_gradients(program, shared, bwd)
    summed = {program.grad_nodes[g.name] for g in tied}
    for p, stages in shared.items():
        fqn = program.param_names.get(p.name, p.name)
        if fqn not in summed:   # one reader has a gradient, or none: the others' copies would step without one
            raise OptionError(f"pipeline parallelism: parameter {fqn} is read by stages "
                              f"{', '.join(map(str, stages))} but its gradient does not come from each of them "
                              "(a tie whose gradient one stage makes is not modelled)")
    grad_in: list[Optional[torch.fx.Node]] = [None] * pp
    sizes_in: list[dict[torch.fx.Node, tuple[torch.fx.Node, int]]] = [{} for _ in range(pp)]
    for s in range(pp):
        # a backward size read off another stage's forward tensor is read off one of this stage's
        here = set(fwd[s]) | {act_in[s]}
        bwd[s] = [n for n in bwd[s] if not (_is_size(n) and any(
            a.op == "call_function" and program.phase_of(a) == PHASE_FORWARD and a not in here
            for a in n.all_input_nodes))]
    for s in range(pp):
        members = set(bwd[s])
        crossing = {a for n in bwd[s] for a in n.all_input_nodes
                    if a.op == "call_function" and program.phase_of(a) == PHASE_BACKWARD and a not in members}
        sizes = {a for a in crossing if _is_size(a)}
        crossing -= sizes
        if s < pp - 1:
            if len(crossing) != 1:
                raise OptionError(f"pipeline stage {s}: {len(crossing)} gradients cross into its backward "
                                  f"({', '.join(sorted(a.name for a in crossing)[:4])}); one is modelled")
            (grad_in[s],) = crossing
        own = ([grad_in[s]] if grad_in[s] is not None else []) + ([act_in[s]] if act_in[s] is not None else [])
        for a in sorted(sizes, key=lambda a: a.name):
            sizes_in[s][a] = _size_source(a, own + fwd[s], s)
    for s in range(pp):
        # sizes the backward (checkpointing's recomputation) reads but the stage's forward does not
        fwd[s] = _with_sizes_read_by(fwd[s], bwd[s], fwd_nodes, exclude=set(fwd_sizes_in[s]))
        fwd_set = set(fwd[s]) | set(fwd_sizes_in[s]) | ({act_in[s]} if act_in[s] is not None else set())
        for n in bwd[s]:
            for a in n.all_input_nodes:
                if a.op == "call_function" and program.phase_of(a) == PHASE_FORWARD and a not in fwd_set:
                    raise OptionError(f"pipeline stage {s}: backward op {n.name} reads {a.name}, a forward "
                                      "tensor of another stage")
    params: list[list[torch.fx.Node]] = []
    owner_of_param: dict[torch.fx.Node, int] = {}
    for s in range(pp):
        used = [p for p in graph.nodes if p.op == "placeholder" and program.input_roles.get(p.name) == ROLE_PARAM
                and any(u in set(fwd[s]) | set(bwd[s]) for u in p.users)]
        for p in used:
            if p in owner_of_param and p not in shared:
                raise OptionError(f"pipeline parallelism: parameter {program.param_names.get(p.name, p.name)} is "
                                  f"used by the backwards of stages {owner_of_param[p]} and {s} (a weight shared "
                                  "across stages is modelled where the forwards of the stages read it)")
            owner_of_param[p] = s
        params.append(used)
    names = [tuple(layers[lo:hi]) for lo, hi in ranges]
    return _Split(fwd, bwd, act_in, grad_in, output, params, sizes_in, fwd_sizes_in, tied), names


def _resource_sizes(crossing: set[torch.fx.Node], stage: list[torch.fx.Node],
                    sizes: dict[torch.fx.Node, tuple[torch.fx.Node, int]], s: int) -> set[torch.fx.Node]:
    """The crossing tensors less those the stage only reads sizes of, when one tensor (the residual
    stream) is left: each such ``sym_size`` is moved out of ``stage`` into ``sizes``, to be read off
    that tensor (a length the activation has too). Otherwise ``crossing`` unchanged, for the refusal."""
    members = set(stage)
    size_only = {a for a in crossing if all(u.target is aten.sym_size.int for u in a.users if u in members)}
    rest = crossing - size_only
    if len(rest) != 1 or not size_only:
        return crossing
    (act,) = rest
    readers = [u for a in size_only for u in a.users if u in members]
    found: dict[torch.fx.Node, tuple[torch.fx.Node, int]] = {}
    for u in readers:
        try:
            found[u] = _size_source(u, [act], s)
        except OptionError:
            return crossing
    sizes.update(found)
    stage[:] = [n for n in stage if n not in found]
    return rest


def _size_source(size: torch.fx.Node, tensors: Sequence[torch.fx.Node], s: int) -> tuple[torch.fx.Node, int]:
    """A tensor of stage ``s`` and the dim of it whose length is ``size``'s value (a backward size the
    graph computed on another stage's tensor, as sequence parallelism's gathered gradient's
    ``sym_size``), for the stage to read it off its own."""
    want = size.meta.get("val")
    for t in tensors:
        val = t.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, dim in enumerate(val.shape):
            if to_sympy(dim) == to_sympy(want):
                return t, d
    raise OptionError(f"pipeline stage {s}: its backward reads the size {size.name} ({want}) of another stage's "
                      "tensor, and no tensor of the stage has that length")


def _model_output(fwd_nodes: Sequence[torch.fx.Node]) -> torch.fx.Node:
    """The model's output (the last stage's output chunk): the tensor of the export's forward that the
    loss reads. The loss's ops (a mean; cross-entropy's flatten, log-softmax and nll_loss) are traced
    after the model and carry no ``from_node`` of the export: the graph's forward ends with them."""
    start = len(fwd_nodes)
    while start > 0 and "from_node" not in fwd_nodes[start - 1].meta:
        start -= 1
    if start == len(fwd_nodes):  # no loss op of its own: the scalar output is the loss
        start -= 1
    loss_ops = set(fwd_nodes[start:])
    # a size the loss reads may come off any tensor of that length (the trace picks one): not the output
    read = {a for n in loss_ops if not _is_size(n) for a in n.all_input_nodes
            if a.op == "call_function" and a not in loss_ops and isinstance(a.meta.get("val"), torch.Tensor)}
    if len(read) != 1:
        raise OptionError(f"pipeline parallelism: the loss reads {len(read)} tensors of the model "
                          f"({', '.join(sorted(a.name for a in read)[:4])}); one (the last stage's output) is modelled")
    return next(iter(read))


def _with_sizes_read_by(stage_fwd: list[torch.fx.Node], readers: Sequence[torch.fx.Node],
                        fwd_nodes: Sequence[torch.fx.Node], exclude: Collection[torch.fx.Node] = ()
                        ) -> list[torch.fx.Node]:
    """``stage_fwd`` plus the forward size computations (``sym_size``, their products) that ``readers``
    use and the stage does not compute yet, with what they read, in graph order."""
    members = set(stage_fwd)
    forward = set(fwd_nodes)
    extra: set[torch.fx.Node] = set()
    stack = [a for n in readers for a in n.all_input_nodes if a in forward and a not in members and _is_size(a)
             and a not in exclude]
    while stack:
        a = stack.pop()
        if a in extra or a in members or a.op != "call_function":
            continue
        extra.add(a)
        stack += list(a.all_input_nodes)
    if not extra:
        return stage_fwd
    return [n for n in fwd_nodes if n in members or n in extra]


def _reads_param(program: Program, node: torch.fx.Node) -> bool:
    return any(a.op == "placeholder" and program.input_roles.get(a.name) == ROLE_PARAM for a in node.all_input_nodes)


def _is_size(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and not isinstance(node.meta.get("val"), torch.Tensor) and not isinstance(
        node.meta.get("val"), (list, tuple))


# -- the optimizer of one stage's parameters ------------------------------------------------------
def _optimizer_plan(program: Program, keep: Sequence[int], params: Sequence[torch.fx.Node]
                    ) -> tuple[list[torch.fx.Node], dict[torch.fx.Node, object]]:
    """The optimizer nodes one stage runs and, for each, its arguments with every per-parameter list
    (``_foreach_*``'s tensor and scalar lists, ``n_params`` long) cut to the stage's indices ``keep``."""
    opt = [n for n in program.graph.nodes if n.op == "call_function" and program.phase_of(n) == PHASE_OPTIMIZER]
    keep_set = set(keep)
    n_params = len(params)
    own = tuple("_" + params[i].name for i in keep)

    def cut(value: object) -> object:
        if isinstance(value, (list, tuple)) and len(value) == n_params:
            return type(value)(value[i] for i in keep)
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v) for v in value)
        return value

    args: dict[torch.fx.Node, object] = {}
    for n in opt:
        if n.target is _getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0] in args:
            idx = n.args[1]
            if idx not in keep_set:
                continue
            args[n] = ((n.args[0], keep.index(idx)), {})
            continue
        args[n] = (cut(tuple(n.args)), cut(dict(n.kwargs)))
    def root(n: torch.fx.Node) -> bool:
        """The in-place updates, and unused reads (AdamW's ``step.item()``) of this stage's own state."""
        if n not in args or n.users:
            return False
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            return True
        inputs = [a for a in n.all_input_nodes if a.op == "placeholder"]
        return bool(inputs) and all(a.name.endswith(own) for a in inputs)

    # needed: the roots and what they read
    needed: set[torch.fx.Node] = set()
    stack = [n for n in opt if root(n)]
    while stack:
        n = stack.pop()
        if n in needed or n not in args:
            continue
        needed.add(n)
        a, k = args[n]
        torch.fx.node.map_arg((a, k), lambda x: stack.append(x) if x.op == "call_function" else None)
    return [n for n in opt if n in needed], args




# -- how long a sent tensor stays referenced -------------------------------------------------------
END = -1  # to the end of the schedule's step (its local lists die when it returns)


def send_releases(schedule: str, order: Sequence[tuple[str, int]], stage: int, pp: int, m: int
                  ) -> dict[tuple[str, int], int]:
    """For the tensor each action sends (``("F", i)``: the stage's output of micro-batch i; ``("B", i)``:
    its input's gradient), the index in ``order`` of the action after which the schedule's last
    reference to it (a ``P2POp`` list or a ``Work`` list in a local variable) is dropped, or END.

    ``ScheduleGPipe`` keeps every send's work in ``fwd_sends_to_wait`` / ``bwd_sends_to_wait`` until it
    returns. ``Schedule1F1B`` keeps them in ``send_work``, ``fwd_sends`` and ``bwd_sends``, each
    reassigned at fixed points of its warm-up, 1B1F and cool-down loops (torch 2.13,
    ``Schedule1F1B._step_microbatches``); this replays those assignments."""
    sends_fwd, sends_bwd = stage < pp - 1, stage > 0
    if schedule == "gpipe":
        return {(k, i): END for k, i in order if (k == FORWARD and sends_fwd) or (k == BACKWARD and sends_bwd)}
    held: dict[str, set] = {"send_work": set(), "fwd_sends": set(), "bwd_sends": set()}
    release: dict[tuple[str, int], int] = {}
    position = {a: j for j, a in enumerate(order)}
    done = -1

    def assign(var: str, value: set) -> None:
        old = held[var]
        held[var] = value
        for t in old:
            if not any(t in v for v in held.values()):
                release[t] = done

    def sent(kind: str, i: int) -> set:
        return {(kind, i)} if (kind == FORWARD and sends_fwd) or (kind == BACKWARD and sends_bwd) else set()

    warmup = min(m, pp - stage)
    f = b = 0
    for _ in range(warmup):
        done = position[(FORWARD, f)]
        assign("fwd_sends", sent(FORWARD, f))
        if f != warmup - 1:
            assign("send_work", sent(FORWARD, f))
        f += 1
    while True:
        done = position[(BACKWARD, b)]
        assign("bwd_sends", sent(BACKWARD, b))
        b += 1
        if f == m:
            break
        done = position[(FORWARD, f)]
        assign("fwd_sends", sent(FORWARD, f))
        f += 1
    assign("send_work", set(held["bwd_sends"]))
    while b < m:
        done = position[(BACKWARD, b)]
        assign("bwd_sends", sent(BACKWARD, b))
        assign("send_work", set(held["bwd_sends"]))
        b += 1
    for var in held.values():
        for t in var:
            release[t] = END
    return release


# -- building one stage's program -----------------------------------------------------------------
def stage_programs(program: Program, cfg: ParallelConfig, copies: Optional[int] = None) -> list[StageProgram]:
    """Every stage's training program (see the module docstring); ``copies``: that many micro-batches in
    place of ``cfg.num_microbatches`` (a template, ``pipeline_compose.py``)."""
    if not program.options.train:
        raise OptionError("--parallel pp needs --train (pipeline stages split a training step)")
    reason = cfg.not_modelled()
    if reason:
        raise OptionError(reason)
    v = cfg.stages_per_rank
    split, names = _split(program, cfg.pp * v)
    if split.tied and cfg.tp > 1 and cfg.vocab_parallel:
        fqns = sorted(program.grad_nodes[g.name] for g in split.tied)
        raise OptionError(f"pipeline parallelism: {', '.join(fqns)} is tied across stages and the TP plan splits the "
                          "vocabulary (torch's DTensor leaves the embedding's gradient replicated and the head's "
                          "sharded, so their sum needs a redistribution this does not model): give --tp-plan "
                          "default, or export the model untied")
    m = copies or cfg.num_microbatches
    interleaved = cfg.pp_schedule == "interleaved_1f1b"
    orders = stage_orders("interleaved" if interleaved else cfg.pp_schedule, cfg.pp, m, v)
    releases = "runtime" if interleaved else cfg.pp_schedule
    out = []
    for s in range(cfg.pp):
        chunks = [c * cfg.pp + s for c in range(v)]   # ScheduleInterleaved1F1B: rank s holds s, s + pp, ...
        order = [(p.kind, p.microbatch, p.virtual_stage) for p in orders[s]]
        layers = tuple(layer for k in chunks for layer in names[k])
        out.append(StageProgram(s, layers, _stage_program(program, split, s, cfg.pp, chunks, m, order, releases),
                                tuple(names[k] for k in chunks) if v > 1 else ()))
    return out


def _stage_program(program: Program, split: _Split, s: int, pp: int, chunks: Sequence[int], m: int,
                   order: Sequence[tuple[str, int, int]], releases: str) -> Program:
    """Rank ``s``'s program: its ``chunks`` (virtual stages; one unless interleaved) replayed in
    ``order`` ((kind, micro-batch, virtual stage) actions); ``releases``: whose rules keep sent tensors
    (``send_releases``: "gpipe", "1f1b", or "runtime", interleaved's, which waits on every send at
    the end of the step)."""
    ops = p2p_ops()
    last = len(split.fwd) - 1   # the last virtual stage
    src = program.graph
    graph = torch.fx.Graph()
    phases: dict[str, str] = {}
    roles: dict[str, str] = {}
    extra_uses: dict[str, list[str]] = {}
    all_params = [p for p in src.nodes if p.op == "placeholder" and program.input_roles.get(p.name) == ROLE_PARAM]
    keep = sorted(all_params.index(p) for k in chunks for p in split.params[k])
    opt_nodes, opt_args = _optimizer_plan(program, keep, all_params)

    used: set[torch.fx.Node] = set()
    for k in chunks:
        for n in split.fwd[k] + split.bwd[k]:
            used.update(a for a in n.all_input_nodes if a.op == "placeholder")
    for n in opt_nodes:
        a, k = opt_args[n]
        torch.fx.node.map_arg((a, k), lambda x: used.add(x) if x.op == "placeholder" else None)
    static: dict[torch.fx.Node, torch.fx.Node] = {}
    for p in src.nodes:
        if p.op == "placeholder" and p in used:
            new = graph.placeholder(p.name)
            new.meta = dict(p.meta)
            static[p] = new
            roles[new.name] = program.input_roles.get(p.name, "input")

    for x in src.nodes:
        if x.op == "get_attr":
            new = graph.get_attr(x.target)
            new.meta = dict(x.meta)
            static[x] = new

    def buffers(kind: str, like: Optional[torch.fx.Node], k: int) -> list[torch.fx.Node]:
        out = []
        for i in range(m):
            b = graph.placeholder(f"pp_{kind}_buffer_{i}" if len(chunks) == 1 else f"pp_{kind}_buffer_s{k}_{i}")
            b.meta["val"] = like.meta["val"]
            b.meta[STORAGE_KEY] = ("pp_buffer", b.name)   # one storage each (they share the fake value)
            roles[b.name] = ROLE_COMM_BUFFER
            out.append(b)
        return out

    # each stage's receive buffers, one per micro-batch (PipelineStage's, kept from the first step)
    act_bufs = {k: buffers("recv_act", split.act_in[k], k) for k in chunks if k > 0}
    grad_bufs = {k: buffers("recv_grad", split.grad_in[k], k) for k in chunks if k < last}

    action: list[Optional[tuple[str, int, int]]] = [None]   # the action being copied (META_ACTION)

    def call(target: object, args: tuple, val: object, phase: str, like: torch.fx.Node) -> torch.fx.Node:
        node = graph.call_function(target, args)
        node.meta["val"] = val
        for key in ("nn_module_stack", "stack_trace"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        if action[0] is not None:
            node.meta[META_ACTION] = action[0]
        phases[node.name] = phase
        return node

    def read_sizes(sizes: Mapping[torch.fx.Node, tuple[torch.fx.Node, int]], env: dict[torch.fx.Node, torch.fx.Node],
                   phase: str, chunk: int) -> None:
        """Each size another stage's tensor gave the graph, read off this stage's own (``_Split.sizes_in``)."""
        for size, (t, d) in sizes.items():
            env[size] = call(aten.sym_size.int, (env[t], d), size.meta["val"], phase, size)
            env[size].meta[META_CHUNK] = chunk

    def copy(nodes: Sequence[torch.fx.Node], env: dict[torch.fx.Node, torch.fx.Node], seq_offset: int,
             chunk: int, accumulated: Optional[dict[torch.fx.Node, torch.fx.Node]] = None) -> None:
        """``nodes`` again with ``env``; a parameter's gradient becomes its ``.grad`` (the first
        micro-batch's) or is added into it in place right away (AccumulateGrad)."""
        for n in nodes:
            new = copy_node(graph, n, lambda a: env[a] if a in env else static[a])
            if seq_offset and "seq_nr" in new.meta:
                new.meta["seq_nr"] = new.meta["seq_nr"] + seq_offset
            new.meta[META_CHUNK] = chunk
            new.meta[META_ACTION] = action[0]
            phases[new.name] = program.phase_of(n)
            env[n] = new
            if accumulated is None or n not in grad_node_of:
                continue
            if n not in accumulated:
                accumulated[n] = ready[n] = new
            else:
                ready[n] = call(aten.add_.Tensor, (accumulated[n], new), accumulated[n].meta["val"],
                                PHASE_BACKWARD, n)
                ready[n].meta[META_CHUNK] = chunk

    by_name = {n.name: n for n in src.nodes}
    grad_node_of = {by_name[name]: fqn for name, fqn in program.grad_nodes.items() if name in by_name}
    # a tied weight's gradient on this rank: its own chunk's share of the sum (all-reduced after the pipeline)
    tied_share: dict[torch.fx.Node, torch.fx.Node] = {}   # the weight's gradient node -> this rank's share
    for grad, shares in split.tied.items():
        fqn = grad_node_of.pop(grad)
        here = [shares[k] for k in chunks if k in shares]
        if len(here) > 1:
            raise OptionError(f"pipeline parallelism: two chunks of rank {s} read the tied weight {fqn} (not modelled)")
        if here:
            grad_node_of[here[0]] = fqn
            tied_share[grad] = here[0]
    stage_bwd = {n for k in chunks for n in split.bwd[k]}
    accumulated: dict[torch.fx.Node, torch.fx.Node] = {}  # original grad node -> this stage's .grad
    ready: dict[torch.fx.Node, torch.fx.Node] = {}  # ... -> its last accumulation so far
    envs: dict[tuple[int, int], dict[torch.fx.Node, torch.fx.Node]] = {}
    kept: list[torch.fx.Node] = []  # alive to the step's end
    carried: list[torch.fx.Node] = []  # ... and into the next step
    out_chunks: list[torch.fx.Node] = []
    action_end: list[torch.fx.Node] = []
    sent_tensor: dict[tuple[str, int, int], torch.fx.Node] = {}
    backward_ends: dict[tuple[str, int, int], str] = {}
    for kind, i, k in order:
        action[0] = (kind, i, k)
        # the pipeline rank of the virtual stage before and after k (ranks hold k % pp)
        peer_prev, peer_next = (k - 1) % pp, (k + 1) % pp
        if kind == FORWARD:
            env: dict[torch.fx.Node, torch.fx.Node] = {}
            if k > 0:
                like = split.fwd[k][0]
                buf = act_bufs[k][i]
                env[split.act_in[k]] = call(ops.recv_.default, (buf, peer_prev, PP_GROUP), buf.meta["val"],
                                            PHASE_FORWARD, like)
                env[split.act_in[k]].meta[META_CHUNK] = k
                read_sizes(split.fwd_sizes_in[k], env, PHASE_FORWARD, k)
            copy(split.fwd[k], env, 0, k)
            envs[(k, i)] = env
            if k < last:
                out = env[split.act_in[k + 1]]
                sent_tensor[(kind, i, k)] = out
                action_end.append(call(ops.send.default, (out, peer_next, PP_GROUP), None, PHASE_FORWARD,
                                       split.act_in[k + 1]))
                action_end[-1].meta[META_CHUNK] = k
            else:
                action_end.append(list(graph.nodes)[-1])
                chunk = env[split.output]
                out_chunks.append(chunk)
                kept.append(env[split.fwd[k][-1]])  # the loss, in the schedule's list until the step ends
            continue
        env = envs.pop((k, i))
        if k < last:
            like = split.bwd[k][0]
            buf = grad_bufs[k][i]
            env[split.grad_in[k]] = call(ops.recv_.default, (buf, peer_next, PP_GROUP), buf.meta["val"],
                                         PHASE_BACKWARD, like)
            env[split.grad_in[k]].meta[META_CHUNK] = k
        read_sizes(split.sizes_in[k], env, PHASE_BACKWARD, k)
        copy(split.bwd[k], env, (i + 1) * _SEQ_STRIDE, k, accumulated)
        end = env[split.bwd[k][-1]]
        backward_ends[(kind, i, k)] = end.name
        if k < last:  # fwd_cache holds the stage's output until its backward is done
            extra_uses.setdefault(end.name, []).append(env[split.act_in[k + 1]].name)
        if k > 0:
            grad = env[split.grad_in[k - 1]]
            sent_tensor[(kind, i, k)] = grad  # stage_backward drops the input's .grad: the send holds it
            action_end.append(call(ops.send.default, (grad, peer_prev, PP_GROUP), None, PHASE_BACKWARD,
                                   split.grad_in[k - 1]))
            action_end[-1].meta[META_CHUNK] = k
        else:
            action_end.append(list(graph.nodes)[-1])
    action[0] = None
    missing = [grad_node_of[g] for g in grad_node_of if g in stage_bwd and g not in accumulated]
    if missing:
        raise OptionError(f"pipeline stage {s}: no gradient for {', '.join(missing[:3])}")
    # scale_grads: every .grad divided by the number of micro-batches, in place
    for orig, g in accumulated.items():
        call(aten.div_.Scalar, (g, m), g.meta["val"], PHASE_BACKWARD, orig)
    # the schedule's step ends here: its send lists go with _step_microbatches' frame, before the merge
    pipeline_end = list(graph.nodes)[-1]
    merge = None
    if last in chunks:
        cat_val = torch.cat([c.meta["val"] for c in out_chunks], dim=0)
        merge = call(aten.cat.default, (out_chunks, 0), cat_val, PHASE_BACKWARD, split.output).name  # _merge_outputs
        kept += out_chunks
        carried += out_chunks
    if releases == "runtime":  # _PipelineScheduleRuntime waits on its send_ops when the step ends
        held = {key: END for key in sent_tensor}
    else:
        held = {(kind, i, s): at for (kind, i), at in
                send_releases(releases, [(kind, i) for kind, i, _ in order], s, pp, m).items()}
    for key, at in held.items():
        anchor = pipeline_end if at == END else action_end[at]
        extra_uses.setdefault(anchor.name, []).append(sent_tensor[key].name)
    # AdamW on the stage's parameters, its gradients the accumulated .grad
    opt_env: dict[torch.fx.Node, torch.fx.Node] = {orig: g for orig, g in accumulated.items()}
    # a tied weight's .grad summed over the stages that hold it, before the step (pp_tied_weights.py): it
    # reads the .grad as the optimizer does (FSDP's rewrite hands both the sharded gradient)
    for grad, share in tied_share.items():
        g = accumulated[share]
        reduced = call(c10d.all_reduce_.default, (g, "sum", PP_TIED_GROUP), g.meta["val"], PHASE_OPTIMIZER, share)
        opt_env[grad] = call(c10d.wait_tensor.default, (reduced,), g.meta["val"], PHASE_OPTIMIZER, share)
    for n in opt_nodes:
        a, k = opt_args[n]
        a, k = torch.fx.node.map_arg((a, k), lambda x: opt_env[x] if x in opt_env else static[x])
        new = graph.call_function(n.target, a, k)
        new.meta = dict(n.meta)
        val = n.meta.get("val")
        if n.target is not _getitem and isinstance(val, (list, tuple)) and len(val) == len(all_params):
            new.meta["val"] = type(val)(val[j] for j in keep)
        phases[new.name] = PHASE_OPTIMIZER
        opt_env[n] = new
    graph.output(tuple(dict.fromkeys(kept)))
    grad_nodes = {accumulated[orig].name: fqn for orig, fqn in grad_node_of.items() if orig in accumulated}
    param_names = {static[p].name: program.param_names.get(p.name, p.name) for k in chunks for p in split.params[k]}
    for p in static:
        if program.input_roles.get(p.name) != ROLE_PARAM and p.name in program.param_names:
            param_names[static[p].name] = program.param_names[p.name]
    graph.lint()
    out = program.rewritten(graph, phases=phases, input_roles=roles, grad_nodes=grad_nodes,
                            param_names=param_names)
    out.gm.meta[META_RUNTIME_USES] = {k: tuple(v) for k, v in extra_uses.items()}
    out.gm.meta[META_CARRIED] = tuple(n.name for n in dict.fromkeys(carried))
    out.gm.meta[META_GRAD_READY] = {ready[orig].name: fqn for orig, fqn in grad_node_of.items() if orig in ready}
    out.gm.meta[META_LAYOUT] = StageLayout(
        s, pp, m, tuple(order), {a: n.name for a, n in zip(order, action_end)},
        {t.name: key for key, t in sent_tensor.items()}, backward_ends,
        tuple(tuple(b.name for b in bufs) for group in (act_bufs, grad_bufs) for bufs in group.values()),
        merge, releases, pipeline_end.name)
    return out


def carried_bytes(program: Program, ev: object) -> int:
    """Bytes of the tensors a stage keeps from one step into the next (``META_CARRIED``) at ``ev``."""
    from boomfx.passes.liveness import _compute_nbytes

    names = set(program.gm.meta.get(META_CARRIED, ()))
    return sum(int(ev(_compute_nbytes(n.meta["val"]))) for n in program.graph.nodes if n.name in names)
