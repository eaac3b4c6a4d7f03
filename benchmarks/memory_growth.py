"""Resident memory of one process over many analyses (issue 14: a long-lived process must stay flat).

Runs ``--train`` analyses of shipped examples back to back in this process and records the RSS after
``gc.collect()`` (/proc/self/statm) at checkpoints, and the ShapeEnvs still alive. Writes
benchmarks/results/memory_growth.json.

    python benchmarks/memory_growth.py [--mlp N] [--gpt N]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from boomfx.analysis.analysis import analyze

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "memory_growth.json"
MIB = 2 ** 20


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def live_shape_envs() -> int:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    gc.collect()
    return sum(isinstance(o, ShapeEnv) for o in gc.get_objects())


def run(example: str, n: int, **kwargs: object) -> dict:
    checkpoints = sorted({1, 10, 20, n // 2, n} | set(range(50, n + 1, 50)))
    rows = []
    start = time.perf_counter()
    for i in range(1, n + 1):
        analyze(str(ROOT / "examples" / example), device="cpu", db="none", train=True, **kwargs)
        if i in checkpoints:
            rows.append({"analyses": i, "rss_mib": round(rss_mib(), 2), "shape_envs": live_shape_envs(),
                         "seconds": round(time.perf_counter() - start, 1)})
            print(example, rows[-1], flush=True)
    after20 = next(r["rss_mib"] for r in rows if r["analyses"] == 20)
    return {"example": example, "analyses": n, "options": {"train": True, **kwargs}, "checkpoints": rows,
            "growth_after_20_mib": round(rows[-1]["rss_mib"] - after20, 2),
            "growth_per_analysis_kib": round((rows[-1]["rss_mib"] - after20) * 1024 / max(n - 20, 1), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mlp", type=int, default=300)
    parser.add_argument("--gpt", type=int, default=60)
    args = parser.parse_args()
    results = {"load_average_before": os.getloadavg(),
               "runs": [run("mlp.pt2", args.mlp, batch=8), run("gpt_tiny.pt2", args.gpt, batch=8, seq=64)]}
    results["load_average_after"] = os.getloadavg()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
