"""A pipeline-parallel step: per-stage, per-micro-batch forward and backward costs through
``boomfx/simulate/pipeline.py``, each stage boundary's send priced by the collective model.

A stage's costs come from its rank program evaluated at the micro-batch's sizes (``stage_costs_from_point``:
the device time of its forward-phase kernels, of its backward and recompute kernels, and of its optimizer
step, which runs once per step after the pipeline flushes). The activation a stage hands on (and the
gradient that comes back, the same shape) is ``boundary_bytes`` per micro-batch; its transfer is a
``send_recv`` between the two stages' ranks (``price_collective("send", ...)``: one link, or the network
when the stages sit on different nodes).

Example::

    >>> costs = [StageCompute(1e6, 2e6, 0.0, 1 << 20)] * 4                         # doctest: +SKIP
    >>> step = pipeline_step("1f1b", costs, 8, stage_ranks=[0, 8, 16, 24], topology=ClusterTopology(4, 8),
    ...                      device=get_device("h100-sxm"))
    >>> step.total_ns, step.timeline.bubble_fraction

Known limitations:
- A stage's forward and backward per micro-batch are its kernels' device time summed (no host-bound
  stages, no overlap of its own data-parallel collectives: schedule those with ``schedule_rank``).
- Sends overlap compute and never queue (``pipeline.py``'s limitation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from boomfx.analysis.analysis import PointResult
from boomfx.core.devices import DeviceSpec
from boomfx.core.errors import OptionError
from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, PHASE_RECOMPUTE
from boomfx.kernels_db.collective_model import SEND_RECV, ClusterTopology, CollectiveGroup
from boomfx.kernels_db.collectives import CollectivePricer
from boomfx.simulate.pipeline import PipelineTimeline, StageCosts, simulate_pipeline


@dataclass(frozen=True)
class StageCompute:
    """One virtual stage per micro-batch: forward, backward (with recompute), the step's optimizer, boundary."""

    forward_ns: float
    backward_ns: float
    optimizer_ns: float
    boundary_bytes: int          # activation handed to the next stage (the gradient back is the same size)


@dataclass(frozen=True)
class PipelineStep:
    timeline: PipelineTimeline
    send_ns: tuple[float, ...]            # per virtual stage: its output's transfer to the next (0 for the last)
    stage_end_ns: tuple[float, ...]       # per physical stage: last backward + its optimizer step
    send_sources: tuple[str, ...] = ()    # per virtual stage: where its send's price came from ("" for the last)
    send_bytes: tuple[int, ...] = ()      # per virtual stage: the activation it sends per micro-batch

    @property
    def total_ns(self) -> float:
        return max(self.stage_end_ns)

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction


def stage_costs_from_point(point: PointResult, boundary_bytes: int) -> StageCompute:
    """A stage's per-micro-batch costs from its rank program evaluated at one micro-batch."""
    spans = {s.name: s.end_ns - s.start_ns for s in point.timeline.spans}
    by_phase = {PHASE_FORWARD: 0.0, PHASE_BACKWARD: 0.0, PHASE_OPTIMIZER: 0.0}
    for k in point.report.kernels:
        phase = PHASE_BACKWARD if k.phase == PHASE_RECOMPUTE else k.phase
        by_phase[phase] = by_phase.get(phase, 0.0) + spans.get(k.node, k.time_ns)
    return StageCompute(by_phase[PHASE_FORWARD], by_phase[PHASE_BACKWARD], by_phase[PHASE_OPTIMIZER],
                        int(boundary_bytes))


def pipeline_step(schedule: str, stages: Sequence[StageCompute], microbatches: int, stage_ranks: Sequence[int],
                  topology: ClusterTopology, device: DeviceSpec, chunks: int = 1,
                  pricer: Optional[CollectivePricer] = None, dtype: Optional[str] = None,
                  send_slowdown: float = 1.0) -> PipelineStep:
    """Simulate ``schedule`` over ``stages`` (virtual stages in model order, ``len(stage_ranks) * chunks``);
    ``stage_ranks[s]`` is a global rank of physical stage s (its peer in the next stage's group). ``pricer``:
    the database's collective rows (a measured ``send_recv`` at the boundary's size), else the model;
    ``send_slowdown``: each send that many times its price (gloo's threads on a CPU host whose cores more
    ranks share than a measurement had: ``cpu_core_sharing``'s base)."""
    p = len(stage_ranks)
    if p * chunks != len(stages):
        raise OptionError(f"{len(stages)} stage costs for {p} stages x {chunks} chunks")
    pricer = pricer if pricer is not None else CollectivePricer(None, device)
    sends: list[float] = []
    sources: list[str] = []
    for k, stage in enumerate(stages):
        if k == len(stages) - 1 or p == 1:
            sends.append(0.0)
            sources.append("")
            continue
        here, there = stage_ranks[k % p], stage_ranks[(k + 1) % p]
        group = CollectiveGroup((here, there), topology)
        price = pricer.price(SEND_RECV, stage.boundary_bytes, group, dtype)
        sends.append(price.time_ns * send_slowdown)
        sources.append(price.source.value)
    costs = [StageCosts(s.forward_ns, s.backward_ns, send) for s, send in zip(stages, sends)]
    timeline = simulate_pipeline(schedule, costs, microbatches, chunks)
    ends = [0.0] * p
    for placed in timeline.passes:
        ends[placed.stage] = max(ends[placed.stage], placed.end_ns)
    optimizer = [0.0] * p
    for k, stage in enumerate(stages):
        optimizer[k % p] += stage.optimizer_ns
    return PipelineStep(timeline, tuple(sends), tuple(e + o for e, o in zip(ends, optimizer)), tuple(sources),
                        tuple(int(s.boundary_bytes) for s in stages))
