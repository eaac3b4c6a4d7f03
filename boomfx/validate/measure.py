"""Measuring a real step the way a user runs it: the thread count torch uses, wall-clock time, the
allocator's peak, and the time of each op in situ (profiled inside the real step).

Time is the median of ``repeats`` wall-clock steps (``time.perf_counter``) after ``warmup`` steps,
with ``torch.cuda.synchronize`` around each step on a GPU. Peak memory is the peak above the step's
starting point: on a CPU the running sum of the profiler's ``[memory]`` events (the CPU allocator
has no counters; every allocation and free is an event, kernel scratch included), on a GPU
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` minus their values at the start.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from boomfx.kernels_db.calibration import op_class


@dataclass(frozen=True)
class MeasuredTime:
    median_ns: float
    samples_ns: tuple[float, ...]
    threads: int
    # this thread's CPU time per step (time.thread_time_ns): with one intra-op thread it excludes the
    # time other processes ran (the one-thread protocol of benchmarks/cpu_accuracy.py); with more it
    # misses the worker threads' work
    thread_median_ns: float = 0.0
    faults_per_step: float = 0.0        # the process's minor page faults per timed step, mean (getrusage)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median of the samples: how noisy the machine was."""
        s = sorted(self.samples_ns)
        lo, hi = s[len(s) // 10], s[min(len(s) - 1, (len(s) * 9) // 10)]
        return (hi - lo) / self.median_ns if self.median_ns else 0.0


@dataclass(frozen=True)
class MeasuredMemory:
    peak_above_start_bytes: int          # allocated (CPU: profiler running sum; GPU: max_memory_allocated)
    reserved_above_start_bytes: int | None = None   # GPU only (max_memory_reserved)
    source: str = "profiler"


@dataclass(frozen=True)
class OpTime:
    """In-situ time of one op class (an aten op name) in one profiled real step."""

    op: str
    time_ns: float
    calls: int


@dataclass(frozen=True)
class Profile:
    ops: tuple[OpTime, ...]
    step_ns: float                       # the profiled step's wall time (profiler overhead included)
    outside_ns: float                    # part of the step in no attributed op (Python, autograd, fused code)
    unmatched: tuple[str, ...] = field(default_factory=tuple)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], None], repeats: int, warmup: int, device: torch.device) -> MeasuredTime:
    """Median wall-clock time of ``repeats`` steps after ``warmup`` steps, and their mean minor page faults."""
    for _ in range(warmup):
        step()
    _sync(device)
    samples, thread, faults = [], [], []
    for _ in range(repeats):
        f0, c0, t0 = _minor_faults(), time.thread_time_ns(), time.perf_counter_ns()
        step()
        _sync(device)
        samples.append(float(time.perf_counter_ns() - t0))
        thread.append(float(time.thread_time_ns() - c0))
        faults.append(_minor_faults() - f0)
    return MeasuredTime(statistics.median(samples), tuple(samples), torch.get_num_threads(),
                        statistics.median(thread), statistics.mean(faults))


def _minor_faults() -> int:
    """This process's minor page faults so far (0 where ``resource`` is missing: not Unix)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_memory(step: Callable[[], None], device: torch.device) -> MeasuredMemory:
    """Peak bytes of one step above its starting point."""
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        start_alloc = torch.cuda.memory_allocated(device)
        start_reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return MeasuredMemory(torch.cuda.max_memory_allocated(device) - start_alloc,
                              torch.cuda.max_memory_reserved(device) - start_reserved, "cuda-allocator")
    from boomfx.memory.live_bytes import profiler_peak_bytes
    return MeasuredMemory(profiler_peak_bytes(step))


# what eager autograd calls directly for an op a traced graph holds (IndexBackward0 -> _index_put_impl_)
_EAGER_FORMS = {"_index_put_impl_": "index_put"}


def _as_predicted(name: str | None, known_ops: set[str]) -> str | None:
    """A profiled op class under the name the prediction holds: eager runs the in-place form (``index_put_``)
    or the implementation (``_index_put_impl_``) of a functional op a traced graph records."""
    if name is None or name in known_ops:
        return name
    for form in (_EAGER_FORMS.get(name), name[:-1] if name.endswith("_") else None):
        if form in known_ops:
            return form
    return name


def profile_ops(step: Callable[[], None], known_ops: set[str], device: torch.device) -> Profile:
    """Time of each op in one real step, at the level of the predicted kernels.

    The profiler nests ops (``aten::linear`` calls ``aten::t`` and ``aten::addmm``); the prediction
    prices whichever level its graph has (an export keeps ``linear``, a traced training step has
    ``addmm``). So the tree is walked from the top: an op whose name the prediction has is charged
    its whole (inclusive) time; any other op is charged only its self time and its children are
    walked. Names are aten op names without namespace and overload (``addmm``).
    """
    from torch.profiler import ProfilerActivity, profile

    from boomfx.kernels_db.measure import _stderr_fd_silenced
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _stderr_fd_silenced(), profile(activities=activities):
        step()          # the first profiled step pays the profiler's own start-up (ms per op class)
    gc.collect()
    with _stderr_fd_silenced(), profile(activities=activities) as prof:
        t0 = time.perf_counter_ns()
        step()
        _sync(device)
        step_ns = float(time.perf_counter_ns() - t0)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    times: dict[str, list[float]] = {}
    unmatched: set[str] = set()

    def charge(name: str, ns: float) -> None:
        slot = times.setdefault(name, [0.0, 0])
        slot[0] += ns
        slot[1] += 1

    def walk(e: torch.autograd.profiler_util.FunctionEvent) -> None:
        name = _as_predicted(op_name(e.name), known_ops)
        use_device = device.type == "cuda"
        total = (e.device_time_total if use_device else e.cpu_time_total) * 1e3
        if name is not None and name in known_ops:
            charge(name, total)
            return
        if name is not None:
            self_ns = (e.self_device_time_total if use_device else e.self_cpu_time_total) * 1e3
            if self_ns > 0:
                charge(name, self_ns)
                unmatched.add(name)
        for child in e.cpu_children:
            walk(child)

    for e in events:
        if e.cpu_parent is None:
            walk(e)
    attributed = sum(t for t, _ in times.values())
    ops = tuple(sorted((OpTime(k, t, int(n)) for k, (t, n) in times.items()), key=lambda o: -o.time_ns))
    return Profile(ops, step_ns, max(0.0, step_ns - attributed), tuple(sorted(unmatched)))


def op_name(text: str) -> str | None:
    """The op class of a profiler event or a predicted kernel (``kernels_db.calibration.op_class``: ``addmm``,
    ``transformers::grouped_mm_fallback``; None for profiler ranges and boomfx's fused kernels)."""
    return op_class(text)
