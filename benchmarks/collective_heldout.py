"""Held-out accuracy of the collective time model on the public NCCL table, one system left out at a time.

One command (about half a minute on 2 CPU cores)::

    python benchmarks/collective_heldout.py [--data FILE] [--out-dir benchmarks/results] [--write-calibration]

For each system (A100, H100, H200, B200 SXM nodes; 2, 4 and 8 GPUs; all-reduce, all-gather, reduce-scatter,
all-to-all; half and int8): fit the model's free parameters (``kernels_db/fit_collective_model.py``) on the
other three systems only, then price every row of the held-out system through the product's own path
(``collective_model.model_time`` with the held-out device's interconnect from ``boomfx/devices.py``).
An interconnect family seen in the fit keeps its latency/bandwidth scale (H100 and H200 share NVLink4, so
holding one out keeps the other's scale); an unseen one (A100's NVLink3, B200's NVLink5) gets the mean.

Error = predicted / measured - 1. Reported per system, and per system x op x GPU count: median |error| and
median signed error for messages >= 1 MiB and < 1 MiB. Targets: median |error| <= 10% (>= 1 MiB) and
<= 25% (< 1 MiB) per held-out system. Baseline: NCCL's own tuning constants (ring, tuning.cc baseLat +
nsteps * hwLat, LL/LL128/Simple bandwidth factors on the datasheet NVLink rate; no fitting).

``--write-calibration`` also fits on all four systems and writes ``kernels_db/data/collective_calibration.json``
(the shipped model), keeping the host (gloo) parameters already there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from boomfx.core.devices import get_device
from boomfx.kernels_db.collective_import import PublicCollectiveRow, iter_public_collectives
from boomfx.kernels_db.collective_model import (
    CALIBRATION_PATH,
    CollectiveCalibration,
    CollectiveGroup,
    ProtocolParams,
    SimpleParams,
    model_time,
)
from boomfx.kernels_db.fit_collective_model import FITTED_OPS, fit_calibration

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "collective-measurements" / \
    "nccl_single_node.csv"
MIB = 1 << 20
TARGET_LARGE, TARGET_SMALL = 0.10, 0.25

# NCCL's own constants (tuning.cc, ring, NVLink): latency baseLat + nsteps * hwLat (us); bandwidth: LL 1/3 of
# the link (1/4 for all-reduce; we use 1/4), LL128 0.92, Simple 1.0 -- the baseline, nothing fitted.
NCCL_CONSTANTS = CollectiveCalibration(
    protocols={"LL": ProtocolParams(6_600.0, 600.0, 0.25), "LL128": ProtocolParams(14_000.0, 1_900.0, 0.92),
               "Simple": ProtocolParams(8_400.0, 3_400.0, 1.0)},
    simple={op: SimpleParams(1.0, 0.0) for op in FITTED_OPS},
    source="NCCL tuning.cc constants",
)


def predict(cal: CollectiveCalibration, rows: Sequence[PublicCollectiveRow]) -> tuple[np.ndarray, list[str]]:
    """Model time per row through ``model_time`` (the product path), and the chosen algorithm/protocol."""
    out = np.empty(len(rows))
    choice = []
    for i, r in enumerate(rows):
        est = model_time(r.row.op, r.row.message_bytes, CollectiveGroup.of(r.row.world), get_device(r.device), cal)
        out[i] = est.time_ns
        choice.append(f"{est.algorithm}/{est.protocol}")
    return out, choice


def summarise(errors: np.ndarray, sizes: np.ndarray) -> dict:
    out = {}
    for label, mask in (("large", sizes >= MIB), ("small", sizes < MIB)):
        e = errors[mask]
        out[label] = {"rows": int(mask.sum()),
                      "median_abs_pct": round(float(np.median(np.abs(e))) * 100, 2) if len(e) else None,
                      "median_signed_pct": round(float(np.median(e)) * 100, 2) if len(e) else None,
                      "p90_abs_pct": round(float(np.quantile(np.abs(e), 0.9)) * 100, 2) if len(e) else None}
    return out


def evaluate(rows: list[PublicCollectiveRow], cal_for: dict[str, CollectiveCalibration]) -> dict:
    systems = sorted({r.system for r in rows})
    result: dict = {"systems": {}}
    for system in systems:
        held = [r for r in rows if r.system == system]
        pred, choice = predict(cal_for[system], held)
        meas = np.array([r.row.time_ns for r in held])
        sizes = np.array([r.row.message_bytes for r in held])
        err = pred / meas - 1
        by_cell: dict = defaultdict(dict)
        for op in FITTED_OPS:
            for n in (2, 4, 8):
                mask = np.array([r.row.op == op and r.row.world == n for r in held])
                if mask.any():
                    by_cell[op][str(n)] = summarise(err[mask], sizes[mask])
        choices: dict = defaultdict(int)
        for c in choice:
            choices[c] += 1
        result["systems"][system] = {"device": held[0].device, "all": summarise(err, sizes),
                                     "by_op_and_gpus": by_cell, "choices": dict(choices),
                                     "calibration_source": cal_for[system].source}
    return result


def render(result: dict, baseline: dict, load: tuple[float, ...], elapsed_s: float) -> str:
    lines = ["# Collective model, each system held out (public NCCL table, single node)", "",
             f"Fit on the other three systems, priced through `model_time`. Targets: median |error| <= "
             f"{TARGET_LARGE:.0%} for >= 1 MiB, <= {TARGET_SMALL:.0%} below. Error = predicted/measured - 1 "
             f"(negative: predicted too fast). Load average {load[0]:.2f} (no timing is measured here); "
             f"{elapsed_s:.0f} s.", "",
             "| held out | >= 1 MiB median abs | signed | < 1 MiB median abs | signed | targets | "
             "NCCL constants >= 1 MiB / < 1 MiB |", "|---|---|---|---|---|---|---|"]
    for system, s in result["systems"].items():
        large, small = s["all"]["large"], s["all"]["small"]
        met = ("met" if large["median_abs_pct"] <= TARGET_LARGE * 100 else "MISSED") + " / " + \
              ("met" if small["median_abs_pct"] <= TARGET_SMALL * 100 else "MISSED")
        b = baseline["systems"][system]["all"]
        lines.append(f"| {system} | {large['median_abs_pct']:.1f}% | {large['median_signed_pct']:+.1f}% | "
                     f"{small['median_abs_pct']:.1f}% | {small['median_signed_pct']:+.1f}% | {met} | "
                     f"{b['large']['median_abs_pct']:.0f}% / {b['small']['median_abs_pct']:.0f}% |")
    lines += ["", "## Per op and GPU count (median signed error, >= 1 MiB / < 1 MiB)", "",
              "| held out | op | 2 GPUs | 4 GPUs | 8 GPUs |", "|---|---|---|---|---|"]
    for system, s in result["systems"].items():
        for op, cells in s["by_op_and_gpus"].items():
            row = [f"{cells[n]['large']['median_signed_pct']:+.1f} / {cells[n]['small']['median_signed_pct']:+.1f}"
                   if n in cells else "-" for n in ("2", "4", "8")]
            lines.append(f"| {system} | {op} | " + " | ".join(row) + " |")
    lines += ["", "Algorithm/protocol the model picks (rows): " + "; ".join(
        f"{system}: {s['choices']}" for system, s in result["systems"].items()), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--write-calibration", action="store_true")
    args = parser.parse_args(list(argv))
    start = time.perf_counter()
    rows = list(iter_public_collectives(args.data))
    systems = sorted({r.system for r in rows})
    cal_for = {s: fit_calibration(rows, exclude={s}) for s in systems}
    result = evaluate(rows, cal_for)
    baseline = evaluate(rows, {s: NCCL_CONSTANTS for s in systems})
    elapsed = time.perf_counter() - start
    load = os.getloadavg()
    result["baseline_nccl_constants"] = {s: v["all"] for s, v in baseline["systems"].items()}
    result["load_average"] = load
    result["data"] = str(args.data)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "collective_heldout.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "collective_heldout.md").write_text(render(result, baseline, load, elapsed))
    print(render(result, baseline, load, elapsed))
    if args.write_calibration:
        old = json.loads(CALIBRATION_PATH.read_text()) if CALIBRATION_PATH.exists() else {}
        full = fit_calibration(rows)
        data = full.to_json()
        data["host"] = old.get("host")
        CALIBRATION_PATH.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {CALIBRATION_PATH} ({full.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
