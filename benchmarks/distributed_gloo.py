"""Real distributed training steps on gloo (CPU): per-rank peak memory, collectives and step time.

Runs every configuration of ``distributed_truth.default_configs()`` (DDP, FSDP2 with and without
reshard after forward, TP, PP with 1F1B and GPipe on 2 ranks; HSDP and TP x FSDP on 4 ranks; DDP and
PP x DDP with and without ``gradient_as_bucket_view`` at seq 8; a Llama-style and a GPT-2-style model), and, where boomfx predicts the configuration, its per-rank
prediction next to the measurement. Writes ``benchmarks/results/distributed_gloo.{json,md}``.

The same script is the template for a GPU cluster run: the harness only needs another backend and
device. Step times are wall-clock medians on a shared 2-core machine (load average recorded) and
are recorded for the collective time model, not asserted anywhere.

    python benchmarks/distributed_gloo.py [--only llama-fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import distributed_truth as truth  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _predict(cfg: truth.TruthConfig) -> list[int] | None:
    """boomfx's predicted per-rank peak above the step's start, or None where it does not model it."""
    try:
        from distributed_predict import predicted_rank_peaks
    except ImportError:
        return None
    return predicted_rank_peaks(cfg)


def _markdown(rows: list[dict], load: tuple[float, float, float], wall_s: float, reruns: list[dict] = ()) -> str:
    lines = [
        "# Distributed training on gloo (CPU): per-rank peak memory and collectives",
        "",
        f"torch {truth.torch.__version__}, one thread per rank, load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} (1/5/15 min), {wall_s:.0f} s in all. Peak = profiler memory events above the "
        "step's start (after warm-up); batch is per data-parallel rank (TP ranks share it; PP: the whole "
        "step's batch, cut into micro-batches).",
        "",
        *[f"Rows matching '{r['only']}' rerun with --only: load average {r['load_average'][0]:.1f} / "
          f"{r['load_average'][1]:.1f} / {r['load_average'][2]:.1f}, {r['wall_s']:.0f} s." for r in reruns],
        *([""] if reruns else []),
        "| configuration | rank | measured peak (B) | predicted (B) | error | params (B) | AdamW state (B) "
        "| collectives | step (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for r, rank in enumerate(row["ranks"]):
            pred = row["predicted"][r] if row["predicted"] else None
            err = f"{pred / rank['peak_bytes'] - 1:+.2%}" if pred else "-"
            lines.append(
                f"| {row['name']} | {r} | {rank['peak_bytes']} | {pred if pred else '-'} | {err} "
                f"| {rank['start_param_bytes']} | {rank['start_optimizer_bytes']} "
                f"| {len(rank['collectives'])} | {rank['step_time_s'] * 1e3:.1f} |"
            )
    lines += [
        "",
        "predicted '-': boomfx does not build that configuration's per-rank program; its measurement "
        "is recorded for when it does. Step times are wall-clock "
        "medians on a shared 2-core machine, for the collective time model (not predicted here).",
    ]
    return "\n".join(lines) + "\n"


def _merged_with_earlier(fresh: dict) -> list[dict]:
    """``--only``: the earlier results file's rows with the rerun ones replaced (or added), in the
    order of ``default_configs()``; each row keeps the load average of its own run."""
    path = RESULTS / "distributed_gloo.json"
    earlier = {r["name"]: r for r in json.loads(path.read_text())["configs"]} if path.exists() else {}
    earlier.update(fresh)
    order = [c.name for c in truth.default_configs()]
    return sorted(earlier.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only configurations whose name contains this")
    args = parser.parse_args()
    configs = [c for c in truth.default_configs() if args.only in c.name]
    start = time.perf_counter()
    results = []
    for world in sorted({c.world for c in configs}):
        results += truth.run_configs([c for c in configs if c.world == world])
    wall_s = time.perf_counter() - start
    load = os.getloadavg()
    fresh = {}
    for res in results:
        row = res.to_json()
        row["predicted"] = _predict(res.config)
        row["load_average"] = load
        fresh[row["name"]] = row
    rows = _merged_with_earlier(fresh) if args.only else list(fresh.values())
    RESULTS.mkdir(exist_ok=True)
    previous = RESULTS / "distributed_gloo.json"
    reruns: list[dict] = []
    if args.only and previous.exists():  # rerun rows replace theirs; the other configurations are kept
        old = json.loads(previous.read_text())
        fresh = {row["name"]: row for row in rows}
        rows = [fresh.pop(row["name"], row) for row in old["configs"]] + list(fresh.values())
        reruns = old.get("reruns", []) + [{"only": args.only, "load_average": load, "wall_s": wall_s}]
        load, wall_s = tuple(old["load_average"]), old["wall_s"]
    (RESULTS / "distributed_gloo.json").write_text(
        json.dumps(
            {"torch": truth.torch.__version__, "load_average": load, "wall_s": wall_s, "reruns": reruns,
             "configs": rows},
            indent=1,
        )
    )
    (RESULTS / "distributed_gloo.md").write_text(_markdown(rows, load, wall_s, reruns))
    print((RESULTS / "distributed_gloo.md").read_text())


if __name__ == "__main__":
    main()
