"""Where a step's host time outside its kernels' prices goes in the schedule.

Two terms, priced by ``kernels_db/host_overheads.py`` (measured rows of the database, else defaults):

- **cold starts** (CPU targets): the host code of a kernel run right after a kernel that streamed the
  L2 (dispatch, Inductor's wrapper) finds its caches evicted. Each kernel's time on the one CPU thread
  grows by ``HostCosts.cold_start_ns(bytes of the kernel before it, its price)``; the step is a loop, so
  an eager step's first kernel follows its last one.
- **graph entries** (``--compile``): dynamo's guards and AOTAutograd's wrappers before the forward's first
  kernel, and the backward graph's call and gradient hand-over before the backward's first kernel, as
  host-only entries (no kernel, no report row). On a CPU target they follow the step's last kernel (the
  step is a loop) and pay its cold fraction.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from boomfx.core.program import PHASE_BACKWARD
from boomfx.kernels_db.price import DATABASE_SOURCES
from boomfx.simulate.timeline import ScheduledKernel

_MEASURED = tuple(source.value for source in DATABASE_SOURCES)   # report sources priced from database rows


def with_cold_starts(kernels: Sequence[Any], scheduled: list[ScheduledKernel], costs: Any,
                     compiled: bool) -> tuple[list[ScheduledKernel], list[float]]:
    """``scheduled`` (index-aligned with ``kernels``, KernelReports) with each kernel's cold start added
    to its time on the CPU thread (never below zero), and what was added to each. A compiled step's
    first kernel follows the graph entry's own host code (warm), an eager step's the step's last kernel."""
    out: list[ScheduledKernel] = []
    added: list[float] = []
    for i, (kernel, sk) in enumerate(zip(kernels, scheduled)):
        extra = 0.0 if (i == 0 and compiled) else costs.cold_start_ns(
            kernels[i - 1].bytes_moved, kernel.time_ns, kernel.source in _MEASURED)
        device_ns = max(sk.device_ns + extra, 0.0)
        added.append(device_ns - sk.device_ns)
        out.append(dataclasses.replace(sk, device_ns=device_ns))
    return out, added


def with_graph_entries(kernels: Sequence[Any], scheduled: list[ScheduledKernel], costs: Any, train: bool,
                       graph_inputs: int, cpu: bool) -> tuple[list[ScheduledKernel], set[int]]:
    """``scheduled`` with the compiled graphs' entries inserted, and the indices of those entries."""
    if not kernels:
        return scheduled, set()
    first_backward = next((i for i, k in enumerate(kernels) if k.phase == PHASE_BACKWARD), None)
    before = kernels[-1].bytes_moved if cpu else 0.0      # the step is a loop: its last kernel came before
    forward_ns = costs.entry_ns(False, graph_inputs, before)
    at = {0: ("compiled forward call", forward_ns)}
    if train and first_backward is not None:
        # the training terms were measured for both calls together: what the forward's leave is the
        # backward's (on a CPU, where the cold terms are, the split does not change the step's time)
        at[first_backward] = ("compiled backward call", max(costs.entry_ns(True, graph_inputs, before) - forward_ns, 0.0))
    out: list[ScheduledKernel] = []
    entries: set[int] = set()
    for i, sk in enumerate(scheduled):
        if i in at:
            name, ns = at[i]
            entries.add(len(out))
            out.append(ScheduledKernel(name, 0.0 if cpu else ns, ns if cpu else 0.0))
        out.append(sk)
    return out, entries
