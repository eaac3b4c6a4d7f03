"""Where a real gloo training step's time goes: aten kernels, collectives, and the framework's own host work.

``distributed_gloo_time.py`` finds boomfx's distributed steps on this CPU 30-77% short. This profiles the
same real steps (``distributed_truth._prepare``, 2 ranks x 1 thread) with ``torch.profiler`` after warm-up
and splits each rank's profiled step into

- **aten**: the self time of ``aten::`` ops (what kernel prices stand for);
- **collectives**: the self time of c10d / gloo events (issue, wait, the gloo work the rank waits on);
- **outside**: the rest of the step's wall time: Python (modules, hooks, DTensor's dispatch and sharding
  propagation, FSDP2's hooks, the pipelining runtime), the autograd engine, and the profiler's own cost;

and lists the largest non-aten events by self time (FSDP's and the pipeline's annotated regions show up
by name). Numbers carry the profiler's overhead: read the shares, not the absolute times.

    python benchmarks/distributed_gloo_profile.py [--only llama]

Writes ``benchmarks/results/distributed_gloo_profile.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import distributed_gloo_time as timing  # noqa: E402
import distributed_truth as truth  # noqa: E402
import torch  # noqa: E402

WARMUP, PROFILED = 3, 3
_COMM_WORDS = ("c10d", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
               "reducescatter", "wait", "record_param_comms", "send", "recv", "broadcast", "barrier", "all_to_all")


def _is_comm(name: str) -> bool:
    low = name.lower()
    return any(word in low for word in _COMM_WORDS)


def profile_rank(cfg: truth.TruthConfig, rank: int) -> dict[str, Any]:
    """This rank's split of ``PROFILED`` steps after ``WARMUP``."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    step, _, _ = truth._prepare(cfg, rank)
    for _ in range(WARMUP):
        step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter_ns()
        for _ in range(PROFILED):
            step()
        wall = (time.perf_counter_ns() - start) / PROFILED
    aten = comm = 0.0
    others: dict[str, float] = {}
    for e in prof.key_averages():
        self_ns = e.self_cpu_time_total * 1e3 / PROFILED
        if _is_comm(e.key):
            comm += self_ns
        elif e.key.startswith("aten::"):
            aten += self_ns
        else:
            others[e.key] = others.get(e.key, 0.0) + self_ns
    top = sorted(others.items(), key=lambda kv: -kv[1])[:6]
    dist.barrier()
    return {"rank": rank, "profiled_step_ns": wall, "aten_ns": aten, "comm_ns": comm,
            "outside_ns": max(wall - aten - comm, 0.0), "top_other_events": [[k, v] for k, v in top]}


def _worker(rank: int, world: int, port: int, configs: list[truth.TruthConfig], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = [profile_rank(cfg, rank) for cfg in configs]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def run(configs: list[truth.TruthConfig]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.start_processes(_worker, (2, truth._free_port(), configs, out_dir), nprocs=2, join=True,
                           start_method="spawn")
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
    return [{"name": cfg.name, "ranks": [per_rank[r][i] for r in range(2)]} for i, cfg in enumerate(configs)]


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.2f} ms"


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Where a real gloo training step's time goes (2 ranks x 1 thread, torch.profiler)", "",
             f"torch {meta['torch']}; {PROFILED} profiled steps per rank after {WARMUP} warm-up; load average before "
             f"{meta['load_before'][0]:.1f}, after {meta['load_after'][0]:.1f}. Rank 0 shown; times include the "
             "profiler's overhead (read the shares). aten: self time of aten ops; collectives: c10d/gloo events; "
             "outside: the rest of the wall time (Python, hooks, DTensor dispatch, the autograd engine, the "
             "pipelining runtime, the profiler).", "",
             "| configuration | profiled step | aten | collectives | outside | outside share | largest other events "
             "(self time) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        r = row["ranks"][0]
        top = "; ".join(f"{k[:48]} {_ms(v)}" for k, v in r["top_other_events"][:4])
        lines.append(f"| {row['name']} | {_ms(r['profiled_step_ns'])} | {_ms(r['aten_ns'])} | {_ms(r['comm_ns'])} | "
                     f"{_ms(r['outside_ns'])} | {100 * r['outside_ns'] / max(r['profiled_step_ns'], 1):.0f}% | {top} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="configurations whose name contains this")
    args = parser.parse_args(argv)
    chosen = [c for c in timing.configs(0) if args.only in c.name]
    load_before = os.getloadavg()
    rows = run(chosen)
    meta = {"torch": torch.__version__, "load_before": load_before, "load_after": os.getloadavg()}
    timing.write_results("distributed_gloo_profile", meta, rows, _markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
