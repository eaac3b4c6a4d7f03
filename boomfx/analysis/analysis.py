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

from boomfx.memory.config import AllocatorConfig
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.core.devices import DeviceSpec, get_device
from boomfx.core.errors import OptionError
from boomfx.analysis.step_schedule import schedule_step
from boomfx.memory.outside import OutsideMemory
from boomfx.memory.replay import AllocEvent, ReplayResult
from boomfx.core.layers import module_path
from boomfx.passes.blocks import block_pass, representatives
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.fusion import generated_by_inductor
from boomfx.passes.kernels import kernel_pass
from boomfx.passes.liveness import LivenessInfo, step_liveness_pass
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.opcall import bind_call
from boomfx.passes.shapes import cost_pass
from boomfx.kernels_db.plausibility import SLOW_FACTOR, suspect_price_ratio, suspect_rows_warning
from boomfx.analysis.host_time import autograd_nodes, framework_ns, host_ops_before, native_loop_nodes
from boomfx.kernels_db.price import DATABASE_SOURCES, PriceSource
from boomfx.kernels_db.pricing import cpu_host_model, host_costs, make_pricer
from boomfx.core.program import (ROLE_BUFFER, ROLE_INPUT, ROLE_PARAM, Program,
                            ProgramOptions)
from boomfx.report.model import KernelReport, Report
from boomfx.analysis.build_report import block_reports, build_report
from boomfx.analysis.memory_events import heap_fault_pages, memory_report
from boomfx.simulate.timeline import ScheduledKernel, Timeline, simulate

aten = torch.ops.aten
# prices timed on the host with fresh outputs per call: they paid the faults of always-mapped allocations
_MEASURED_ALONE = frozenset(s.value for s in (*DATABASE_SOURCES, PriceSource.BLOCK_MEASURED))
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
        self.liveness: LivenessInfo = self.am.get(step_liveness_pass)   # passes/liveness.py owns every rule
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
        # host time outside the prices (boomfx/analysis/host_time.py): read once, not per evaluated point
        self._host_costs = host_costs(self.pricer, device)
        # a CPU target priced from this host's probe: its cache level follows each point's footprint
        self._cpu_model = cpu_host_model(self.pricer)
        compiled = bool(getattr(program.options, "compile", False))
        # eager CPU steps (boomfx/analysis/host_time.py): the aliasing ops dispatched before each kernel, and
        # in training the autograd graph the engine runs
        eager_cpu = device.kind == "cpu" and not compiled
        self._host_ops = host_ops_before(self._nodes, self.costs.by_node) if eager_cpu else {}
        self._native_loop = native_loop_nodes(self._nodes) if eager_cpu else set()
        train = bool(getattr(program.options, "train", False))
        self._autograd_nodes = autograd_nodes(program) if eager_cpu and train else 0
        # torch.distributed's frameworks in a rank program: FSDP2's hooks per unit, DTensor's per parallel linear
        self._framework_ns = framework_ns(self._nodes, self.costs.by_node, self._host_costs) if eager_cpu else {}
        # --compile: kernels Inductor generates hold no eager ATen scratch, whatever a database measured eagerly
        self._generated = ({n.name for n in self._nodes if generated_by_inductor(n) and not program.runs_eagerly(n)}
                           if compiled else set())
        self._graph_inputs = sum(1 for n in self._nodes if n.op == "placeholder"
                                 and program.input_roles.get(n.name) in (ROLE_PARAM, ROLE_BUFFER, ROLE_INPUT))

    # -- pricing -------------------------------------------------------------------------------
    def _price_node(self, name: str, ev: Evaluator) -> tuple[Any, tuple[float, int]]:
        nc = self.costs.by_node[name]
        call = self._bind(name, ev)
        in_loop = name in self._native_loop      # ATen's own loop: hot, as measured looped (cpu_model.py)
        key = (str(call.op), _freeze(dict(call.args)), _freeze(call.outputs), _freeze(dict(call.context)), in_loop)
        hit = self._price_cache.get(key)
        if hit is None:
            if self._cpu_model is not None:
                self._cpu_model.in_loop = in_loop
            cost = nc.priced.cost
            flops = ev.number(cost.flops)
            moved = ev(cost.bytes_read) + ev(cost.bytes_written)
            from boomfx.passes.costs.registry import Cost
            bound = Cost(flops, ev(cost.bytes_read), ev(cost.bytes_written))
            price = self.pricer.price(call, bound)
            hit = (price, (flops, moved), suspect_price_ratio(price, call, bound, self.device))
            self._price_cache[key] = hit
        return hit

    def _workspace(self, name: str, price: Any) -> int:
        """The scratch a kernel holds while it runs: its price's, none for a kernel Inductor generates."""
        return 0 if name in self._generated else int(price.workspace_bytes or 0)

    def price_node(self, name: str, ev: Evaluator) -> Any:
        """The KernelPrice of node ``name`` at ``ev``'s sizes (cached per distinct bound call)."""
        return self._price_node(name, ev)[0]

    def representative(self, name: str) -> str:
        """The node priced in ``name``'s place: its counterpart in the first instance of its block."""
        return self._reps.get(name, name)

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
        return [self._bind(name, ev) for name in self._kernel_names()]

    def kernel_operands(self) -> list[Any]:
        """The ``passes/operands.Operands`` of each of ``kernel_calls``' calls (same order): which program
        values each reads and writes, for the in-step rotation (``kernels_db/in_step.py``)."""
        from boomfx.passes.operands import StorageRoots, operands_of
        roots = StorageRoots()
        by_name = {node.name: node for node in self._nodes}
        return [operands_of(by_name[name], roots) for name in self._kernel_names()]

    def _kernel_names(self) -> list[str]:
        """Each priced node's representative, in program order, once."""
        names: dict[str, None] = {}
        for node in self._nodes:
            if node.name in self.costs.by_node:
                names.setdefault(self._reps.get(node.name, node.name))
        return list(names)

    def _charge_page_faults(self, ev: Evaluator, kernels: list[KernelReport], scheduled: list[ScheduledKernel],
                            kernel_steps: list[int], workspace_at: Mapping[int, int]) -> tuple[float, float]:
        """A CPU step priced from this host's probe: each kernel also pays the pages of the outputs and scratch
        glibc maps afresh for it at steady state (``memory_events.heap_fault_pages``), at the probe's cost of a
        fault; a price measured alone with fresh outputs paid those glibc maps at any threshold. Returns
        (the step's charged fault time, the estimated time of heap pages refaulted after trims: not charged)."""
        if self._cpu_model is None:
            return 0.0, 0.0
        pages = heap_fault_pages(self.liveness, ev, workspace_at)
        fault_ns = self._cpu_model.profile.page_fault_ns
        charged = regrown = 0.0
        for i, step in enumerate(kernel_steps):
            faults = pages.get(step)
            if faults is None:
                continue
            regrown += faults.regrown * fault_ns
            mapped = faults.mapped - (faults.always_mapped if kernels[i].source in _MEASURED_ALONE else 0)
            if mapped <= 0:
                continue
            ns = mapped * fault_ns
            kernels[i].time_ns += ns
            scheduled[i] = dataclasses.replace(scheduled[i], device_ns=scheduled[i].device_ns + ns)
            charged += ns
        return charged, regrown

    # -- one point -----------------------------------------------------------------------------
    def evaluate(self, bindings: Mapping[sympy.Symbol, int], record_trace: bool = False,
                 memory_only: bool = False, replay_allocator: bool = True,
                 exact_total: Optional[bool] = None) -> PointResult:
        """One point. ``memory_only``: no pricing or schedule (memory alone). ``replay_allocator=False``: no
        caching-allocator replay (time alone; the memory report is then the liveness peak, a lower bound
        of the replay's, and ``allocator`` is None): ``--search`` ranks plans by time before it replays.
        ``exact_total``: after an out-of-memory replay, replay again on an unbounded device for what the
        step would need (default: unless ``memory_only``; ``--search`` only asks whether a plan fits)."""
        ev = self.evaluator(bindings)
        kernels: list[KernelReport] = []
        scheduled: list[ScheduledKernel] = []
        workspace_at: dict[int, int] = {}
        point_prices: dict[str, Any] = {}
        suspects: dict[str, tuple[float, float, str]] = {}   # node -> (rooflines, time_ns, op) of implausible rows
        kernel_steps: list[int] = []                          # the step index of each of ``kernels``
        if self._cpu_model is not None:   # the cache level the step's kernels find their operands at
            self._cpu_model.footprint_bytes = max(self.liveness.timeline(ev), default=0)
        if memory_only:
            # no schedule, but each kernel's scratch (a measured workspace, a CPU convolution's blocked
            # copies) is memory all the same: a peak inside a kernel is a peak (--max-batch, --search)
            for step, node in enumerate(self._nodes):
                if node.name in self.costs.by_node:
                    rep = self._reps.get(node.name, node.name)
                    hit = point_prices.get(rep)
                    if hit is None:
                        hit = point_prices[rep] = self._price_node(rep, ev)
                    workspace_at[step] = self._workspace(node.name, hit[0])
        else:
            for step, node in enumerate(self._nodes):
                if node.name not in self.costs.by_node:
                    continue
                rep = self._reps.get(node.name, node.name)
                hit = point_prices.get(rep)
                if hit is None:
                    hit = point_prices[rep] = self._price_node(rep, ev)
                price, (flops, moved), slowness = hit
                if slowness is not None and slowness > SLOW_FACTOR:   # kernels_db/plausibility.py
                    suspects[node.name] = (slowness, price.time_ns, str(node.target))
                nc = self.costs.by_node[node.name]
                sync = node.target.overloadpacket in _HOST_SYNC_OPS
                device_ns = price.time_ns
                if self.device.kind == "cpu" and not getattr(price, "host_in_time", False):
                    device_ns += price.host_ns      # the CPU issues and runs each op on one thread
                scheduled.append(ScheduledKernel(node.name, price.host_ns, device_ns, 0, sync))
                kernel_steps.append(step)
                workspace_at[step] = self._workspace(node.name, price)
                kernels.append(KernelReport(
                    node=node.name, op=str(nc.call.op), module=self._node_module[node.name],
                    phase=self.program.phase_of(node), flops=flops, bytes_moved=moved, time_ns=price.time_ns,
                    host_ns=price.host_ns, start_ns=0.0, source=_source_name(price.source), modelled=nc.priced.modelled,
                    workspace_bytes=workspace_at[step], block=self.blocks.instance_of(node.name)))
        page_faults_ns, refault_ns = (self._charge_page_faults(ev, kernels, scheduled, kernel_steps, workspace_at)
                                      if kernels else (0.0, 0.0))
        # the schedule beyond the prices, in one place (boomfx/analysis/step_schedule.py)
        costs = self._host_costs
        opts = self.program.options
        step = schedule_step(kernels, scheduled, analysis=self, db=self.options.db, bindings=bindings, costs=costs,
                             cpu=self.device.kind == "cpu", compiled=bool(opts.compile), train=bool(opts.train),
                             cudagraphs=self._cudagraphs, graph_inputs=self._graph_inputs,
                             host_ops=[self._host_ops.get(k.node, 0) for k in kernels],
                             autograd_nodes=self._autograd_nodes,
                             framework_ns=[self._framework_ns.get(k.node, 0.0) for k in kernels],
                             native_loop=self._native_loop)
        kernels, scheduled, entries = step.kernels, step.scheduled, step.entries
        timeline = simulate(scheduled, synchronous=self.device.kind == "cpu")
        spans = [s for i, s in enumerate(timeline.spans) if i not in entries]
        for k, span in zip(kernels, spans):
            k.start_ns = span.start_ns
        memory, rep, events = memory_report(self.liveness, ev, workspace_at, self.device, self.outside,
                                            self.alloc_config, self.options.alloc_conf, self._node_module,
                                            self._cudagraphs, record_trace,
                                            exact_total=not memory_only if exact_total is None else exact_total,
                                            replay_allocator=replay_allocator)
        report = build_report(self.program, self.device, self.options, bindings, kernels, timeline, memory,
                              self.costs.unmodelled_ops())
        report.time.graph_entry_ns = step.graph_entry_ns
        report.time.cold_start_ns = step.cold_start_ns
        report.time.eager_dispatch_ns = step.eager_dispatch_ns
        report.time.page_faults_ns = page_faults_ns
        report.time.heap_refault_estimate_ns = refault_ns
        added = entries or step.cold_start_ns or step.eager_dispatch_ns
        report.time.host_costs_source = costs.source if added else ""
        report.warnings.extend(self.program.warnings)
        report.warnings.extend(getattr(self.pricer, "warnings", ()))   # e.g. no rows of this device in --db
        suspect = suspect_rows_warning(suspects, sum(k.time_ns for k in kernels), self.device)
        if suspect:
            report.warnings.append(suspect)
        report.blocks = block_reports(self.blocks, kernels, self.liveness, ev)
        return PointResult(report, timeline, rep, events)

DATA_DEPENDENT_SCALAR_VALUE = 1  # value given to unbacked scalar symbols (the optimizer's step count)


def _module_paths(nodes: list) -> dict[str, str]:
    """``module_path`` of every node, computed once per ``nn_module_stack`` object (synthesised deep
    training graphs share one stack per module and layer: boomfx/training/expand.py)."""
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


NOMINAL_CPU_WARNING = ("CPU target priced by the nominal roofline (db=None: a pure function of the graph and "
                       "the device, for regression baselines), typically several times off this host's step: "
                       "pass db='none' (this host's probe) or db='auto' (its database too), as `boomfx analyze "
                       "--device cpu` does")


def analyze(source: Any, *example_inputs: Any, device: str | DeviceSpec = "a100-80gb", train: bool = False,
            optimizer: str = "adamw", amp: Optional[str] = None, checkpoint: bool = False,
            dims: Optional[Mapping[str, int]] = None, batch: Optional[int] = None, seq: Optional[int] = None,
            alloc_conf: str = "", outside_memory: str = "", db: Optional[str] = None, from_db: Optional[str] = None,
            dynamic_shapes: Any = None, log: Optional[Callable[[str], None]] = None, compile: bool = False,
            cudagraphs: bool = False, checkpoint_layers: tuple[str, ...] | list[str] | str = (),
            resident_grads: bool = False, device_spec: Optional[str] = None, loss: str = "auto",
            foreach: Optional[bool] = None, python_locals: bool = True) -> Report:
    """Predict time and memory of one step of ``source`` on ``device``.

    ``compile=True`` predicts ``torch.compile`` (Inductor kernels, see ``passes/compiled.py``);
    ``cudagraphs=True`` its mode="reduce-overhead" (implies ``compile``).
    ``checkpoint_layers=["h.0", "h.2"]`` (with ``train``) checkpoints only those layer instances.
    ``resident_grads=True`` (with ``train``): every ``.grad`` stays allocated between steps
    (``zero_grad(set_to_none=False)``, gradient accumulation); the default frees them after each step.
    ``loss`` (with ``train``): ``"auto"`` (cross-entropy for a language model's logits, see
    ``training.trace.token_logits``), ``"cross_entropy"``, ``"mean"`` or ``"output"``.
    ``foreach`` (with ``train``): torch.optim's foreach implementation (True) or its per-parameter loop
    (False); None: torch.optim's default for the device's tensors (foreach on CUDA, the loop on a CPU).
    ``python_locals``: as the nn.Module runs eagerly (inference: tensors bound to the model's Python locals
    live until rebound or returned; inference and training: transformers' attention calls SDPA causal
    without the export's mask and repeated KV heads, ``passes/eager_sdpa.py``); False: as the export's
    graph runs (freed at last use, its own ops).
    ``device_spec="my_gpu.json"``: an unlisted device described in JSON (``boomfx/core/device_spec_file.py``);
    it replaces ``device``.

    ``source`` is a .pt2 path, an ExportedProgram, an nn.Module (with ``example_inputs``) or a
    GraphModule. Symbolic dims are bound by name or role (``dims={"batch": 8}``) or ``batch``/``seq``.
    ``db``: None prices a pure function of the graph and the device (regression baselines); on a CPU
    target that is the nominal roofline, several times off this host's times (``NOMINAL_CPU_WARNING``
    in ``report.warnings``): ``db="none"`` prices with this host's probe, ``db="auto"`` also with its
    collected database, as ``boomfx analyze`` does by default.

    Example::

        >>> report = boomfx.analyze("gpt2.pt2", device="a100-80gb", train=True, batch=8, seq=1024)
        >>> report.time.total_ns, report.memory.fits
    """
    started = time.perf_counter()
    if device_spec is not None:
        from boomfx.core.device_spec_file import load_device_spec
        spec = load_device_spec(device_spec)
    else:
        spec = device if isinstance(device, DeviceSpec) else get_device(device)
    program = capture(source, *example_inputs,
                      options=ProgramOptions(train, optimizer, amp, checkpoint, target_kind=spec.kind,
                                                     compile=compile or cudagraphs, cudagraphs=cudagraphs,
                                                     checkpoint_layers=checkpoint_layers,
                                                     resident_grads=resident_grads, loss=loss, foreach=foreach,
                                                     python_locals=python_locals),
                      dynamic_shapes=dynamic_shapes, log=log)
    analysis = Analysis(program, spec, AnalyzeOptions(spec.name, alloc_conf, outside_memory, db, from_db), log)
    bindings = resolve_bindings(program, dims or {}, batch, seq)
    report = analysis.evaluate(bindings).report
    if spec.kind == "cpu" and db is None:
        report.warnings.append(NOMINAL_CPU_WARNING)
    report.analysis_seconds = time.perf_counter() - started
    return report
