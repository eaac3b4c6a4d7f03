"""The step's schedule after pricing, in one place: what the host and device do beyond each kernel's price.

The priced kernels give one ``ScheduledKernel`` each (host issue time, device time). Four mechanisms then
change that schedule, always in this order:

1. ``--cudagraphs``: one graph replay issues every kernel (passes/compiled.py): the first kernel's host time is
   the replay cost, the others' zero.
2. cold starts (CPU targets, boomfx/analysis/host_time.py): a kernel run after one that streamed the L2 pays
   its evicted host code; an eager one also its dispatch after a different op and the aliasing ops before it,
   and an eager training step the autograd engine's work.
3. block mode (boomfx/analysis/block_mode.py): instances of blocks the database measured whole take that time.
4. graph entries (``--compile``, boomfx/analysis/host_time.py): dynamo's and AOTAutograd's host code before the
   compiled forward's and backward's first kernels, as host-only entries.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Container, Mapping, Optional

import sympy

from boomfx.analysis.block_mode import apply_block_measurements
from boomfx.analysis.host_time import with_autograd, with_cold_starts, with_eager_dispatch, with_graph_entries
from boomfx.kernels_db.blocks_db import SOURCE_BLOCK_MEASURED, BlockAnalysis
from boomfx.kernels_db.host_overheads import HostCosts
from boomfx.passes.compiled import CUDAGRAPH_REPLAY_HOST_NS
from boomfx.report.model import KernelReport
from boomfx.simulate.timeline import ScheduledKernel


@dataclass
class StepSchedule:
    """The kernels (report rows) and the schedule the simulator runs; ``entries`` are the indices of
    host-only graph entries in ``scheduled`` (no report row), ``cold_start_ns`` the cold starts added,
    ``eager_dispatch_ns`` the eager switches, aliasing ops, autograd engine and the distributed frameworks' host work."""

    kernels: list[KernelReport]
    scheduled: list[ScheduledKernel]
    entries: set[int]
    cold_start_ns: float
    eager_dispatch_ns: float = 0.0

    @property
    def graph_entry_ns(self) -> float:
        return sum(self.scheduled[i].host_ns + self.scheduled[i].device_ns for i in self.entries)


def schedule_step(kernels: list[KernelReport], scheduled: list[ScheduledKernel], *, analysis: BlockAnalysis,
                  db: Optional[str], bindings: Mapping[sympy.Symbol, int], costs: HostCosts, cpu: bool,
                  compiled: bool, train: bool, cudagraphs: bool, graph_inputs: int,
                  host_ops: Optional[list[int]] = None, autograd_nodes: int = 0,
                  framework_ns: Optional[list[float]] = None, native_loop: Container[str] = ()) -> StepSchedule:
    """Apply the four mechanisms of the module doc to the priced step; ``host_ops``: per kernel, the
    aliasing ops before it (``host_time.host_ops_before``; eager CPU steps); ``autograd_nodes``: the graph
    an eager training step's autograd builds (``host_time.autograd_nodes``); ``framework_ns``: per kernel, the
    distributed frameworks' host work charged to it (``host_time.framework_ns``); ``native_loop``: the nodes
    ATen's C++ loops issue (``host_time.native_loop_nodes``)."""
    if cudagraphs:
        scheduled = [dataclasses.replace(sk, host_ns=CUDAGRAPH_REPLAY_HOST_NS if i == 0 else 0.0)
                     for i, sk in enumerate(scheduled)]
    added = [0.0] * len(scheduled)
    dispatch = [0.0] * len(scheduled)
    if cpu:
        scheduled, added = with_cold_starts(kernels, scheduled, costs, compiled)
        if not compiled:
            scheduled, dispatch = with_eager_dispatch(kernels, scheduled, costs, host_ops or [0] * len(kernels),
                                                      framework_ns, native_loop)
            scheduled, engine = with_autograd(kernels, scheduled, costs, autograd_nodes)
            dispatch = [a + b for a, b in zip(dispatch, engine)]
    kernels, scheduled = apply_block_measurements(analysis, db, bindings, kernels, scheduled)
    cold_ns = sum(a for a, k in zip(added, kernels) if k.source != SOURCE_BLOCK_MEASURED)
    dispatch_ns = sum(a for a, k in zip(dispatch, kernels) if k.source != SOURCE_BLOCK_MEASURED)
    entries: set[int] = set()
    if compiled:
        scheduled, entries = with_graph_entries(kernels, scheduled, costs, train, graph_inputs, cpu)
    return StepSchedule(kernels, scheduled, entries, cold_ns, dispatch_ns)
