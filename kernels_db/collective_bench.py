"""Measure collectives on this machine: N local processes, one process group, every op at a grid of sizes.

``measure_collectives(world=2)`` spawns ``world`` processes (``torch.multiprocessing``) that join one process
group over a ``FileStore`` in a temporary directory: gloo on CPU tensors (one intra-op thread per rank, as
torchrun sets), NCCL on ``cuda:<rank>`` when ``backend="nccl"`` (untested here: no GPU). Every rank times each
call after a barrier; a sample is the slowest rank's time of that iteration (the collective is done when
the last rank is), and the row keeps the mean (``summarize_samples``: a step pays the tail too) and p10/p90.
Sizes follow nccl-tests' convention (``kernels_db/collectives.py``): the whole buffer, so an all-gather of S
bytes gathers S/world from each rank.

``collect_collectives(store, ...)`` stores the rows as ``boomfx::collective`` records of this machine's
fingerprint, where ``CollectivePricer`` finds them (source "measured").

Known limitations:
- Only ranks of one host (ranks_per_node = world). A multi-node measurement is nccl-tests' job: import its
  tables with ``boomfx kernels import``.
- send/recv is measured with two ranks only (rank 0 sends to rank 1).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from boomfx.core.errors import CollectiveError
from boomfx.kernels_db.collective_import import CollectiveRow, record_of
from boomfx.kernels_db.collective_model import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    REDUCE_SCATTER,
    SEND_RECV,
    canonical_op,
)

DEFAULT_OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, SEND_RECV)
DEFAULT_SIZES = tuple(1 << k for k in range(10, 25, 2))       # 1 KiB .. 16 MiB, x4 apart
ELEMENT = torch.float32


@dataclass(frozen=True)
class CollectiveRun:
    rows: tuple[CollectiveRow, ...]
    backend: str
    failed: tuple[tuple[str, str], ...]      # (op, why) for ops the backend refused
    elapsed_s: float


def _call(op: str, size_bytes: int, world: int, rank: int, device: torch.device) -> Any:
    """A zero-argument function running one ``op`` of ``size_bytes`` (the whole buffer) on this rank."""
    import torch.distributed as dist
    elems = max(world, size_bytes // ELEMENT.itemsize // world * world)   # divisible by the world
    whole = torch.ones(elems, dtype=ELEMENT, device=device)
    part = torch.ones(elems // world, dtype=ELEMENT, device=device)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    if op == ALL_REDUCE:
        return lambda: dist.all_reduce(whole)
    if op == ALL_GATHER:
        return lambda: gather(whole, part)
    if op == REDUCE_SCATTER:
        return lambda: scatter(part, whole)
    if op == ALL_TO_ALL:
        out = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(out, whole)
    if op == BROADCAST:
        return lambda: dist.broadcast(whole, src=0)
    if op == SEND_RECV:
        if rank == 0:
            return lambda: dist.send(whole, dst=1)
        return lambda: dist.recv(whole, src=0)
    raise CollectiveError(f"no measurement for collective '{op}'")


def _worker(rank: int, world: int, backend: str, store_path: str, ops: Sequence[str], sizes: Sequence[int],
            warmup: int, iters: int, result_path: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    results: dict = {"rows": [], "failed": []}
    try:
        for op in ops:
            if op == SEND_RECV and world != 2:
                results["failed"].append((op, "send/recv is measured with world 2"))
                continue
            for size in sizes:
                try:
                    fn = _call(op, size, world, rank, device)
                    for _ in range(warmup):
                        fn()
                    sync()
                    mine = []
                    for _ in range(iters):
                        dist.barrier()
                        start = time.perf_counter_ns()
                        fn()
                        sync()
                        mine.append(time.perf_counter_ns() - start)
                except RuntimeError as exc:   # the backend does not implement this op
                    results["failed"].append((op, str(exc).splitlines()[0][:200]))
                    break
                samples = torch.tensor(mine, dtype=torch.float64, device=device)
                dist.all_reduce(samples, op=dist.ReduceOp.MAX)   # an iteration ends with its slowest rank
                results["rows"].append((op, size, *summarize_samples(samples.cpu().tolist()), iters))
    finally:
        dist.barrier()
        if rank == 0:
            Path(result_path).write_text(json.dumps(results))
        dist.destroy_process_group()


def summarize_samples(samples: Sequence[float]) -> tuple[float, float, float]:
    """(time, p10, p90) of one row: the time is the samples' mean, as nccl-tests reports its average over
    iterations. A step adds up many collectives, so it pays their mean; on a shared CPU host a gloo
    collective's times are heavy-tailed (2-rank all-reduce of 32 KiB on the development VM: median 0.4 ms,
    p90 3.7 ms, mean 1.0-1.9 ms), and a median would leave their stalls out of every step."""
    values = sorted(samples)
    return statistics.fmean(values), _quantile(values, 0.1), _quantile(values, 0.9)


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def measure_collectives(world: int = 2, ops: Sequence[str] = DEFAULT_OPS, sizes: Sequence[int] = DEFAULT_SIZES,
                        backend: str = "gloo", warmup: int = 3, iters: int = 40) -> CollectiveRun:
    """Spawn ``world`` local ranks and time every op at every size (see the module docstring)."""
    import torch.multiprocessing as mp
    if world < 2:
        raise CollectiveError(f"measuring collectives needs at least 2 ranks, got {world}")
    if backend not in ("gloo", "nccl"):
        raise CollectiveError(f"backend must be gloo or nccl, got '{backend}'")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise CollectiveError(f"nccl with {world} ranks needs {world} GPUs, this machine has "
                              f"{torch.cuda.device_count()}")
    if any(s <= 0 for s in sizes):
        raise CollectiveError("collective sizes must be positive")
    names = tuple(canonical_op(op) for op in ops)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="boomfx-collectives-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, backend, os.path.join(tmp, "store"), names, tuple(sizes), warmup, iters,
                                result_path), nprocs=world, join=True)
        results = json.loads(Path(result_path).read_text())
    rows = tuple(CollectiveRow(op, size, world, world, "float32", mean, p10, p90, n)
                 for op, size, mean, p10, p90, n in results["rows"])
    return CollectiveRun(rows, backend, tuple(tuple(f) for f in results["failed"]), time.perf_counter() - start)


def collect_collectives(store: Any, world: int = 2, ops: Sequence[str] = DEFAULT_OPS,
                        sizes: Sequence[int] = DEFAULT_SIZES, backend: Optional[str] = None,
                        warmup: int = 3, iters: int = 40) -> CollectiveRun:
    """Measure (``measure_collectives``) and store the rows under this machine's fingerprint."""
    from boomfx.kernels_db.measure import current_fingerprint
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo")
    run = measure_collectives(world, ops, sizes, backend, warmup, iters)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    fingerprint = current_fingerprint(device)
    records = [record_of(row, fingerprint, f"measured:{backend}", backend) for row in run.rows]
    with store:
        store.put_many(records)
    return run
