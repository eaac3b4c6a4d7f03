"""Text of ``boomfx validate``: predicted and measured columns, then the op classes that differ most."""
from __future__ import annotations

from boomfx.core.units import fmt_bytes, fmt_time
from boomfx.validate.result import ValidationResult

# the op column widens for a library op's whole name (transformers::grouped_mm_fallback_backward), up to this
OP_COLUMN_MAX = 44


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _without_db(r: ValidationResult) -> str:
    """What priced the prediction without a database: this host's probe (its model) or the roofline."""
    return "none (this host's probe)" if "model" in r.price_sources else "none (roofline)"


def render_validation(r: ValidationResult, top: int = 8) -> str:
    dims = ", ".join(f"{k}={v}" for k, v in r.bindings.items()) or "static shapes"
    reduced = " (lowered to fit this machine)" if r.bindings_reduced else ""
    opts = ", ".join(f"{k}={v}" for k, v in r.options.items() if v not in (None, False, ""))
    load = ", ".join(f"{x:.2f}" for x in r.load_average)
    lines = [
        f"boomfx validate: {r.source} on {r.device}, {r.mode}" + (f" ({opts})" if opts else ""),
        f"  sizes: {dims}{reduced}; {r.threads} thread(s); database: {r.db or _without_db(r)}; "
        f"load average {load}",
        "",
        f"  {'':28s}{'predicted':>14s}{'measured':>14s}{'error':>9s}",
        f"  {'step time':28s}{fmt_time(r.predicted_time_ns):>14s}{fmt_time(r.measured_time_ns):>14s}"
        f"{_pct(r.time_error):>9s}",
        f"  {'peak memory above start':28s}{fmt_bytes(r.predicted_peak_above_start_bytes):>14s}"
        f"{fmt_bytes(r.measured_peak_above_start_bytes):>14s}{_pct(r.memory_error):>9s}",
        f"  {'resident before the step':28s}{fmt_bytes(r.predicted_resident_bytes):>14s}"
        f"{fmt_bytes(r.measured_resident_bytes):>14s}",
    ]
    if r.predicted_fault_pages or r.predicted_refault_pages or r.measured_faults_per_step:
        predicted = f"{r.predicted_fault_pages:.0f}"
        lines.append(f"  {'page faults per step':28s}{predicted:>14s}{r.measured_faults_per_step:>14.0f}"
                     f"   (predicted: charged; about {r.predicted_refault_pages:.0f} more reported, not charged)")
    if r.measured_reserved_above_start_bytes is not None:
        lines.append(f"  {'reserved above start':28s}{'':>14s}{fmt_bytes(r.measured_reserved_above_start_bytes):>14s}")
    shown = r.largest_differences(top)
    width = min(OP_COLUMN_MAX, max([28] + [len(o.op) + 1 for o in shown]))   # library ops keep their whole name
    lines += ["", f"  largest differences by op class (in situ: one profiled real step, {fmt_time(r.profiled_step_ns)}):",
              f"  {'op':{width}s}{'predicted':>12s}{'in situ':>12s}{'difference':>12s}{'calls':>12s}"]
    for o in shown:
        lines.append(f"  {o.op[:width - 1]:{width}s}{fmt_time(o.predicted_ns):>12s}{fmt_time(o.measured_ns):>12s}"
                     f"{('+' if o.difference_ns >= 0 else '-') + fmt_time(abs(o.difference_ns)):>12s}"
                     f"{f'{o.predicted_calls}/{o.measured_calls}':>12s}")
    lines.append(f"  {'(outside aten ops)':{width}s}{fmt_time(r.predicted_outside_ns):>12s}"
                 f"{fmt_time(r.measured_outside_ns):>12s}")
    if r.calibration:
        lines += ["", f"  calibration stored in {r.calibration['db']}: "
                  + ", ".join(f"{k} x{v:.2f}" for k, v in sorted(r.calibration["factors"].items()))]
    for n in r.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
