"""What ``boomfx validate`` found: predicted and measured numbers of one step, side by side."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class OpComparison:
    """One op class (an aten op name, another library's ``ns::op``, or ``fused`` for Inductor's kernels):
    predicted vs in situ."""

    op: str
    predicted_ns: float
    measured_ns: float
    predicted_calls: int
    measured_calls: int

    @property
    def difference_ns(self) -> float:
        return self.predicted_ns - self.measured_ns


@dataclass(frozen=True)
class ValidationResult:
    """Predicted vs measured time and peak memory of one step on this machine.

    Memory is compared above the step's starting point (what exists before it: parameters, buffers,
    inputs, optimizer state and, with resident gradients, the ``.grad`` buffers), the part a profiler
    sees; totals add the resident bytes.
    """

    source: str
    device: str
    mode: str                         # "inference" | "train"
    options: dict[str, Any]
    bindings: dict[str, int]
    bindings_reduced: bool            # sizes were lowered to fit this machine
    threads: int
    predicted_time_ns: float
    measured_time_ns: float
    measured_time_samples_ns: tuple[float, ...]
    predicted_peak_above_start_bytes: int
    measured_peak_above_start_bytes: int
    predicted_resident_bytes: int
    measured_resident_bytes: int
    measured_reserved_above_start_bytes: Optional[int]
    memory_source: str
    ops: tuple[OpComparison, ...]
    profiled_step_ns: float
    measured_outside_ns: float        # in situ time in no aten op (Python, autograd engine, fused code)
    predicted_outside_ns: float       # predicted time outside kernel prices (graph entries, cold starts)
    db: Optional[str]
    price_sources: dict[str, float]   # predicted kernel time by price source (measured, roofline, ...)
    load_average: tuple[float, float, float]
    measured_thread_time_ns: float = 0.0   # this thread's CPU time (meaningful with one thread)
    calibration: Optional[dict[str, Any]] = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # CPU targets priced from this host's probe: the pages the prediction charges (glibc maps them afresh)
    # and those it only reports (heap pages a trim returns), against the process's minor faults per step
    predicted_fault_pages: float = 0.0
    predicted_refault_pages: float = 0.0
    measured_faults_per_step: float = 0.0

    @property
    def time_error(self) -> float:
        return self.predicted_time_ns / self.measured_time_ns - 1.0

    @property
    def memory_error(self) -> Optional[float]:
        real = self.measured_peak_above_start_bytes
        return self.predicted_peak_above_start_bytes / real - 1.0 if real else None

    def largest_differences(self, n: int = 8) -> list[OpComparison]:
        return sorted(self.ops, key=lambda o: -abs(o.difference_ns))[:n]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["time_error"] = self.time_error
        out["memory_error"] = self.memory_error
        out["ops"] = [{**asdict(o), "difference_ns": o.difference_ns} for o in self.ops]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
