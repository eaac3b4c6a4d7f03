"""``boomfx validate --calibrate``: turn the per-op-class comparison into stored in-situ factors.

factor(op class) = in-situ time / predicted time, where the in-situ time is the op's share of the
profiled step scaled to the unprofiled median step (the profiler's own overhead spread in proportion)
and the predicted time is what the database (or roofline) priced. A class already calibrated in the
database was predicted with its old factor, so the new one is the old times the ratio seen now.
Classes below ``MIN_SHARE`` of the step, or absent on either side, are left alone.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from boomfx.core.errors import OptionError
from boomfx.validate.result import ValidationResult

MIN_SHARE = 0.01       # op classes under 1% of the measured step are too noisy to calibrate


def calibration_factors(result: ValidationResult, previous: dict[str, float]) -> dict[str, float]:
    """The factor of each op class this result measured well enough (see the module docstring)."""
    scale = result.measured_time_ns / result.profiled_step_ns if result.profiled_step_ns else 1.0
    out = {}
    for o in result.ops:
        in_situ = o.measured_ns * scale
        if o.predicted_ns <= 0 or o.measured_ns <= 0 or in_situ < MIN_SHARE * result.measured_time_ns:
            continue
        out[o.op] = previous.get(o.op, 1.0) * in_situ / o.predicted_ns
    return out


def store_calibration(result: ValidationResult, analysis: Any, db: Optional[str]) -> ValidationResult:
    from boomfx.kernels_db.calibration import read_calibration, write_calibration
    from boomfx.kernels_db.pricing import resolve_db_path
    if db in (None, "none"):
        raise OptionError("--calibrate stores factors in a kernel database: give --db PATH (or default)")
    path = resolve_db_path(db, analysis.device)
    if path is None:        # "auto" with no database yet: the default one is created
        from boomfx.kernels_db.store import default_db_path
        path = default_db_path(analysis.device.name)
    previous = {k: c.factor for k, c in read_calibration(path).items()}
    factors = calibration_factors(result, previous)
    write_calibration(path, factors, f"{result.source} {result.mode}", result.threads)
    return dataclasses.replace(result, calibration={"db": str(path), "factors": factors,
                                                    "label": "in-situ calibration"})
