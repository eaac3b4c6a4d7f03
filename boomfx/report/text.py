"""Text summary of a Report (the CLI's default output). Reads the Report and nothing else."""
from __future__ import annotations

from typing import Optional

from boomfx.report.model import GroupTime, Report, TimeReport
from boomfx.core.units import fmt_bytes, fmt_flops, fmt_time

REFAULT_NOTE_SHARE = 0.05   # mention heap refaults above this share of the step
# glibc settings under which eager CPU steps fault nothing after warm-up (benchmarks/cpu_page_faults.py)
NO_REFAULT_ENV = "MALLOC_MMAP_THRESHOLD_=2147483647 MALLOC_TRIM_THRESHOLD_=17179869184"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _groups(title: str, groups: list[GroupTime], top: int) -> list[str]:
    if not groups:
        return []
    rows = [[g.name, fmt_time(g.time_ns), f"{100 * g.share:.1f}%", str(g.kernels)] for g in groups[:top]]
    if len(groups) > top:
        rest = groups[top:]
        rows.append([f"({len(rest)} more)", fmt_time(sum(g.time_ns for g in rest)),
                     f"{100 * sum(g.share for g in rest):.1f}%", str(sum(g.kernels for g in rest))])
    return ["", title] + _table(rows, ["name", "time", "share", "kernels"])


def render_kernels(report: Report, limit: int) -> list[str]:
    """The ``limit`` slowest kernels (0: all, in program order) with the source of each price."""
    kernels = list(report.kernels) if limit <= 0 else sorted(report.kernels, key=lambda k: -k.time_ns)[:limit]
    rows = [[k.node, k.op.replace("aten.", ""), k.module or "-", k.phase, fmt_time(k.time_ns), k.source
             + ("" if k.modelled else " (unmodelled op)")] for k in kernels]
    title = "Kernels (program order)" if limit <= 0 else f"Slowest {len(rows)} kernels"
    return ["", title] + _table(rows, ["node", "op", "module", "phase", "time", "priced by"])


# The step is called device-bound only when the device runs kernels for at least this share of it: below,
# the device waits for the host long enough that a faster host (fewer launches, CUDA graphs, compile)
# would shorten the step by more than 1 - DEVICE_BOUND_BUSY_FRACTION. A 50% busy device is host-bound.
DEVICE_BOUND_BUSY_FRACTION = 0.9


def device_busy_fraction(t: TimeReport) -> float:
    """Share of the simulated step during which the device runs kernels (the timeline's busy time)."""
    return min(1.0, t.device_busy_ns / t.total_ns) if t.total_ns > 0 else 0.0


def bound_label(t: TimeReport) -> str:
    """``device-bound`` when the device is busy >= DEVICE_BOUND_BUSY_FRACTION of the step, else ``host-bound``."""
    return "device-bound" if device_busy_fraction(t) >= DEVICE_BOUND_BUSY_FRACTION else "host-bound"


def render_text(report: Report, top: int = 8, kernels: Optional[int] = None) -> str:
    t, m = report.time, report.memory
    dims = ", ".join(f"{'/'.join([*s.names, s.name])}{'(' + s.role + ')' if s.role else ''}={s.value} "
                     f"[{s.min_value}..{'inf' if s.max_value is None else s.max_value}]"
                     for s in report.symbols) or "static"
    opts = [report.mode]
    if report.options.get("optimizer"):
        foreach = report.options.get("foreach")
        how = {True: " (foreach)", False: " (per-parameter loop)"}.get(foreach, "")
        if foreach and report.device == "cpu":   # torch.optim's _default_to_fused_or_foreach: the loop on CPU
            how = " (foreach, as asked; torch's default for CPU tensors is its per-parameter loop)"
        opts.append(report.options["optimizer"] + how)
    if report.options.get("amp"):
        opts.append(f"amp {report.options['amp']}")
    if report.options.get("checkpoint_layers"):
        opts.append("activation checkpointing of " + ", ".join(report.options["checkpoint_layers"]))
    elif report.options.get("checkpoint"):
        opts.append("activation checkpointing")
    if report.options.get("resident_grads"):
        opts.append("gradients resident between steps")
    if report.options.get("compile"):
        opts.append("torch.compile" + (" + CUDA graphs" if report.options.get("cudagraphs") else ""))
    out = [f"boomfx: {report.source} on {report.device_description} ({report.device})",
           f"  mode: {', '.join(opts)}; dims: {dims}", ""]
    out.append(f"Predicted step time: {fmt_time(t.total_ns)}  ({bound_label(t)}: device busy "
               f"{fmt_time(t.device_busy_ns)} ({100 * device_busy_fraction(t):.0f}% of the step), "
               f"host issue {fmt_time(t.host_busy_ns)})")
    out.append(f"  {t.kernels} kernels, {fmt_flops(t.flops)}, {fmt_bytes(t.bytes_moved)} moved")
    if t.graph_entry_ns:
        out.append(f"  entering the compiled graphs: {fmt_time(t.graph_entry_ns)} of host time "
                   f"(dynamo guards, AOTAutograd wrappers; {t.host_costs_source})")
    if t.cold_start_ns:
        out.append(f"  cold starts: {fmt_time(t.cold_start_ns)} (host code after kernels that evicted the L2; "
                   f"{t.host_costs_source})")
    if t.eager_dispatch_ns:
        out.append(f"  eager dispatch: {fmt_time(t.eager_dispatch_ns)} (each op after a different one, aliasing "
                   f"ops, the autograd engine; {t.host_costs_source})")
    if t.page_faults_ns:
        out.append(f"  page faults: {fmt_time(t.page_faults_ns)} (outputs glibc maps afresh every step)")
    if t.heap_refault_estimate_ns >= REFAULT_NOTE_SHARE * t.total_ns > 0:
        out.append(f"  not included: about {fmt_time(t.heap_refault_estimate_ns)} of page faults where glibc trims "
                   "its heap under the step's activations and takes the pages back, by a replay of the step's "
                   "allocations; real steps took 0-1.3x that (median 0.6x), as the runtime's own small "
                   f"allocations let glibc trim; {NO_REFAULT_ENV} in the environment avoids them")
    prov = ", ".join(f"{g.name} {100 * g.share:.1f}%" for g in report.by_source)
    out.append(f"  time priced by: {prov or 'nothing'}")
    if report.unmodelled_ops:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(report.unmodelled_ops.items()))
        out.append(f"  unmodelled ops (priced by bytes moved): {ops}")
    out += _groups("Time by layer/module", report.by_module, top)
    out += _groups("Time by op", report.by_op, top)
    if len(report.by_phase) > 1:
        out += _groups("Time by phase", report.by_phase, top)
    if kernels is not None:
        out += render_kernels(report, kernels)
    if report.blocks:
        out += ["", "Repeated blocks"]
        out += _table([[b.name, str(b.instances), fmt_time(b.time_ns_per_instance),
                        fmt_bytes(b.activation_bytes_per_instance)] for b in report.blocks],
                      ["block", "instances", "time/instance", "activations/instance"])
    out += ["", "Memory"]
    out.append(f"  peak live tensors: {fmt_bytes(m.peak_live_bytes)} (at {m.peak_step_node}); "
               f"resident before the step: {fmt_bytes(m.resident_bytes)}")
    cats = ", ".join(f"{name} {fmt_bytes(b)}" for name, b in m.by_category_bytes.items())
    out.append(f"  at the peak: {cats}")
    if m.workspace_bytes:
        out.append(f"  kernel workspace at the peak: {fmt_bytes(m.workspace_bytes)}")
    a = m.allocator
    if a is not None:
        out.append(f"  caching allocator: peak allocated {fmt_bytes(a.peak_allocated_bytes)}, peak reserved "
                   f"{fmt_bytes(a.peak_reserved_bytes)} in {a.segments} segments")
        out.append(f"    reserved - allocated at the peak: {fmt_bytes(a.fragmentation_bytes)} "
                   f"(largest free block {fmt_bytes(a.largest_free_block_bytes)}); config {a.config}")
    if m.outside_allocator_bytes:
        items = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in m.outside_allocator_bytes.items() if v)
        out.append(f"  outside the caching allocator / long-lived: {items}")
    verdict = "FITS" if m.fits else "DOES NOT FIT"
    out.append(f"  device total {fmt_bytes(m.total_device_bytes)} of {fmt_bytes(m.device_capacity_bytes)}: "
               f"{verdict} (margin {fmt_bytes(m.margin_bytes)})")
    if m.oom_node:
        out.append(f"  out of memory at {m.oom_node}" + (f" in {m.oom_module}" if m.oom_module else ""))
    for w in report.warnings:
        out.append(f"warning: {w}")
    out.append(f"\n(analysis took {report.analysis_seconds:.1f} s)")
    return "\n".join(out)
