"""Step time of every rank class of a distributed analysis, and the ``--search`` evaluator built on it.

``class_steps(dist, bindings)`` takes anything shaped like ``DistributedAnalysis`` (``cfg`` with the mesh degrees
``dp_replicate``/``dp_shard``/``tp``/``pp``, ``nodes`` and ``world``; ``classes`` with their global ``ranks``;
``analyses``, one ``Analysis`` per class) and schedules each class's program on compute and communication
streams (``schedule_rank``), its collectives' groups resolved on the mesh of its first rank
(``mesh_groups``): the rank rewrites name groups by mesh dimension.

``plan_evaluator(build, bindings_for, ...)`` is the ``(plan) -> PlanResult`` that ``search`` calls: one
``build(program_key)`` per distinct per-rank program set (``ReusingEvaluator``), then per plan the bindings
of its micro-batch, every class scheduled, the slowest class's step, the largest per-GPU memory, and MFU.

Known limitations:
- Pipeline stages are scheduled as separate classes here (each its micro-batches back to back);
  ``DistributedAnalysis`` then places their passes with ``pipeline_step`` (``pipeline_time.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Optional, Protocol, Sequence

import sympy

from boomfx.distributed.mesh_groups import MESH_ORDER, mesh_groups
from boomfx.distributed.metrics import mfu
from boomfx.distributed.search import Plan, PlanResult, ReusingEvaluator
from boomfx.distributed.rank_schedule import CollectivePriceSource, RankStep, default_pricer, schedule_rank
from boomfx.kernels_db.collective_model import ClusterTopology
from boomfx.simulate.streams import OverlapSlowdown


class _RankClass(Protocol):
    ranks: tuple[int, ...]


class DistributedAnalysisLike(Protocol):
    cfg: Any
    classes: Sequence[_RankClass]
    analyses: Sequence[Any]


@dataclass(frozen=True)
class ClassStep:
    ranks: tuple[int, ...]
    step: RankStep


def topology_of(cfg: Any, network: Optional[str] = None) -> ClusterTopology:
    """The cluster of ``cfg``'s world; its network is ``cfg.network`` unless ``network`` is given."""
    return ClusterTopology(cfg.nodes, cfg.world // cfg.nodes, network or getattr(cfg, "network", "ib-ndr"))


def class_steps(dist: DistributedAnalysisLike, bindings: Mapping[sympy.Symbol, int], network: Optional[str] = None,
                pricer: Optional[CollectivePriceSource] = None,
                slowdown: Optional[OverlapSlowdown] = None,
                points: Optional[Sequence[Any]] = None) -> list[ClassStep]:
    """Each rank class's simulated step (see the module docstring); ``points``: each class's
    ``Analysis.evaluate(bindings)`` when the caller has them (else evaluated here)."""
    topology = topology_of(dist.cfg, network)
    degrees = {name: int(getattr(dist.cfg, name)) for name in MESH_ORDER}
    if pricer is None and dist.analyses:
        pricer = default_pricer(dist.analyses[0])
    out = []
    for i, (rc, analysis) in enumerate(zip(dist.classes, dist.analyses)):
        groups = mesh_groups(degrees, rc.ranks[0], topology)
        point = points[i] if points is not None else None
        out.append(ClassStep(tuple(rc.ranks), schedule_rank(analysis, bindings, groups, pricer, slowdown, point)))
    return out


def time_report(steps: Sequence[ClassStep]) -> list[dict[str, Any]]:
    """Per rank class, what ``report.parallel`` shows of its time: the streams step, exposed, hidden and
    critical-path communication, and each collective with its price and where the price came from."""
    out = []
    for cls in steps:
        step, rank = cls.step, cls.step.timeline.ranks[0]
        out.append({
            "ranks": list(cls.ranks), "step_time_ns": step.step_ns,
            "single_stream_ns": step.point.report.time.total_ns,
            "exposed_comm_ns": rank.exposed_comm_ns, "hidden_comm_ns": rank.hidden_comm_ns,
            "comm_cost_ns": step.communication_cost_ns(), "overlap_slowdown": step.timeline.slowdown.factor,
            "collectives": [{"node": c.node, "op": c.op, "group": c.group, "group_size": c.group_size,
                             "message_bytes": c.message_bytes,
                             "time_ns": c.price.time_ns, "source": c.price.source.value,
                             "algorithm": c.price.algorithm, "protocol": c.price.protocol}
                            for c in step.collectives]})
    return out


def plan_evaluator(build: Callable[[Hashable], DistributedAnalysisLike],
                   bindings_for: Callable[[DistributedAnalysisLike, Plan], Mapping[sympy.Symbol, int]],
                   flops_per_step: Callable[[Plan], float], peak_flops_per_s: float, network: Optional[str] = None,
                   pricer: Optional[CollectivePriceSource] = None) -> ReusingEvaluator:
    """The search's evaluator over real per-rank analyses (module docstring)."""

    def evaluate(dist: DistributedAnalysisLike, plan: Plan) -> PlanResult:
        steps = class_steps(dist, bindings_for(dist, plan), network, pricer)
        time_ns = max(s.step.step_ns for s in steps)
        memory = [s.step.point.report.memory for s in steps]
        return PlanResult(time_ns, max(m.total_device_bytes for m in memory), all(m.fits for m in memory),
                          mfu(flops_per_step(plan), time_ns, plan.world, peak_flops_per_s))

    return ReusingEvaluator(build, evaluate)
