"""The step of a pipeline-parallel run: every stage's per-micro-batch costs through ``pipeline_step``.

A stage program (``pipeline_stages.py``) holds all M micro-batches of its stage in schedule order;
evaluated once, its forward-phase kernels divided by M are one micro-batch's forward on that stage,
likewise its backward (its own ``send``/``recv_`` nodes left out: their transfer is the send price
``pipeline_step`` adds between stages; its TP / DP collectives at the collective model's price, in
line), and its optimizer runs once. ``pipeline_step`` then places
every pass as the schedule does (``boomfx/simulate/pipeline.py``), so each stage's step includes
the bubble: the time it waits for the stage before it in forward and after it in backward.

On a CPU host with fewer cores than the ranks' compute threads (4 one-thread gloo ranks on 2 cores) every
stage's costs and every send are ``cpu_core_sharing``'s ``base`` times their price (processor sharing; taken
for every pass, though a stage waiting in the bubble leaves its share of the cores to the others).

Known limitations: ``pipeline_step``'s (one stream per stage, sends that never queue).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from boomfx.analysis.analysis import PointResult
from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, PHASE_RECOMPUTE
from boomfx.distributed.p2p import NAMESPACE
from boomfx.distributed.pipeline_stages import META_CHUNK
from boomfx.distributed.pipeline_step import PipelineStep, StageCompute, pipeline_step
from boomfx.distributed.rank_schedule import default_pricer, default_slowdown
from boomfx.distributed.step_time import topology_of
from boomfx.kernels_db.collectives import CollectivePricer

SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved"}


def stage_compute(point: PointResult, microbatches: int, boundary_bytes: int,
                  collective_ns: Optional[Mapping[str, float]] = None,
                  member: Optional[Callable[[str], bool]] = None, with_optimizer: bool = True,
                  weights: Optional[Mapping[str, float]] = None) -> StageCompute:
    """One micro-batch's forward and backward on a stage, and its optimizer step, from its program's point.
    ``collective_ns``: the collective model's price of each of the stage's TP / DP collectives by node
    (``schedule_rank``'s), which replaces the single-device kernel estimate; they run in line with the
    stage's passes (TP's all-reduces block the next op; DDP's bucket is counted, not overlapped).
    ``member``: only the forward / backward kernels of these nodes (one chunk of an interleaved rank);
    ``with_optimizer``: count the rank's optimizer step here; ``weights``: how many times each node runs
    (a replayed template stage, ``pipeline_compose.py``; else once)."""
    spans = {s.name: s.end_ns - s.start_ns for s in point.timeline.spans}
    spans.update(collective_ns or {})
    by_phase = {PHASE_FORWARD: 0.0, PHASE_BACKWARD: 0.0, PHASE_OPTIMIZER: 0.0}
    for k in point.report.kernels:
        if k.op.startswith(NAMESPACE):
            continue
        phase = PHASE_BACKWARD if k.phase == PHASE_RECOMPUTE else k.phase
        if phase == PHASE_OPTIMIZER and not with_optimizer:
            continue
        if phase != PHASE_OPTIMIZER and member is not None and not member(k.node):
            continue
        weight = weights.get(k.node, 1.0) if weights is not None else 1.0
        by_phase[phase] = by_phase.get(phase, 0.0) + spans.get(k.node, k.time_ns) * weight
    return StageCompute(by_phase[PHASE_FORWARD] / microbatches, by_phase[PHASE_BACKWARD] / microbatches,
                        by_phase[PHASE_OPTIMIZER], int(boundary_bytes))


def boundary_bytes(program: Any, ev: Any, chunk: Optional[int] = None) -> int:
    """Bytes of the activation a stage (or its chunk ``chunk``) sends per micro-batch (0 on the last)."""
    from boomfx.distributed.p2p import is_p2p
    from boomfx.passes.liveness import _compute_nbytes

    for node in program.graph.nodes:
        if is_p2p(node) and node.target.__name__.startswith("send") and program.phase_of(node) == PHASE_FORWARD \
                and (chunk is None or node.meta.get(META_CHUNK) == chunk):
            return int(ev(_compute_nbytes(node.args[0].meta["val"])))
    return 0


def _interleaved_costs(dist: Any, points: Sequence[PointResult], bindings: Any,
                       priced: Sequence[Mapping[str, float]]) -> list[StageCompute]:
    """Interleaved 1F1B: each virtual stage's costs from the chunk its nodes carry (``META_CHUNK``); nodes
    of no chunk (``scale_grads``, ``_merge_outputs``) count with the rank's first chunk, its optimizer too."""
    cfg = dist.cfg
    pp, v, m = cfg.pp, cfg.stages_per_rank, cfg.num_microbatches
    costs: list[Optional[StageCompute]] = [None] * (pp * v)
    for s, (rc, analysis, point, prices) in enumerate(zip(dist.classes, dist.analyses, points, priced)):
        chunks = [c * pp + s for c in range(v)]
        chunk_of = {n.name: n.meta.get(META_CHUNK, chunks[0]) for n in rc.program.graph.nodes}
        ev = analysis.evaluator(bindings)
        for k in chunks:
            costs[k] = stage_compute(point, m, boundary_bytes(rc.program, ev, k), prices,
                                     member=lambda name, k=k: chunk_of.get(name, chunks[0]) == k,
                                     with_optimizer=k == chunks[0])
    return [c for c in costs if c is not None]


def pipeline_run(dist: Any, points: Sequence[PointResult], bindings: Any, steps: Sequence[Any] = (),
                 weights: Optional[Sequence[Mapping[str, float]]] = None,
                 pricer: Optional[CollectivePricer] = None) -> PipelineStep:
    """The pipeline step of ``dist`` (a DistributedAnalysis of pp stage classes) from its classes' points;
    ``steps``: their ``class_steps`` (``ClassStep``), whose priced collectives the stages' costs use;
    ``weights``: per class, how many times each node runs (replayed template stages); ``pricer``: the one
    that priced ``steps`` (the stage sends: measured send_recv rows, else the model), else the ``--db``'s."""
    cfg = dist.cfg
    m = cfg.num_microbatches
    priced = [{c.node: c.price.time_ns for c in step.step.collectives} for step in steps] or [{}] * len(points)
    base = default_slowdown(dist.analyses[0], cfg.gpus_per_node_or_product).base   # oversubscribed CPU host
    pricer = pricer if pricer is not None else default_pricer(dist.analyses[0])
    if cfg.stages_per_rank > 1:
        return pipeline_step(SCHEDULE_NAMES[cfg.pp_schedule],
                             _shared(_interleaved_costs(dist, points, bindings, priced), base), m,
                             [rc.ranks[0] for rc in dist.classes], topology_of(cfg), dist.device,
                             chunks=cfg.stages_per_rank, pricer=pricer, send_slowdown=base)
    weights = weights or [None] * len(points)
    costs = [
        stage_compute(point, m, boundary_bytes(rc.program, analysis.evaluator(bindings)), prices, weights=w)
        for rc, analysis, point, prices, w in zip(dist.classes, dist.analyses, points, priced, weights)
    ]
    return pipeline_step(SCHEDULE_NAMES[cfg.pp_schedule], _shared(costs, base), m,
                         [rc.ranks[0] for rc in dist.classes], topology_of(cfg), dist.device, pricer=pricer,
                         send_slowdown=base)


def _shared(costs: Sequence[StageCompute], base: float) -> list[StageCompute]:
    """Each stage's costs ``base`` times slower (the host's cores shared by more compute threads)."""
    if base == 1.0:
        return list(costs)
    return [StageCompute(c.forward_ns * base, c.backward_ns * base, c.optimizer_ns * base, c.boundary_bytes)
            for c in costs]
