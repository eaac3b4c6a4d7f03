"""The shared measurer: time, host overhead and workspace of one keyed kernel, in isolation.

Every collector hands keys to ``Measurer.measure``; nothing else in boomfx runs real kernels.

CPU (``torch.device("cpu")``):
  1. Build inputs (``keys.make_inputs``), warm up until ``warmup_s`` has passed (at least 2 calls).
  2. Time with ``time.perf_counter_ns`` (monotonic). Ops faster than ``min_sample_ns`` are called
     ``inner`` times per sample and the sample is divided by ``inner`` (adaptive repeat for tiny ops).
     The number of samples adapts to ``target_s`` within ``[min_runs, max_runs]``; median, p10, p90.
     ``torch.set_flush_denormal(True)`` while timing: in-place ops called repeatedly must not drift
     into (100x slower) denormal arithmetic.
  3. Host overhead: on CPU issue and execution share one thread, so ``median_ns`` *includes* dispatch.
     We estimate the dispatch part as the time of the same call on one-element tensors
     (``keys.shrunk_key``), cached per structure; when that call is invalid (e.g. a ``view`` whose
     size argument no longer fits) we use the time of ``aten.add`` on one-element tensors, measured
     once per measurer. It is capped at ``median_ns``.
  4. Workspace: one extra call under ``torch.profiler`` with ``profile_memory=True`` (previous outputs
     freed first); the running sum of ``[memory]`` event bytes peaks at inputs' scratch + outputs and
     ends at outputs, so ``workspace = peak - end`` (facts.md).

CUDA:
  1. Same inputs on the GPU; warm-up; the number of runs adapts to ``target_s``.
  2. Device time between CUDA events around the op alone. Before each run an L2-sized buffer is
     zeroed when the op's inputs would otherwise stay L2-resident (inputs < 2 x L2): without it
     small kernels read from a warm cache a real step would not give them. The flush is queued before
     the start event, so it also hides the host launch latency of the timed kernel.
  3. Host overhead: ``perf_counter_ns`` around the Python call, without synchronize (launch cost).
  4. Workspace: ``max_memory_allocated - memory_allocated`` after one call with its outputs alive,
     peak stats reset just before the call (caching-allocator bytes, rounded as the allocator does).

Example::

    m = Measurer(torch.device("cpu"), target_s=0.01).measure(key)
    m.median_ns, m.host_ns, m.workspace_bytes

Known limitations:
- CUDA event timing adds ~1-2 us to kernels shorter than that; library workspaces that are allocated
  once per handle (cuBLAS) appear in the first (warm-up) call only, so they are not per-kernel here.
- The CPU workspace includes scratch of intra-op worker threads as the profiler sees it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from boomfx.kernels_db.keys import make_inputs, shrunk_key
from boomfx.kernels_db.schema import DeviceFingerprint, KernelKey, KernelRecord
from boomfx.kernels_db.store import device_slug

if TYPE_CHECKING:
    from boomfx.core.devices import DeviceSpec

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class Measurement:
    """What ``Measurer.measure`` found for one key; ``n_runs`` is the number of timed samples."""

    median_ns: float
    p10_ns: float
    p90_ns: float
    n_runs: int
    host_ns: float
    workspace_bytes: int
    source: str  # "measured:cpu" / "measured:cuda"

    def record(self, fingerprint: DeviceFingerprint, key: KernelKey) -> KernelRecord:
        return KernelRecord(
            fingerprint,
            key,
            self.median_ns,
            self.p10_ns,
            self.p90_ns,
            self.n_runs,
            self.host_ns,
            self.workspace_bytes,
            self.source,
        )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "quadro")


def registry_device_name(raw_name: str) -> Optional[str]:
    """The ``boomfx.devices`` name for a CUDA device name, or None: 'NVIDIA H100 80GB HBM3' -> 'h100-sxm'.

    Vendor words are dropped, then the longest dash-prefix the registry knows wins
    ('h100-80gb-hbm3' -> 'h100-80gb', an alias of 'h100-sxm'). Using the registry name in the
    fingerprint makes ``default_db_path`` and ``get_device`` agree with the DeviceSpec a user picks.
    """
    from boomfx.core.devices import UnknownDeviceError, get_device

    parts = [p for p in device_slug(raw_name).split("-") if p not in _VENDOR_WORDS]
    for end in range(len(parts), 0, -1):
        try:
            return get_device("-".join(parts[:end])).name
        except UnknownDeviceError:
            continue
    return None


def local_device_spec(device: torch.device) -> "DeviceSpec":
    """The registry spec of this machine's ``device`` (it decides e.g. which SDPA kernels a graph uses).

    Raises LookupError for a GPU the registry does not know.
    """
    from boomfx.core.devices import cpu_spec, get_device

    if device.type == "cpu":
        return cpu_spec()
    raw = torch.cuda.get_device_name(device)
    name = registry_device_name(raw)
    if name is None:
        raise LookupError(f"the local GPU '{raw}' is not in the device registry")
    return get_device(name)


def current_fingerprint(device: torch.device) -> DeviceFingerprint:
    """The fingerprint of measurements taken now, in this process, on ``device``."""
    host = platform.node()
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        driver = str(get_driver()) if get_driver is not None else ""
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        raw_name = torch.cuda.get_device_name(idx)
        settings = {"name": raw_name, "cc": f"{props.major}.{props.minor}", "cudnn": cudnn,
                    "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                    "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
        name = registry_device_name(raw_name) or raw_name
        return DeviceFingerprint(name, "cuda", torch.__version__, torch.version.cuda or "", driver, host,
                                 torch.get_num_threads(), json.dumps(settings, sort_keys=True))
    if device.type == "cpu":
        return DeviceFingerprint(
            "cpu", "cpu", torch.__version__, "", "", host, torch.get_num_threads(), _cpu_model()
        )
    return DeviceFingerprint(
        device.type, "other", torch.__version__, "", "", host, torch.get_num_threads(), ""
    )


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list (numpy's default method)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# A kernel whose single call is faster is timed batched (warm); a slower one one call per sample, each after
# the CPU cache flush when one is set (kernels_db/host_overheads.py: its price then holds a cold start).
MIN_SAMPLE_NS = 100_000


def summarize(samples_ns: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of timing samples."""
    ordered = sorted(samples_ns)
    return statistics.median(ordered), _quantile(ordered, 0.10), _quantile(ordered, 0.90)


class Measurer:
    """Measures keyed kernels one at a time on one device. Settings are plain arguments (no env reads)."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        warmup_s: float = 0.002,
        target_s: float = 0.02,
        min_runs: int = 5,
        max_runs: int = 200,
        min_sample_ns: float = MIN_SAMPLE_NS,
        measure_workspace: bool = True,
        flush_l2: bool = True,
        seed: int = 0,
        num_threads: Optional[int] = None,
        cpu_clock: str = "wall",
        cpu_flush_bytes: int = 0,
        clock: Optional[Callable[[], int]] = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("Measurer(cuda): torch.cuda.is_available() is False on this machine")
        self.warmup_ns = warmup_s * NS_PER_S
        self.target_ns = target_s * NS_PER_S
        self.min_runs, self.max_runs = min_runs, max_runs
        self.min_sample_ns = min_sample_ns
        self.measure_workspace = measure_workspace
        self.flush_l2 = flush_l2
        self.seed = seed
        self.num_threads = num_threads  # CPU intra-op threads while measuring; None = leave torch's setting
        # cpu-accuracy fix (benchmarks/cpu_accuracy.py): on a shared, oversubscribed host a wall-clock
        # sample of a kernel longer than a scheduler time slice includes time other processes ran, so
        # long kernels came out up to 2x slow. cpu_clock="thread" times samples with this thread's CPU
        # time (time.thread_time_ns), which excludes preemption; valid only with one intra-op thread
        # (worker threads' time would be missed), so it is refused otherwise.
        if cpu_clock not in ("wall", "thread"):
            raise ValueError(f"cpu_clock must be 'wall' or 'thread', got {cpu_clock!r}")
        self.cpu_clock = cpu_clock
        # cpu-accuracy fix (benchmarks/cpu_accuracy.py): in a real step an op's operands come from a cache
        # that the rest of the step (and other processes) keep evicting; a microbenchmark repeating
        # one call reads them hot, so kernels above ``min_sample_ns`` came out 1.3-2.5x fast (matmul
        # 1.3x, streaming pointwise/norm ops 2-2.5x on a 2-core VM). With cpu_flush_bytes > 0 a buffer of
        # that size is written before each single-call sample (outside the timed region), as the CUDA
        # path flushes L2; ``effective_cache_bytes()`` measures the size that makes a read cold.
        # Batched tiny ops (inner > 1) are left hot: their cost is dispatch, whose code is hot in a step.
        self.cpu_flush_bytes = int(cpu_flush_bytes)
        # the CPU sample clock (ns), injectable so tests can play a busy machine without loading the real one
        self.clock = clock
        self._cpu_flush: Optional[torch.Tensor] = None
        self._host_cache: dict[str, float] = {}
        self._fallback_host_ns: Optional[float] = None
        self._l2_buffer: Optional[torch.Tensor] = None

    @property
    def source(self) -> str:
        return f"measured:{self.device.type}"

    def fingerprint(self) -> DeviceFingerprint:
        with self._threads():
            return current_fingerprint(self.device)

    def _threads(self) -> "_NumThreads":
        return _NumThreads(self.num_threads)

    def measure(self, key: KernelKey) -> Measurement:
        """Time, host overhead and workspace of ``key``; raises whatever the op raises on bad inputs."""
        with self._threads():
            if self.device.type != "cuda":
                return self._measure_cpu(key)
            try:
                with torch.cuda.device(self.device):  # events and launches on the measured device
                    return self._measure_cuda(key)
            except Exception:
                self._recover_cuda()
                raise

    def _recover_cuda(self) -> None:
        """After a failed CUDA measurement: drain the queue and release cached blocks (an OOM must not
        starve the keys after it). A sticky device error cannot be recovered; the next key reports it."""
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except RuntimeError:
            pass

    # -- CPU -----------------------------------------------------------------------------------------------
    def _time_cpu(self, fn: Callable[[], object]) -> list[float]:
        """Samples (ns per call) of ``fn`` after warm-up; tiny ops are batched ``inner`` calls per sample."""
        clock = time.perf_counter_ns
        if self.cpu_clock == "thread":   # see __init__ (cpu-accuracy fix)
            if torch.get_num_threads() != 1:
                raise RuntimeError("Measurer(cpu_clock='thread') needs torch.get_num_threads() == 1")
            clock = time.thread_time_ns
        if self.clock is not None:
            clock = self.clock
        start = clock()
        calls = 0
        while calls < 2 or clock() - start < self.warmup_ns:
            fn()
            calls += 1
        t0 = clock()
        fn()
        single_ns = max(clock() - t0, 1)
        inner = max(1, math.ceil(self.min_sample_ns / single_ns))
        runs = int(min(self.max_runs, max(self.min_runs, self.target_ns // (single_ns * inner))))
        flush = self._cpu_flush_buffer() if inner == 1 and self.cpu_flush_bytes > 0 else None
        samples: list[float] = []
        for _ in range(runs):
            if flush is not None:   # cold operands, as in a real step (see __init__)
                flush.fill_(1.0)
            t0 = clock()
            for _ in range(inner):
                fn()
            samples.append((clock() - t0) / inner)
        return samples

    def _cpu_flush_buffer(self) -> torch.Tensor:
        if self._cpu_flush is None:
            self._cpu_flush = torch.empty(max(self.cpu_flush_bytes // 4, 1), dtype=torch.float32)
        return self._cpu_flush

    def _measure_cpu(self, key: KernelKey) -> Measurement:
        op, args, kwargs = make_inputs(key, self.device, self.seed)
        previous_denormal = torch.set_flush_denormal(True)
        try:
            samples = self._time_cpu(self.timed_call(op, args, kwargs))
            median, p10, p90 = summarize(samples)
            host = min(self._cpu_host_ns(key), median)
            workspace = self._cpu_workspace_bytes(op, args, kwargs) if self.measure_workspace else 0
        finally:
            torch.set_flush_denormal(previous_denormal)
        return Measurement(median, p10, p90, len(samples), host, workspace, self.source)

    @staticmethod
    def timed_call(op: torch._ops.OpOverload, args: list, kwargs: dict) -> Callable[[], object]:
        """What one timed CPU sample calls: the op through the dispatcher, as eager PyTorch calls it."""
        return lambda: op(*args, **kwargs)

    def _cpu_host_ns(self, key: KernelKey) -> float:
        tiny = shrunk_key(key)
        if tiny.key_hash not in self._host_cache:
            try:
                op, args, kwargs = make_inputs(tiny, self.device, self.seed)
                self._host_cache[tiny.key_hash] = summarize(self._time_cpu(lambda: op(*args, **kwargs)))[0]
            except Exception:  # noqa: BLE001 - the op rejects one-element inputs: use the calibrated dispatch
                self._host_cache[tiny.key_hash] = self._calibrated_host_ns()
        return self._host_cache[tiny.key_hash]

    def _calibrated_host_ns(self) -> float:
        if self._fallback_host_ns is None:
            a = torch.ones(1, device=self.device)
            b = torch.ones(1, device=self.device)
            add = torch.ops.aten.add.Tensor
            self._fallback_host_ns = summarize(self._time_cpu(lambda: add(a, b)))[0]
        return self._fallback_host_ns

    @staticmethod
    def _cpu_workspace_bytes(op: torch._ops.OpOverload, args: list, kwargs: dict) -> int:
        from torch.profiler import ProfilerActivity, profile

        with _stderr_fd_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = op(*args, **kwargs)
        del out
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        running = peak = 0
        for e in events:
            running += e.nbytes()
            peak = max(peak, running)
        # The output was still alive at profile exit, so `running` ends at the outputs' bytes.
        return int(max(peak - max(running, 0), 0))

    # -- CUDA (cannot run on the CPU-only development machine; guarded by torch.cuda.is_available) -------
    def _l2_flush_buffer(self) -> torch.Tensor:
        if self._l2_buffer is None:
            l2_bytes = (
                int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0)) or 64 * 2**20
            )
            self._l2_buffer = torch.empty(2 * l2_bytes, dtype=torch.int8, device=self.device)
        return self._l2_buffer

    def _measure_cuda(self, key: KernelKey) -> Measurement:
        op, args, kwargs = make_inputs(key, self.device, self.seed)
        flush = self._l2_flush_buffer()
        input_bytes = sum(_entry_bytes(t) for t in key.data["tensors"])
        do_flush = self.flush_l2 and input_bytes < flush.numel()  # flush buffer is 2 x L2
        sync = torch.cuda.synchronize
        # Warm-up (also triggers cuBLAS/cuDNN handle and workspace creation, lazily loaded modules).
        start_ns = time.perf_counter_ns()
        calls = 0
        while calls < 3 or time.perf_counter_ns() - start_ns < self.warmup_ns:
            op(*args, **kwargs)
            calls += 1
        sync()
        probe_start, probe_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        probe_start.record()
        op(*args, **kwargs)
        probe_end.record()
        sync()
        single_ns = max(probe_start.elapsed_time(probe_end) * NS_PER_MS, 1.0)
        runs = int(min(self.max_runs, max(self.min_runs, self.target_ns // single_ns)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        host: list[float] = []
        for i in range(runs):
            if do_flush:
                flush.zero_()
            starts[i].record()
            h0 = time.perf_counter_ns()
            op(*args, **kwargs)
            host.append(time.perf_counter_ns() - h0)
            ends[i].record()
            if i % 32 == 31:
                sync()  # keep the launch queue short so host times never include a full-queue stall
        sync()
        median, p10, p90 = summarize([s.elapsed_time(e) * NS_PER_MS for s, e in zip(starts, ends)])
        workspace = self._cuda_workspace_bytes(op, args, kwargs) if self.measure_workspace else 0
        return Measurement(median, p10, p90, runs, summarize(host)[0], workspace, self.source)

    def _cuda_workspace_bytes(self, op: torch._ops.OpOverload, args: list, kwargs: dict) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = op(*args, **kwargs)
        torch.cuda.synchronize(self.device)
        workspace = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        del out
        return int(max(workspace, 0))


def effective_cache_bytes(probe_bytes: int = 4 << 20, start_bytes: int = 4 << 20, max_bytes: int = 512 << 20,
                          tolerance: float = 1.1, repeats: int = 9) -> int:
    """The smallest flush-buffer size (doubling from ``start_bytes``) that makes reading a
    ``probe_bytes`` tensor more than ``tolerance`` slower than after a ``start_bytes`` flush: the knee
    of the cache this process effectively has, measured (cpu-accuracy fix, see
    ``Measurer(cpu_flush_bytes=)``). On the 2-core VM this was written on (it reports a 480 MiB L3,
    shared with other tenants) the knee was at 32 or 64 MiB, depending on the load (back-to-back
    searches on a busy day: 8, 32, 64, 64, 128 MiB; a benchmark that must be repeatable passes a fixed
    size instead)."""
    probe = torch.ones(probe_bytes // 4)

    def cold_read_ns(flush_bytes: int) -> float:
        buf = torch.empty(flush_bytes // 4)
        samples = []
        for _ in range(repeats):
            buf.fill_(1.0)
            t0 = time.perf_counter_ns()
            probe.sum()
            samples.append(time.perf_counter_ns() - t0)
        return statistics.median(samples)

    warm = cold_read_ns(start_bytes)
    size = start_bytes
    while size < max_bytes:
        size *= 2
        if cold_read_ns(size) > warm * tolerance:
            return size
    return size


@lru_cache(maxsize=None)
def l2_cache_bytes() -> int:
    """This core's private L2 size (sysfs, read once), 2 MiB if unknown."""
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                scale = {"K": 2**10, "M": 2**20}.get(text[-1], 1)
                return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 2 << 20


def step_flush_bytes(step_footprint_bytes: int, cache_bytes: int, l2_bytes: int) -> int:
    """The cache flush before each timed sample that leaves a kernel's operands about where a real step
    leaves them. A step reuses a tensor (a weight read in forward and again in backward, an activation
    saved for backward, a weight read again by the next inference step) after touching about its
    footprint of *other* bytes (its peak live bytes: parameters, optimizer state, activations; freed
    buffers are reused by the allocator): an LRU reuse distance. So flush that much, at least the core's
    private L2 and at most the cache this process effectively has (``effective_cache_bytes``; beyond it
    everything is cold anyway).

    Measured on the compiled CPU suite (dev VM, effective cache 64 MiB): steps with 11-30 MiB footprints
    but 80-165 MiB of traffic were 35-37% over when flushed like DRAM-cold (total traffic is the wrong
    distance: it counts re-reads of the same lines), and steps with 39-72 MiB footprints 8-35% under when
    flushed L2-only (the former binary rule: footprint below the knee -> L2)."""
    return max(min(l2_bytes, cache_bytes), min(step_footprint_bytes, cache_bytes))


PROTOCOL_MAX_FLUSH_BYTES = 128 << 20


def protocol_measurer(device: torch.device | str, kind: Optional[type["Measurer"]] = None) -> "Measurer":
    """The measurer ``boomfx kernels collect`` uses: the protocol the CPU accuracy benchmark validates.

    On CPU: operands of kernels >= ``min_sample_ns`` made cold before each timed sample by a flush the
    size of the cache this process effectively has (``effective_cache_bytes``, capped: under load the
    probe can run to its maximum); this thread's CPU time as the clock when one intra-op thread runs
    (it excludes time other processes ran), else wall time. CUDA: the defaults (CUDA events, L2
    flushed where a kernel's inputs fit in it).
    """
    device = torch.device(device)
    kind = kind or Measurer         # ``kernels_db.collect_fused.FusedMeasurer`` for compiled groups
    if device.type != "cpu":
        return kind(device)
    clock = "thread" if torch.get_num_threads() == 1 else "wall"
    flush = min(effective_cache_bytes(), PROTOCOL_MAX_FLUSH_BYTES)
    return kind(device, cpu_clock=clock, cpu_flush_bytes=flush)


@contextlib.contextmanager
def _stderr_fd_silenced() -> Iterator[None]:
    """Kineto writes a 'profiler_start/stop' line to fd 2 per profile, which would bury the progress bar
    (no setting turns it off in torch 2.13); point fd 2 at /dev/null for the profile, then restore it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w", encoding="utf-8") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _NumThreads:
    """Sets ``torch.set_num_threads`` for a block and restores it (the thread count is in the fingerprint)."""

    def __init__(self, num_threads: Optional[int]) -> None:
        self.num_threads = num_threads
        self.previous = 0

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


def _entry_bytes(entry: dict) -> int:
    numel = 1
    for s in entry["shape"]:
        numel *= s
    return numel * torch.empty((), dtype=getattr(torch, entry["dtype"]), device="meta").element_size()
