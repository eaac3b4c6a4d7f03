"""Scheduler: the host thread issues kernels in program order; each GPU stream runs them in order.

A kernel starts at ``max(stream free, host issue time)`` and the host moves on as soon as it has
issued it, so small batches come out host-bound and large ones device-bound (the rule of the BOOM
prototype, ``T = max(T, cpu_time) + gpu_time``). A host sync (``.item()``, a data-dependent shape)
makes the host wait for the stream. On a CPU device ops run synchronously and their measured
times already include dispatch, so the step time is their sum.

Pure function: no clocks, no randomness, no environment; the same inputs give the same timeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ScheduledKernel:
    """One unit of work to schedule: host issue cost and device time, in ns."""

    name: str
    host_ns: float
    device_ns: float
    stream: int = 0
    host_sync: bool = False     # the host waits for the stream to drain after issuing this op


@dataclass(frozen=True)
class KernelSpan:
    name: str
    issue_start_ns: float
    issue_end_ns: float
    start_ns: float
    end_ns: float
    stream: int


@dataclass(frozen=True)
class Timeline:
    spans: tuple[KernelSpan, ...]
    total_ns: float
    host_busy_ns: float
    device_busy_ns: float

    @property
    def host_bound_fraction(self) -> float:
        """Share of the step during which the device sat idle waiting for the host."""
        if self.total_ns <= 0:
            return 0.0
        return max(0.0, 1.0 - self.device_busy_ns / self.total_ns)


def simulate(kernels: Sequence[ScheduledKernel], synchronous: bool = False) -> Timeline:
    """Simulate one step. ``synchronous=True`` (CPU devices): each op runs on the host, no overlap."""
    host_t = 0.0
    stream_free: dict[int, float] = {}
    spans: list[KernelSpan] = []
    host_busy = 0.0
    device_busy = 0.0
    for k in kernels:
        issue_start = host_t
        if synchronous:
            start = host_t
            end = start + k.device_ns
            host_t = end
            spans.append(KernelSpan(k.name, issue_start, end, start, end, k.stream))
            host_busy += k.device_ns
            device_busy += k.device_ns
            continue
        host_t += k.host_ns
        host_busy += k.host_ns
        free = stream_free.get(k.stream, 0.0)
        start = max(free, host_t)
        end = start + k.device_ns
        if k.device_ns > 0:
            stream_free[k.stream] = end
            device_busy += k.device_ns
        spans.append(KernelSpan(k.name, issue_start, host_t, start, end, k.stream))
        if k.host_sync:
            host_t = max(host_t, max(stream_free.values(), default=0.0))
    total = max([host_t] + list(stream_free.values()))
    return Timeline(tuple(spans), total, host_busy, device_busy)
