"""Ground truth for memory: the peak of live tensor-storage bytes in a *real* run, at the tensor level.

Every storage an op creates is seen by a dispatch mode when it appears as an op output, and its
free is seen through a weakref to the (identity-preserved) Python storage object. Scratch memory
that kernels allocate internally never appears as an op output, so it is not counted (that is what
the kernel database's workspace measurement adds). Used by tests and benchmarks to check the
liveness pass against reality, never inside predictions.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class LiveBytesResult:
    peak_bytes: int          # peak live bytes, including the storages alive when tracking started
    baseline_bytes: int      # bytes of the storages passed in as arguments (resident)
    output: Any


class _StorageTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, weakref.ref] = {}

    def track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        ref = self._seen.get(key)
        if ref is not None and ref() is not None:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)

        def on_free(_ref: Any, key: int = key, size: int = size) -> None:
            self.live -= size
            self._seen.pop(key, None)

        self._seen[key] = weakref.ref(storage, on_free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t.untyped_storage())
        return out


def measure_live_bytes(fn: Callable[..., Any], *args: Any) -> LiveBytesResult:
    """Run ``fn(*args)`` on real tensors and return the peak of live storage bytes (arguments included)."""
    tracker = _StorageTracker()
    for t in tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            tracker.track(t.untyped_storage())
    baseline = tracker.live
    with tracker:
        out = fn(*args)
    return LiveBytesResult(tracker.peak, baseline, out)


class _NodeLevelInterpreter(torch.fx.Interpreter):
    """Runs a graph node by node, registering the storages each node *returns* (not the temporaries
    an op creates and drops inside itself, e.g. the math path of a composite attention op)."""

    def __init__(self, gm: torch.fx.GraphModule, tracker: _StorageTracker) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.tracker = tracker

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.tracker.track(t.untyped_storage())
        return out


def measure_graph_live_bytes(gm: torch.fx.GraphModule, *args: Any) -> LiveBytesResult:
    """Peak live bytes of the storages that the graph's nodes produce, running ``gm`` for real.

    This is the level the liveness pass works at: one fx node is one unit, and memory an op uses
    only inside itself is kernel scratch (measured by the kernel database, not here).
    """
    tracker = _StorageTracker()
    for t in tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            tracker.track(t.untyped_storage())
    baseline = tracker.live
    out = _NodeLevelInterpreter(gm, tracker).run(*args)
    return LiveBytesResult(tracker.peak, baseline, out)


def profiler_peak_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Allocator-level peak of one ``fn(*args)`` call, above its starting point: the running sum of
    the profiler's ``[memory]`` events (allocations positive, frees negative), in start-time order.

    Unlike the dispatch-level measurements above, this sees everything the CPU allocator hands out,
    kernel scratch included.
    """
    from torch.profiler import ProfilerActivity, profile

    from boomfx.kernels_db.measure import _stderr_fd_silenced
    gc.collect()
    with _stderr_fd_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak
