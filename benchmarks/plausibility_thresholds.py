"""Evidence for the plausibility thresholds (kernels_db/plausibility.py): how many rooflines legitimate rows take,
and how far a larger call of one signature runs faster than a smaller one.

Rows: the public GPU measurements (NeuSight, idle GPUs) and any CPU databases given on the command line (the
project's test suites leave some under /tmp/pytest-of-*). Writes benchmarks/results/plausibility_thresholds.json.

    python benchmarks/plausibility_thresholds.py [CPU.sqlite ...]
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from boomfx.kernels_db import plausibility as P
from boomfx.kernels_db.lookup import key_point
from boomfx.kernels_db.public_data import DEFAULT_DATA_DIR, import_public
from boomfx.kernels_db.store import Store

OUT = Path(__file__).resolve().parent / "results" / "plausibility_thresholds.json"


def _ratios(records: list) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    slow, inversions = [], []
    by_sig: dict[tuple, list] = defaultdict(list)
    for rec in records:
        if rec.key.op in ("block", "boomfx::host"):
            continue
        spec = P.device_of(rec.fingerprint)
        call = P.call_from_key(rec.key)
        if spec is None or call is None:
            continue
        spec = P.at_threads(spec, rec.fingerprint.num_threads)
        overhead = rec.host_ns if spec.kind == "cpu" else 0.0
        try:
            ratio = P.slowness(rec.median_ns, overhead, call, P.call_cost(call), spec)
        except Exception:  # noqa: BLE001
            continue
        slow.append((ratio, f"{rec.fingerprint.device_name} {rec.key.op} {rec.median_ns / 1e3:.1f}us"))
        try:
            point = key_point(rec.key)
        except Exception:  # noqa: BLE001
            continue
        by_sig[(rec.fingerprint.fp_hash, point.signature)].append((math.prod(point.features), rec.median_ns,
                                                                   rec.key.op))
    for rows in by_sig.values():
        rows.sort()
        # the largest inversion: max over pairs (small, larger-or-equal work) of t_small / t_large
        suffix_min = math.inf
        for work, t, op in reversed(rows):
            if suffix_min < math.inf:
                inversions.append((t / suffix_min, op))
            suffix_min = min(suffix_min, t)
    return slow, inversions


def _summary(values: list[tuple[float, str]]) -> dict:
    if not values:
        return {"rows": 0}
    arr = np.array([v for v, _ in values])
    worst = max(values)
    return {"rows": len(values), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max()), "worst": worst[1],
            "over_limit": int((arr > (P.SLOW_FACTOR if values is not None else 0)).sum())}


def main(argv: list[str]) -> int:
    result: dict = {"slow_factor": P.SLOW_FACTOR, "inversion_factor": P.INVERSION_FACTOR,
                    "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        with Store(Path(tmp) / "public.sqlite") as store:
            import_public(store, DEFAULT_DATA_DIR)
            public = list(store.records())
    cpu = []
    for path in argv:
        with Store(path) as store:
            cpu += [r for r in store.records() if r.fingerprint.device_kind == "cpu"]
    for name, records in (("public_gpu", public), ("cpu", cpu)):
        slow, inv = _ratios(records)
        result[name] = {"slowness": _summary(slow),
                        "inversion": {**_summary(inv), "over_limit": sum(v > P.INVERSION_FACTOR for v, _ in inv)}}
        result[name]["slowness"]["over_limit"] = sum(v > P.SLOW_FACTOR for v, _ in slow)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
