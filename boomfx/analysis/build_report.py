"""The Report of one evaluated point, assembled from what the analysis computed: the priced kernels, the
timeline, the memory summary, the per-class block figures, and the groupings by module, op, phase and
price source. Presentation (text, JSON, traces) is boomfx/report/; this module only builds the values."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import sympy

from boomfx.core.devices import DeviceSpec
from boomfx.core.layers import layer_of
from boomfx.core.program import PHASE_OPTIMIZER, Program
from boomfx.passes.blocks import BlockInfo
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.liveness import Category, LivenessInfo
from boomfx.report.model import BlockReport, GroupTime, KernelReport, MemoryReport, Report, SymbolReport, TimeReport
from boomfx.simulate.timeline import Timeline


def build_report(program: Program, device: DeviceSpec, options: Any, bindings: Mapping[sympy.Symbol, int],
                 kernels: list[KernelReport], timeline: Timeline, memory: MemoryReport,
                 unmodelled_ops: Any) -> Report:
    """The Report of one point (``options``: the analysis' AnalyzeOptions)."""
    total = timeline.total_ns
    time_report = TimeReport(total, timeline.device_busy_ns, timeline.host_busy_ns, timeline.host_bound_fraction,
                             len(kernels), sum(k.flops for k in kernels), sum(k.bytes_moved for k in kernels))
    busy = sum(k.time_ns for k in kernels) or 1.0
    symbols = [SymbolReport(i.name, i.role, i.min_value, i.max_value, bindings.get(i.symbol), list(i.names))
               for i in program.symbols.values()]
    opts = program.options
    return Report(
        source=program.source, device=device.name, device_description=device.description,
        mode="train" if opts.train else "inference",
        options={"optimizer": opts.optimizer if opts.train else None, "amp": opts.amp,
                 "checkpoint": opts.checkpoint,
                 "checkpoint_layers": list(opts.checkpoint_layers), "alloc_conf": options.alloc_conf,
                 "resident_grads": opts.resident_grads,
                 "foreach": opts.uses_foreach if opts.train and opts.optimizer != "none" else None,
                 "python_locals": opts.runs_eager_module,
                 "compile": opts.compile, "cudagraphs": opts.cudagraphs,
                 "db": options.db, "from_db": options.from_db},
        symbols=symbols, time=time_report, memory=memory,
        by_module=_group(kernels, _module_group, busy),
        by_op=_group(kernels, lambda k: k.op, busy),
        by_phase=_group(kernels, lambda k: k.phase, busy),
        by_source=_group(kernels, lambda k: k.source, busy),
        blocks=[], unmodelled_ops=unmodelled_ops, kernels=kernels)


def block_reports(info: BlockInfo, kernels: Sequence[KernelReport], liveness: LivenessInfo,
                  evaluator: Evaluator) -> list[BlockReport]:
    """One BlockReport per class: time per instance (mean over instances of the summed kernel time of
    its nodes) and activation bytes per instance (mean over instances of the ACT storages its nodes
    create; zero for inference graphs, which keep no activations for a backward pass)."""
    time_ns = {k.node: k.time_ns for k in kernels}
    act_bytes: dict[str, int] = {}
    for iv in liveness.intervals:
        if iv.category == Category.ACT:
            act_bytes[iv.node] = act_bytes.get(iv.node, 0) + int(evaluator(iv.nbytes))
    reports = []
    for cls in info.classes:
        times = [sum(time_ns.get(n, 0.0) for n in names) for names in cls.nodes]
        acts = [sum(act_bytes.get(n, 0) for n in names) for names in cls.nodes]
        reports.append(BlockReport(
            name=cls.name, instances=len(cls.instances), instance_names=list(cls.instances),
            time_ns_per_instance=sum(times) / len(times),
            activation_bytes_per_instance=round(sum(acts) / len(acts))))
    return reports


def _module_group(k: KernelReport) -> str:
    """The layer a kernel belongs to; the optimizer step and loss have no module of their own."""
    if not k.module and k.phase == PHASE_OPTIMIZER:
        return "(optimizer step)"
    return layer_of(k.module)


def _group(kernels: list[KernelReport], key: Callable[[KernelReport], str], busy: float) -> list[GroupTime]:
    acc: dict[str, list[float]] = {}
    for k in kernels:
        slot = acc.setdefault(key(k), [0.0, 0])
        slot[0] += k.time_ns
        slot[1] += 1
    groups = [GroupTime(name, t, int(n), t / busy) for name, (t, n) in acc.items()]
    return sorted(groups, key=lambda g: -g.time_ns)
