"""Ground truth for the multi-stream scheduler: real 2-rank gloo steps (CPU, one thread per rank) of per-rank
programs that call ``_c10d_functional`` collectives, timed, against ``schedule_rank``'s prediction.

Workloads (each rank runs the same function; the collective's group is the default process group):

- ``tp_mlp``: 4 row-parallel MLP layers, ``x + all_reduce(relu(x @ w1) @ w2)``: every all-reduce is waited on
  at once (tensor parallelism: communication on the critical path);
- ``overlap``: a 4 MiB all-reduce issued first, waited after a chain of matmuls that do not depend on it
  (DDP's bucket all-reduce beside the rest of the backward);
- ``serial``: the same all-reduce waited at once, then the same matmuls (nothing to hide behind).

Real: ``torch.multiprocessing`` spawns 2 ranks over a FileStore; each step starts after a barrier (the step
with collectives and the same compute alone alternate), a sample is
the slowest rank's wall time, the median of 20 steps after 5 warm-up steps is kept.
Predicted: the function traced with ``make_fx`` on fake tensors, its kernels measured into a fresh CPU database
(``collect_calls``, as ``benchmarks/cpu_accuracy.py`` does, one thread), its collectives measured with gloo at
exactly their message sizes (``collect_collectives``), then ``schedule_rank`` with the CPU rules (ops run on
the host thread, collectives on gloo's thread until waited; while one runs, compute gets the share of the
cores ``cpu_core_sharing`` gives: 2 ranks x (1 compute thread + gloo's 0.7 of a core) on 2 cores here, both
1.7x slower while they overlap).

Run: ``python benchmarks/distributed_step_time.py`` (writes ``benchmarks/results/distributed_step_time.{json,md}``).
Timing on a shared machine: the load average is recorded next to the numbers.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORLD = 2
WARMUP, STEPS = 5, 20
D, HIDDEN, BATCH, LAYERS = 512, 2048, 64, 4
OVERLAP_ELEMS = 1 << 20            # 4 MiB of fp32
CHAIN = 6                          # matmuls of [256, 512] x [512, 512] beside the all-reduce


def _workloads(group: str, comm: bool = True) -> dict[str, tuple[Callable, list[tuple[int, ...]]]]:
    """The per-rank functions; ``comm=False`` replaces each collective and its wait by the identity (the same
    compute alone, to tell contention between the ranks' processes from communication)."""
    functional = torch.ops._c10d_functional

    class _Local:
        class all_reduce:
            @staticmethod
            def default(t, op, g):
                return t

        class wait_tensor:
            @staticmethod
            def default(t):
                return t

    c10d = functional if comm else _Local

    def tp_mlp(x, *weights):
        for i in range(LAYERS):
            w1, w2 = weights[2 * i], weights[2 * i + 1]
            y = torch.mm(torch.relu(torch.mm(x, w1)), w2)
            x = x + c10d.wait_tensor.default(c10d.all_reduce.default(y, "sum", group))
        return x

    def overlap(bucket, x, w):
        reduced = c10d.all_reduce.default(bucket, "sum", group)
        for _ in range(CHAIN):
            x = torch.tanh(torch.mm(x, w))
        return x, c10d.wait_tensor.default(reduced)

    def serial(bucket, x, w):
        reduced = c10d.wait_tensor.default(c10d.all_reduce.default(bucket, "sum", group))
        for _ in range(CHAIN):
            x = torch.tanh(torch.mm(x, w))
        return x, reduced

    local = HIDDEN // WORLD
    tp_shapes = [(BATCH, D)] + [(D, local), (local, D)] * LAYERS
    ov_shapes = [(OVERLAP_ELEMS,), (256, D), (D, D)]
    return {"tp_mlp": (tp_mlp, tp_shapes), "overlap": (overlap, ov_shapes), "serial": (serial, ov_shapes)}


def _worker(rank: int, store_path: str, result_path: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    group = dist.group.WORLD.group_name
    out = {}
    try:
        local = _workloads(group, comm=False)
        for name, (fn, shapes) in _workloads(group).items():
            # the step with its collectives and the same compute alone alternate step by step, so the machine's
            # load (shared here) weighs on both alike
            pair = {name: fn, name + ":compute": local[name][0]}
            torch.manual_seed(rank)
            args = [torch.randn(s) * 0.05 for s in shapes]
            mine: dict[str, list[int]] = {key: [] for key in pair}
            with torch.no_grad():
                for _ in range(WARMUP):
                    for f in pair.values():
                        f(*args)
                for _ in range(STEPS):
                    for key, f in pair.items():
                        dist.barrier()
                        start = time.perf_counter_ns()
                        f(*args)
                        mine[key].append(time.perf_counter_ns() - start)
            for key, values in mine.items():
                samples = torch.tensor(values, dtype=torch.float64)
                dist.all_reduce(samples, op=dist.ReduceOp.MAX)
                out[key] = samples.tolist()
    finally:
        dist.barrier()
        if rank == 0:
            Path(result_path).write_text(json.dumps(out))
        dist.destroy_process_group()


def _median_local_ns(fn: Callable, shapes: list[tuple[int, ...]]) -> float:
    """The compute alone in this (single) process, as the kernel database was measured."""
    args = [torch.randn(s) * 0.05 for s in shapes]
    with torch.no_grad():
        for _ in range(WARMUP):
            fn(*args)
        mine = []
        for _ in range(STEPS):
            start = time.perf_counter_ns()
            fn(*args)
            mine.append(time.perf_counter_ns() - start)
    return statistics.median(mine)


def measure() -> dict[str, float]:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="boomfx-step-") as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), path), nprocs=WORLD, join=True)
        samples = json.loads(Path(path).read_text())
    return {name: statistics.median(values) for name, values in samples.items()}


def predict(db: str) -> dict[str, dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec, host_cores
    from boomfx.distributed.rank_schedule import c10d_packet, schedule_rank
    from boomfx.frontend.capture import capture
    from boomfx.kernels_db.collect import collect_calls
    from boomfx.kernels_db.collective_bench import collect_collectives
    from boomfx.kernels_db.collective_model import CollectiveGroup
    from boomfx.kernels_db.collectives import CollectivePricer
    from boomfx.kernels_db.store import Store
    from boomfx.simulate.streams import cpu_core_sharing

    group_name = "0"            # the default group's name; only a key here
    spec = cpu_spec()
    groups = {group_name: CollectiveGroup.of(WORLD)}
    analyses, sizes = {}, set()
    for name, (fn, shapes) in _workloads(group_name).items():
        with FakeTensorMode():
            gm = make_fx(fn)(*[torch.empty(s) for s in shapes])
        program = capture(gm)
        unpriced = Analysis(program, spec, AnalyzeOptions(spec.name, db="none"))
        calls = [c for c in unpriced.kernel_calls({}) if "_c10d_functional" not in str(c.op)]
        collect_calls(Store(db), calls, "cpu", progress=False)
        analyses[name] = Analysis(program, spec, AnalyzeOptions(spec.name, db=db))
        for node in program.graph.nodes:
            if c10d_packet(node) == "all_reduce":
                val = node.meta["val"]
                sizes.add(val.numel() * val.element_size())
    collect_collectives(Store(db), world=WORLD, ops=("all_reduce",), sizes=sorted(sizes), backend="gloo")
    pricer = CollectivePricer(Store(db), spec)
    out = {}
    for name, analysis in analyses.items():
        # the functions call wait_tensor where eager code waits: keep the graph's positions
        step = schedule_rank(analysis, {}, groups, pricer=pricer, waits="as_placed",
                             slowdown=cpu_core_sharing(WORLD, host_cores()))
        out[name] = {"step_ns": step.step_ns, "exposed_comm_ns": step.timeline.exposed_comm_ns,
                     "hidden_comm_ns": step.timeline.hidden_comm_ns,
                     "collective_sources": sorted({c.price.source.value for c in step.collectives}),
                     "compute_ns": step.timeline.ranks[0].compute_busy_ns}
    return out


def main() -> int:
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="boomfx-step-db-") as tmp:
        predicted = predict(os.path.join(tmp, "cpu.db"))
    real = measure()
    local = {name: _median_local_ns(fn, shapes) for name, (fn, shapes) in _workloads("0", comm=False).items()}
    load_after = os.getloadavg()
    rows = []
    for name, pred in predicted.items():
        err = (pred["step_ns"] - real[name]) / real[name]
        real_comm = real[name] - real[name + ":compute"]
        pred_comm = pred["step_ns"] - pred["compute_ns"]
        rows.append({"workload": name, "real_ns": real[name], **pred, "signed_error": err,
                     "real_compute_2proc_ns": real[name + ":compute"], "real_compute_1proc_ns": local[name],
                     "real_comm_cost_ns": real_comm, "predicted_comm_cost_ns": pred_comm})
    result = {"world": WORLD, "threads_per_rank": 1, "steps": STEPS, "warmup": WARMUP,
              "loadavg_before": load_before, "loadavg_after": load_after, "rows": rows,
              "median_abs_error": statistics.median(abs(r["signed_error"]) for r in rows)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distributed_step_time.json").write_text(json.dumps(result, indent=2))
    lines = ["# Distributed step time: 2-rank gloo (CPU, 1 thread/rank) vs schedule_rank", "",
             f"load average before {load_before}, after {load_after} (shared machine: timings are noisy)", "",
             "| workload | real | predicted | signed error | exposed comm | hidden comm | predicted compute | "
             "real compute, 1 process | real compute, 2 ranks at once | real comm cost | predicted comm cost |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['real_ns'] / 1e6:.3f} ms | {r['step_ns'] / 1e6:.3f} ms | "
                     f"{r['signed_error']:+.1%} | {r['exposed_comm_ns'] / 1e6:.3f} ms | "
                     f"{r['hidden_comm_ns'] / 1e6:.3f} ms | {r['compute_ns'] / 1e6:.3f} ms | "
                     f"{r['real_compute_1proc_ns'] / 1e6:.3f} ms | {r['real_compute_2proc_ns'] / 1e6:.3f} ms | "
                     f"{r['real_comm_cost_ns'] / 1e6:.3f} ms | {r['predicted_comm_cost_ns'] / 1e6:.3f} ms |")
    lines += ["", f"median |error| {result['median_abs_error']:.1%}", "",
              "comm cost = step with collectives - the same compute alone (real: alternating steps of the two in "
              "the same 2 ranks; predicted: step - compute busy time)"]
    (RESULTS / "distributed_step_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
