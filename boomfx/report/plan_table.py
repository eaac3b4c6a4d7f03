"""Text table of the plans ``--search`` ranked: rank, plan, step time, peak memory per GPU, MFU."""
from __future__ import annotations

from typing import Sequence

from boomfx.core.units import fmt_bytes, fmt_time


def render_plan_table(rows: Sequence[tuple[str, float, int, float]], evaluated: int, pruned: int,
                      not_fitting: int) -> str:
    """``rows`` are (plan, time_ns, peak_bytes, mfu), fastest first."""
    lines = [f"{'#':>3}  {'plan':<44} {'step':>10} {'peak/GPU':>10} {'MFU':>6}"]
    for i, (plan, time_ns, peak, mfu) in enumerate(rows, 1):
        lines.append(f"{i:>3}  {plan:<44} {fmt_time(time_ns):>10} {fmt_bytes(peak):>10} {mfu:>6.1%}")
    if not rows:
        lines.append("     no plan fits")
    lines.append(f"{evaluated} plans evaluated, {not_fitting} over memory, {pruned} pruned by the state bound")
    return "\n".join(lines)
