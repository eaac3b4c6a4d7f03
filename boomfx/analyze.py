"""The driver: capture -> passes -> pricing -> scheduler + allocator replay -> Report.

``Analysis`` runs the symbolic passes once; ``Analysis.evaluate(bindings)`` prices and simulates one
point, so sweeps and max-batch searches never re-trace.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import sympy
import torch

from boomfx.alloc_config import AllocatorConfig
from boomfx.capture import capture, resolve_bindings
from boomfx.devices import DeviceSpec, get_device
from boomfx.errors import OptionError
from boomfx.kernels_db.blocks_db import SOURCE_BLOCK_MEASURED, apply_block_measurements  # block mode
from boomfx.memory_outside import OutsideMemory
from boomfx.memory_replay import AllocEvent, ReplayResult, replay
from boomfx.modules import layer_of, module_path
from boomfx.passes.blocks import block_pass, block_reports, representatives
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.kernels import kernel_pass
from boomfx.passes.liveness import LivenessInfo, liveness_pass
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.opcall import bind_call
from boomfx.passes.shapes import cost_pass
from boomfx.pricing import host_costs, make_pricer
from boomfx.program import (PHASE_BACKWARD, PHASE_OPTIMIZER, ROLE_BUFFER, ROLE_INPUT, ROLE_PARAM, Program,
                            ProgramOptions)
from boomfx.report import (
    AllocatorReport, GroupTime, KernelReport, MemoryReport, Report, SymbolReport, TimeReport,
)
from boomfx.host_time import with_cold_starts, with_graph_entries
from boomfx.simulate import ScheduledKernel, Timeline, simulate
from boomfx.passes.compiled import CUDAGRAPH_POOL_STREAM, CUDAGRAPH_REPLAY_HOST_NS  # --cudagraphs

aten = torch.ops.aten
_UNBOUNDED_BYTES = 1 << 62
_HOST_SYNC_OPS = {aten._local_scalar_dense, aten.item, aten.nonzero, aten.masked_select, aten._unique2}


@dataclass(frozen=True)
class AnalyzeOptions:
    device: str = "a100-80gb"
    alloc_conf: str = ""
    outside_memory: str = ""
    db: Optional[str] = None
    from_db: Optional[str] = None


@dataclass
class PointResult:
    """One evaluated point with the artefacts renderers beyond the Report need."""

    report: Report
    timeline: Timeline
    replay: Optional[ReplayResult]
    events: list[AllocEvent] = field(default_factory=list)


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


class Analysis:
    """Symbolic analysis of one program for one device; evaluate it at any binding of its symbols."""

    def __init__(self, program: Program, device: DeviceSpec, options: AnalyzeOptions = AnalyzeOptions(),
                 log: Optional[Callable[[str], None]] = None, reuse_blocks: bool = True) -> None:
        self.program = program
        self.device = device
        self.options = options
        try:
            self.alloc_config = AllocatorConfig.parse(options.alloc_conf or "")
        except ValueError as exc:
            raise OptionError(f"--alloc-conf: {exc}") from None
        try:
            base = OutsideMemory.for_device(device.compute_capability[0] or None)
            self.outside = OutsideMemory.parse(options.outside_memory, base) if options.outside_memory else base
        except ValueError as exc:
            raise OptionError(f"--outside-memory: {exc}") from None
        self.am = AnalysisManager(program, device, reuse_blocks=reuse_blocks)
        self.kernels = self.am.get(kernel_pass)
        self.costs = self.am.get(cost_pass)
        base_liveness = _eager_autograd_liveness(program) if program.options.train else self.am.get(liveness_pass)
        self.liveness: LivenessInfo = _grads_held_to_step_end(base_liveness, program)
        self.blocks = self.am.get(block_pass)
        # depth-free pricing: each node of a repeated block's instance k is priced as its counterpart
        # in instance 0 (same op, same symbolic shapes: the block pass checks it), once per point
        self._reps = representatives(self.blocks) if reuse_blocks else {}
        self.pricer = make_pricer(device, options.db, options.from_db)
        self.symbol_map = program.gm.meta.get("boomfx.symbol_map", {})
        self._nodes = list(program.graph.nodes)
        self._price_cache: dict[Any, Any] = {}
        self._node_module = _module_paths(self._nodes)  # scale: one lookup per module-stack object
        # --cudagraphs (passes/compiled.py): host replay cost, and the graph's private memory pool
        self._cudagraphs = bool(getattr(program.options, "cudagraphs", False)) and device.kind == "cuda"
        # host time outside the prices (boomfx/host_time.py): read once, not per evaluated point
        self._host_costs = host_costs(self.pricer, device)
        self._graph_inputs = sum(1 for n in self._nodes if n.op == "placeholder"
                                 and program.input_roles.get(n.name) in (ROLE_PARAM, ROLE_BUFFER, ROLE_INPUT))

    # -- pricing -------------------------------------------------------------------------------
    def _price_node(self, name: str, ev: Evaluator) -> tuple[Any, tuple[float, int]]:
        nc = self.costs.by_node[name]
        call = self._bind(name, ev)
        key = (str(call.op), _freeze(dict(call.args)), _freeze(call.outputs), _freeze(dict(call.context)))
        hit = self._price_cache.get(key)
        if hit is None:
            cost = nc.priced.cost
            flops = ev.number(cost.flops)
            moved = ev(cost.bytes_read) + ev(cost.bytes_written)
            from boomfx.passes.costs.registry import Cost
            price = self.pricer.price(call, Cost(flops, ev(cost.bytes_read), ev(cost.bytes_written)))
            hit = (price, (flops, moved))
            self._price_cache[key] = hit
        return hit

    def _bind(self, name: str, ev: Evaluator) -> Any:
        """The node's call at ``ev``'s sizes (the evaluator also fixes data-dependent scalars)."""
        return bind_call(self.costs.by_node[name].call, ev)

    def evaluator(self, bindings: Mapping[sympy.Symbol, int]) -> Evaluator:
        # AdamW's bias corrections depend on the unbacked step count; any steady-state step prices the same
        return Evaluator(bindings, self.symbol_map, data_dependent_value=DATA_DEPENDENT_SCALAR_VALUE)

    def kernel_calls(self, bindings: Mapping[sympy.Symbol, int]) -> list[Any]:
        """The bound OpCall of every kernel the step launches, each unique block priced once: exactly
        what model-guided collection must measure."""
        ev = self.evaluator(bindings)
        names = []
        for node in self._nodes:
            if node.name in self.costs.by_node:
                rep = self._reps.get(node.name, node.name)
                if rep not in names:
                    names.append(rep)
        return [self._bind(name, ev) for name in names]

    # -- one point -----------------------------------------------------------------------------
    def evaluate(self, bindings: Mapping[sympy.Symbol, int], record_trace: bool = False,
                 memory_only: bool = False) -> PointResult:
        ev = self.evaluator(bindings)
        kernels: list[KernelReport] = []
        scheduled: list[ScheduledKernel] = []
        workspace_at: dict[int, int] = {}
        point_prices: dict[str, Any] = {}
        if not memory_only:
            for step, node in enumerate(self._nodes):
                if node.name not in self.costs.by_node:
                    continue
                rep = self._reps.get(node.name, node.name)
                hit = point_prices.get(rep)
                if hit is None:
                    hit = point_prices[rep] = self._price_node(rep, ev)
                price, (flops, moved) = hit
                nc = self.costs.by_node[node.name]
                sync = node.target.overloadpacket in _HOST_SYNC_OPS
                device_ns = price.time_ns
                if self.device.kind == "cpu" and not getattr(price, "host_in_time", False):
                    device_ns += price.host_ns      # the CPU issues and runs each op on one thread
                host_ns = price.host_ns
                if self._cudagraphs:  # --cudagraphs: one graph replay issues every kernel (passes/compiled.py)
                    host_ns = 0.0 if scheduled else CUDAGRAPH_REPLAY_HOST_NS
                scheduled.append(ScheduledKernel(node.name, host_ns, device_ns, 0, sync))
                workspace_at[step] = int(price.workspace_bytes or 0)
                kernels.append(KernelReport(
                    node=node.name, op=str(nc.call.op), module=self._node_module[node.name],
                    phase=self.program.phase_of(node), flops=flops, bytes_moved=moved, time_ns=price.time_ns,
                    host_ns=price.host_ns, start_ns=0.0, source=_source_name(price.source), modelled=nc.priced.modelled,
                    workspace_bytes=int(price.workspace_bytes or 0), block=self.blocks.instance_of(node.name)))
        # host time outside the prices (boomfx/host_time.py): a CPU's cold starts, compiled graphs' entries
        costs = self._host_costs
        added = [0.0] * len(scheduled)
        if self.device.kind == "cpu":
            scheduled, added = with_cold_starts(kernels, scheduled, costs, bool(self.program.options.compile))
        # block mode: instances of blocks measured whole take the measured time (kernels_db/blocks_db.py)
        kernels, scheduled = apply_block_measurements(self, bindings, kernels, scheduled)
        cold_ns = sum(a for a, k in zip(added, kernels) if k.source != SOURCE_BLOCK_MEASURED)
        entries: set[int] = set()
        if self.program.options.compile:
            scheduled, entries = with_graph_entries(kernels, scheduled, costs, bool(self.program.options.train),
                                                    self._graph_inputs, self.device.kind == "cpu")
        timeline = simulate(scheduled, synchronous=self.device.kind == "cpu")
        spans = [s for i, s in enumerate(timeline.spans) if i not in entries]
        for k, span in zip(kernels, spans):
            k.start_ns = span.start_ns
        memory, rep, events = self._memory(ev, workspace_at, record_trace, exact_total=not memory_only)
        report = self._report(bindings, kernels, timeline, memory)
        report.time.graph_entry_ns = sum(scheduled[i].host_ns + scheduled[i].device_ns for i in entries)
        report.time.cold_start_ns = cold_ns
        report.time.host_costs_source = costs.source if (entries or cold_ns) else ""
        report.warnings.extend(self.program.warnings)
        report.blocks = block_reports(self.blocks, kernels, self.liveness, ev)
        return PointResult(report, timeline, rep, events)

    # -- memory --------------------------------------------------------------------------------
    def _events(self, ev: Evaluator, workspace_at: Mapping[int, int]) -> list[AllocEvent]:
        events: list[AllocEvent] = []
        for iv in self.liveness.intervals:
            if iv.resident:
                events.append(AllocEvent("alloc", iv.storage_id, ev(iv.nbytes), 0, iv.node,
                                         ((self._node_module.get(iv.node, ""), 0, iv.node),)))
        next_id = len(self.liveness.intervals)
        for label, size in self.outside.allocator_sizes():
            events.append(AllocEvent("alloc", next_id, size, 0, label, (("", 0, label),)))
            next_id += 1
        last_step = -1
        for step, kind, iv in self.liveness.events():
            if step != last_step:
                last_step = step
            frames = ((self._node_module.get(iv.node, ""), 0, iv.node),)
            pool = CUDAGRAPH_POOL_STREAM if self._cudagraphs else 0   # --cudagraphs: private pool
            if kind == "alloc":
                events.append(AllocEvent("alloc", iv.storage_id, ev(iv.nbytes), pool, iv.node, frames))
                ws = workspace_at.get(step, 0)
                if ws and iv.node == self.liveness.order[step]:
                    events.append(AllocEvent("alloc", next_id, ws, 0, iv.node + ":workspace", frames))
                    events.append(AllocEvent("free", next_id, ws, 0, iv.node + ":workspace", frames))
                    next_id += 1
            else:
                events.append(AllocEvent("free", iv.storage_id, ev(iv.nbytes), pool, iv.node, frames))
        return events

    def _memory(self, ev: Evaluator, workspace_at: Mapping[int, int], record_trace: bool,
                exact_total: bool = True) -> tuple[MemoryReport, Optional[ReplayResult], list[AllocEvent]]:
        timeline = self.liveness.timeline(ev)
        combined = [live + workspace_at.get(i, 0) for i, live in enumerate(timeline)]
        peak_step = max(range(len(combined)), key=combined.__getitem__) if combined else 0
        point = self.liveness.peak(ev)
        capacity = self.device.memory_bytes
        outside = {item.name: item.nbytes for item in self.outside.items()} if self.device.kind == "cuda" else {}
        rep: Optional[ReplayResult] = None
        events: list[AllocEvent] = []
        oom_node = oom_module = None
        allocator = None
        if self.device.kind == "cuda":
            events = self._events(ev, workspace_at)
            rep = replay(events, self.alloc_config, capacity - self.outside.total_bytes, record_trace=record_trace)
            allocator = AllocatorReport(
                rep.peak_allocated_bytes, rep.peak_reserved_bytes, rep.peak_active_bytes,
                rep.fragmentation_at_peak_bytes, rep.largest_free_block_at_peak_bytes, rep.num_segments_at_peak,
                int(rep.stats.get("num_alloc_retries", 0)), int(rep.stats.get("num_ooms", 0)),
                self.options.alloc_conf or "(defaults)")
            if rep.oom is not None:
                label = rep.oom.label.split(":")[0]
                oom_node, oom_module = label, self._node_module.get(label, "")
            total = rep.peak_reserved_bytes + self.outside.total_bytes
            if rep.oom is not None and exact_total:
                # what the step would need: the same replay on a device too large to run out
                unbounded = replay(events, self.alloc_config, _UNBOUNDED_BYTES)
                total = unbounded.peak_reserved_bytes + self.outside.total_bytes
        else:
            total = combined[peak_step] if combined else 0
        fits = rep.oom is None if rep is not None else total <= capacity
        memory = MemoryReport(
            peak_live_bytes=combined[peak_step] if combined else 0,
            peak_step_node=self.liveness.order[peak_step] if combined else "",
            by_category_bytes={c.value: b for c, b in sorted(point.by_category.items(), key=lambda kv: -kv[1])},
            resident_bytes=self.liveness.resident_bytes(ev), workspace_bytes=workspace_at.get(peak_step, 0),
            allocator=allocator, outside_allocator_bytes=outside, device_capacity_bytes=capacity,
            total_device_bytes=total, fits=fits, margin_bytes=capacity - total,
            oom_node=oom_node, oom_module=oom_module)
        return memory, rep, events

    # -- report --------------------------------------------------------------------------------
    def _report(self, bindings: Mapping[sympy.Symbol, int], kernels: list[KernelReport], timeline: Timeline,
                memory: MemoryReport) -> Report:
        total = timeline.total_ns
        time_report = TimeReport(total, timeline.device_busy_ns, timeline.host_busy_ns, timeline.host_bound_fraction,
                                 len(kernels), sum(k.flops for k in kernels), sum(k.bytes_moved for k in kernels))
        busy = sum(k.time_ns for k in kernels) or 1.0
        symbols = [SymbolReport(i.name, i.role, i.min_value, i.max_value, bindings.get(i.symbol), list(i.names))
                   for i in self.program.symbols.values()]
        opts = self.program.options
        return Report(
            source=self.program.source, device=self.device.name, device_description=self.device.description,
            mode="train" if opts.train else "inference",
            options={"optimizer": opts.optimizer if opts.train else None, "amp": opts.amp,
                     "checkpoint": opts.checkpoint,
                     "checkpoint_layers": list(opts.checkpoint_layers), "alloc_conf": self.options.alloc_conf,
                     "resident_grads": opts.resident_grads,
                     "compile": opts.compile, "cudagraphs": opts.cudagraphs,
                     "db": self.options.db, "from_db": self.options.from_db},
            symbols=symbols, time=time_report, memory=memory,
            by_module=_group(kernels, _module_group, busy),
            by_op=_group(kernels, lambda k: k.op, busy),
            by_phase=_group(kernels, lambda k: k.phase, busy),
            by_source=_group(kernels, lambda k: k.source, busy),
            blocks=[], unmodelled_ops=self.costs.unmodelled_ops(), kernels=kernels)


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
       (MmBackward0 keeps its input until both of its mm's are done: the real step's peak).
    Measured against the profiler peak of real CPU steps (tests/test_cpu_memory_accuracy.py).

    Scale: the changed uses go to ``liveness_pass(uses=...)``; the graph is not copied (an 80-layer
    training graph's copy and its GraphModule cost seconds)."""
    uses: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] = {}

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
            extra = tuple(u for u in used if u is not last and u not in own)
            if extra:
                uses[last] = tuple(dict.fromkeys(own + extra))
    group: list[torch.fx.Node] = []
    phases = program.phases
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SIZE_QUERIES:     # a size query reads metadata: not a use of its tensor
            rest: dict[torch.fx.Node, None] = {}
            torch.fx.node.map_arg((tuple(node.args[1:]), node.kwargs), lambda a: rest.setdefault(a))
            uses[node] = tuple(rest)
        seq = node.meta.get("seq_nr") if phases.get(node.name) == PHASE_BACKWARD else None
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
    temporary that its AccumulateGrad ``add_`` frees (boomfx/training.py)."""
    if not program.options.train or not program.grad_nodes or program.options.resident_grads:
        return info
    from boomfx.passes.liveness import Category
    opt_steps = [i for i, name in enumerate(info.order) if program.phases.get(name) == PHASE_OPTIMIZER]
    if not opt_steps:
        return info
    end = opt_steps[-1]
    intervals = tuple(dataclasses.replace(iv, end_step=max(iv.end_step, end))
                      if iv.category == Category.GRAD and not iv.resident else iv for iv in info.intervals)
    return dataclasses.replace(info, intervals=intervals)


DATA_DEPENDENT_SCALAR_VALUE = 1  # value given to unbacked scalar symbols (the optimizer's step count)


def _module_group(k: KernelReport) -> str:
    """The layer a kernel belongs to; the optimizer step and loss have no module of their own."""
    if not k.module and k.phase == "optimizer":
        return "(optimizer step)"
    return layer_of(k.module)


def _module_paths(nodes: list) -> dict[str, str]:
    """``module_path`` of every node, computed once per ``nn_module_stack`` object (synthesised deep
    training graphs share one stack per module and layer: boomfx/training_expand.py)."""
    by_stack: dict[int, str] = {}
    out = {}
    for n in nodes:
        stack = n.meta.get("nn_module_stack")
        if stack is None:
            out[n.name] = module_path(n)
            continue
        path = by_stack.get(id(stack))
        if path is None:
            path = by_stack[id(stack)] = module_path(n)
        out[n.name] = path
    return out


def _source_name(source: Any) -> str:
    return str(getattr(source, "value", source))


def _group(kernels: list[KernelReport], key: Callable[[KernelReport], str], busy: float) -> list[GroupTime]:
    acc: dict[str, list[float]] = {}
    for k in kernels:
        slot = acc.setdefault(key(k), [0.0, 0])
        slot[0] += k.time_ns
        slot[1] += 1
    groups = [GroupTime(name, t, int(n), t / busy) for name, (t, n) in acc.items()]
    return sorted(groups, key=lambda g: -g.time_ns)


def analyze(source: Any, *example_inputs: Any, device: str | DeviceSpec = "a100-80gb", train: bool = False,
            optimizer: str = "adamw", amp: Optional[str] = None, checkpoint: bool = False,
            dims: Optional[Mapping[str, int]] = None, batch: Optional[int] = None, seq: Optional[int] = None,
            alloc_conf: str = "", outside_memory: str = "", db: Optional[str] = None, from_db: Optional[str] = None,
            dynamic_shapes: Any = None, log: Optional[Callable[[str], None]] = None, compile: bool = False,
            cudagraphs: bool = False, checkpoint_layers: tuple[str, ...] | list[str] | str = (),
            resident_grads: bool = False) -> Report:
    """Predict time and memory of one step of ``source`` on ``device``.

    ``compile=True`` predicts ``torch.compile`` (Inductor kernels, see ``passes/compiled.py``);
    ``cudagraphs=True`` its mode="reduce-overhead" (implies ``compile``).
    ``checkpoint_layers=["h.0", "h.2"]`` (with ``train``) checkpoints only those layer instances.
    ``resident_grads=True`` (with ``train``): every ``.grad`` stays allocated between steps
    (``zero_grad(set_to_none=False)``, gradient accumulation); the default frees them after each step.

    ``source`` is a .pt2 path, an ExportedProgram, an nn.Module (with ``example_inputs``) or a
    GraphModule. Symbolic dims are bound by name or role (``dims={"batch": 8}``) or ``batch``/``seq``.

    Example::

        >>> report = boomfx.analyze("gpt2.pt2", device="a100-80gb", train=True, batch=8, seq=1024)
        >>> report.time.total_ns, report.memory.fits
    """
    started = time.perf_counter()
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    program = capture(source, *example_inputs,
                      options=ProgramOptions(train, optimizer, amp, checkpoint, target_kind=spec.kind,
                                                     compile=compile or cudagraphs, cudagraphs=cudagraphs,
                                                     checkpoint_layers=checkpoint_layers,
                                                     resident_grads=resident_grads),
                      dynamic_shapes=dynamic_shapes, log=log)
    analysis = Analysis(program, spec, AnalyzeOptions(spec.name, alloc_conf, outside_memory, db, from_db), log)
    bindings = resolve_bindings(program, dims or {}, batch, seq)
    report = analysis.evaluate(bindings).report
    report.analysis_seconds = time.perf_counter() - started
    return report
