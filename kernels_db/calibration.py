"""In-situ calibration: per op class, how much slower (or faster) kernels ran inside a real step than
their database or roofline price, as measured by ``boomfx validate --calibrate``.

A kernel timed alone differs from the same kernel inside a step (caches the step leaves cold or warm,
thread wake-ups, fresh pages). ``validate`` profiles a real step and compares each op class (an aten
op name: ``addmm``, ``native_layer_norm``) with what the prediction priced it at; ``--calibrate``
stores the ratio here, and every later prediction with this database multiplies the price of a kernel
of that class by it. Only classes a calibration measured change: a factor measured on an MLP moves a
transformer's ``addmm``, not its attention.

The factors live in their own table of the database file, labelled with the program, threads and
time they came from (``boomfx kernels info`` shows kernel rows only; ``in_situ_calibration`` rows are
never kernel measurements).

Known limitations:
- One factor per op class, whatever the size: a small model's factor applied to a large model's
  kernels of the same class carries the small model's cache situation with it.
- Profiler overhead is spread over the profiled step in proportion to op time (validate scales the
  profiled times to the unprofiled median); small ops' overhead is per call, not per nanosecond.
"""
from __future__ import annotations

import dataclasses
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

TABLE_DDL = """
CREATE TABLE IF NOT EXISTS in_situ_calibration (
    op_class TEXT PRIMARY KEY,
    factor REAL NOT NULL,
    measured_on TEXT NOT NULL,
    threads INTEGER NOT NULL,
    created TEXT NOT NULL
)
"""
LABEL = "in-situ calibration"


@dataclass(frozen=True)
class Calibration:
    op_class: str
    factor: float
    measured_on: str
    threads: int
    created: str


def read_calibration(path: Optional[Path]) -> dict[str, Calibration]:
    """The calibration rows of a database file (none if it has no table)."""
    if path is None or not Path(path).exists():
        return {}
    with sqlite3.connect(str(path)) as conn:
        try:
            rows = conn.execute("SELECT op_class, factor, measured_on, threads, created "
                                "FROM in_situ_calibration").fetchall()
        except sqlite3.OperationalError:       # no such table: never calibrated
            return {}
    return {r[0]: Calibration(*r) for r in rows}


def write_calibration(path: Path, factors: Mapping[str, float], measured_on: str, threads: int) -> None:
    """Store (replace) the factor of each op class given."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(str(path)) as conn:
        conn.execute(TABLE_DDL)
        conn.executemany("INSERT OR REPLACE INTO in_situ_calibration VALUES (?, ?, ?, ?, ?)",
                         [(op, float(f), measured_on, int(threads), created) for op, f in factors.items()])


# profiler event namespaces that are not operator libraries, and boomfx's own (Inductor's fused kernels)
_NOT_OP_LIBRARIES = frozenset({"autograd", "profiler", "boomfx", "torch", "prims", "c10d", "record_param_comms"})


def op_class(text: str) -> Optional[str]:
    """The op class of a profiler event or a priced kernel: ``aten::addmm`` / ``aten.addmm.default`` -> ``addmm``;
    another library's op, ``transformers::grouped_mm_fallback`` / ``transformers.grouped_mm_fallback.default`` ->
    ``transformers::grouped_mm_fallback``; anything else (profiler ranges, boomfx's fused kernels) -> None."""
    if text.startswith("aten::"):
        return text[len("aten::"):]
    if text.startswith("aten."):
        return text.split(".")[1]
    namespace, sep, op = text.partition("::")
    if not sep:
        parts = text.split(".")
        namespace, op = (parts[0], parts[1]) if len(parts) == 3 else ("", "")
    if namespace.isidentifier() and op.isidentifier() and namespace not in _NOT_OP_LIBRARIES:
        return f"{namespace}::{op}"
    return None


def op_class_of(op: Any) -> str:
    """``op_class`` of a priced kernel's op; ops without one keep their full name."""
    text = str(op)
    return op_class(text) or text


class CalibratedPricer:
    """A pricer whose prices of calibrated op classes are scaled by their in-situ factor.

    ``inner`` is the database pricer (its host rows are read through it: boomfx/pricing.py host_costs).
    """

    def __init__(self, inner: Any, factors: Mapping[str, Calibration]) -> None:
        self.inner = getattr(inner, "inner", inner)
        self._wrapped = inner
        self.factors = dict(factors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)

    def price(self, call: Any, cost: Any) -> Any:
        price = self._wrapped.price(call, cost)
        cal = self.factors.get(op_class_of(call.op))
        if cal is None:
            return price
        detail = f"{price.detail}; " if price.detail else ""
        return dataclasses.replace(price, time_ns=price.time_ns * cal.factor,
                                   detail=f"{detail}x{cal.factor:.3f} {LABEL} ({cal.measured_on})")
