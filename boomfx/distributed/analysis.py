"""Per-rank analysis: each rank class's program through the usual passes, liveness and allocator replay.

``DistributedAnalysis(program, cfg, device)`` rewrites the training program into one program per
rank class (``ranks.rank_programs``) and keeps one ``Analysis`` per class, so a sweep or a
``--max-batch`` search re-evaluates without re-tracing. ``evaluate(bindings)`` returns the Report of
one rank (the worst by default, ``rank=`` another), with ``report.parallel`` holding every class:
its ranks, peak live / allocated / reserved memory, fit verdict, step time and the collectives it
issues with their sizes.

Batch: the bindings are per rank (``--batch`` is each data-parallel rank's batch); the global batch
is ``batch x dp_replicate x dp_shard``.

Known limitations:
- NCCL's channel buffers outside the caching allocator are a measured-typical amount per
  communicator the rank joins (nccl_memory.py; ``--outside-memory nccl=`` replaces it). gloo's
  output-sized temporary inside an all-gather is (``backend="gloo"``: an
  ``aten.empty`` held during each FSDP all-gather, fsdp.py ``ShardSpec.all_gather_scratch``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

import sympy
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions, PointResult
from boomfx.core.devices import DeviceSpec
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import RankClass, rank_programs
from boomfx.core.errors import OptionError
from boomfx.core.program import Program

_C10D_NAMESPACE = "_c10d_functional"
_P2P_NAMESPACE = "boomfx_pp"  # pipeline stages' send / recv_ (boomfx/distributed/p2p.py)


@dataclass
class CollectiveReport:
    op: str  # e.g. "all_gather_into_tensor_out"
    group: str  # mesh dimension: dp_shard, dp_replicate, tp, pp
    input_bytes: int
    output_bytes: int
    phase: str
    module: str
    dtype: str = ""  # the input's ("bfloat16": FSDP mixed precision's all-gathers)


@dataclass
class RankClassReport:
    ranks: list[int]
    description: str
    peak_live_bytes: int
    resident_bytes: int
    peak_allocated_bytes: Optional[int]  # CUDA targets: the caching-allocator replay
    peak_reserved_bytes: Optional[int]
    total_device_bytes: int
    fits: bool
    step_time_ns: float
    collectives: list[CollectiveReport] = field(default_factory=list)


@dataclass
class ParallelReport:
    config: dict[str, Any]
    world: int
    batch_per_rank: Optional[int]
    global_batch: Optional[int]
    micro_batch: Optional[int]
    worst_rank: int
    shown_rank: int
    classes: list[RankClassReport]
    # per rank class, the step on compute and communication streams (boomfx/distributed/step_time.py:
    # time_report): exposed / hidden communication and every collective with its price and provenance
    time_by_class: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DistributedAnalysis:
    """One ``Analysis`` per rank class of ``program`` under ``cfg``."""

    def __init__(
        self,
        program: Program,
        cfg: ParallelConfig,
        device: DeviceSpec,
        options: AnalyzeOptions = AnalyzeOptions(),
        reuse_blocks: bool = True,
        replay_microbatches: bool = False,
    ) -> None:
        """``replay_microbatches``: pipeline stage programs are built with three micro-batches and replayed
        for the config's count (``pipeline_compose.py``; what ``--search`` evaluates, any micro-batch count
        sharing one build); where the replay does not apply, they are built whole."""
        self.program = program
        self.cfg = cfg
        self.device = device
        from boomfx.distributed.model_shape import model_shape
        from boomfx.distributed.pipeline_compose import TEMPLATE_MICROBATCHES, ComposeError, composable
        from boomfx.distributed.plan import check_against_model

        check_against_model(cfg, model_shape(program, cfg))
        if device.kind == "cuda":   # every communicator's channel buffers, outside the allocator
            from dataclasses import replace

            from boomfx.distributed.nccl_memory import with_nccl_memory

            options = replace(options, outside_memory=with_nccl_memory(options.outside_memory, cfg))
        self._replays: dict[int, list[Any]] = {}
        # step_liveness under gradient accumulation (any M); a dict, so a search's shallow copies share it
        self._accumulating: dict[str, list[Any]] = {}
        self.replayed = replay_microbatches and composable(cfg)
        if self.replayed:
            self._build(options, reuse_blocks, TEMPLATE_MICROBATCHES)
            try:
                self.replays()
            except ComposeError:
                self.replayed = False
        if not self.replayed:
            self._build(options, reuse_blocks, None)

    def _build(self, options: AnalyzeOptions, reuse_blocks: bool, copies: Optional[int]) -> None:
        self.classes: list[RankClass] = rank_programs(self.program, self.cfg, pipeline_copies=copies)
        self.analyses = [
            Analysis(rc.program, self.device, options, reuse_blocks=reuse_blocks) for rc in self.classes
        ]

    def replays(self) -> list[Any]:
        """Each stage's ``StageReplay`` for the config's micro-batch count (``replay_microbatches``)."""
        from boomfx.distributed.pipeline_compose import replay_stage

        m = self.cfg.num_microbatches
        if m not in self._replays:
            self._replays[m] = [replay_stage(a.program, a.liveness, self.cfg.pp_schedule, m) for a in self.analyses]
        return self._replays[m]

    def step_liveness(self) -> list[Any]:
        """Each class's liveness of the whole step, the one ``evaluate`` reports memory from: a replayed
        stage's (``pipeline_compose``); under gradient accumulation the later micro-batches'
        (``accumulation.py``), every gradient alive from their start."""
        if self.replayed:
            return [r.liveness for r in self.replays()]
        if self.cfg.accumulation_steps > 1:   # the same for every M: kept
            if "later" not in self._accumulating:
                from boomfx.distributed.accumulation import accumulating_liveness

                self._accumulating["later"] = [accumulating_liveness(a.liveness, a.program) for a in self.analyses]
            return self._accumulating["later"]
        return [a.liveness for a in self.analyses]

    def class_of(self, rank: int) -> int:
        for i, rc in enumerate(self.classes):
            if rank in rc.ranks:
                return i
        raise OptionError(f"--rank {rank}: the world has ranks 0..{self.cfg.world - 1}")

    def evaluate(
        self,
        bindings: Mapping[sympy.Symbol, int],
        rank: Optional[int] = None,
        record_trace: bool = False,
        memory_only: bool = False,
        replay_allocator: bool = True,
        exact_total: Optional[bool] = None,
    ) -> PointResult:
        """``exact_total``: as ``Analysis.evaluate`` takes it (False: an out-of-memory rank's total is what
        the capped replay reached, enough to say it does not fit)."""
        per_rank = bindings
        bindings = self.program_bindings(bindings)
        if self.replayed:
            from boomfx.distributed.pipeline_compose import replayed_point

            points = [replayed_point(a, r, bindings, record_trace, memory_only, replay_allocator, exact_total)
                      for a, r in zip(self.analyses, self.replays())]
        else:
            points = [
                a.evaluate(bindings, record_trace=record_trace, memory_only=memory_only,
                           replay_allocator=replay_allocator, exact_total=exact_total)
                for a in self.analyses
            ]
        accumulate = self.cfg.accumulation_steps
        if accumulate > 1:   # later micro-batches hold every gradient from their start (accumulation.py)
            from boomfx.distributed.accumulation import accumulated_memory, collective_weights

            for a, p, info in zip(self.analyses, points, self.step_liveness()):
                p.report.memory = accumulated_memory(a, bindings, replay_allocator,
                                                     not memory_only if exact_total is None else exact_total, info)
        weights = [r.node_weights for r in self.replays()] if self.replayed else [None] * len(points)
        if accumulate > 1:
            weights = [collective_weights(a.program, accumulate) for a in self.analyses]
        reports = [
            self._class_report(rc, a, p, bindings, w)
            for rc, a, p, w in zip(self.classes, self.analyses, points, weights)
        ]
        worst = max(range(len(reports)), key=lambda i: (reports[i].total_device_bytes, -reports[i].ranks[0]))
        shown = self.class_of(rank) if rank is not None else worst
        point = points[shown]
        batch = self._batch(per_rank)
        split = self.cfg.pp > 1 or accumulate > 1
        micro = batch // self.cfg.num_microbatches if batch is not None and split else None
        time_rows: list[dict[str, Any]] = []
        if not memory_only:
            # the step with collectives priced and overlapped on their own streams; step_time_ns of each
            # class becomes that step instead of the single-stream sum of its kernels
            from boomfx.distributed.rank_schedule import default_pricer
            from boomfx.distributed.step_time import class_steps, time_report
            pricer = default_pricer(self.analyses[0])   # the --db's collective rows, read once for both below
            steps = class_steps(self, bindings, points=points, pricer=pricer)   # the points just evaluated
            time_rows = time_report(steps)
            for report, step in zip(reports, steps):
                report.step_time_ns = step.step.step_ns
            if accumulate > 1:   # M forward/backward passes, one optimizer step (accumulation.py)
                from boomfx.distributed.accumulation import accumulated_time_row

                time_rows = [accumulated_time_row(row, step.step, a.program, accumulate)
                             for row, step, a in zip(time_rows, steps, self.analyses)]
                for report, row in zip(reports, time_rows):
                    report.step_time_ns = row["step_time_ns"]
            if self.cfg.pp > 1:  # stages wait for each other: the schedule's passes, bubble included
                from boomfx.distributed.pipeline_time import pipeline_run

                run = pipeline_run(self, points, bindings, steps, weights if self.replayed else None, pricer)
                for i, (report, row) in enumerate(zip(reports, time_rows)):
                    report.step_time_ns = run.stage_end_ns[i]
                    row.update(step_time_ns=run.stage_end_ns[i], pipeline_step_ns=run.total_ns,
                               bubble_fraction=run.bubble_fraction, send_ns=run.send_ns[i],
                               send_source=run.send_sources[i], send_bytes=run.send_bytes[i])
                    if self.replayed:   # the template's streams ran three micro-batches: the replay's counts
                        from boomfx.distributed.pipeline_compose import replayed_comm

                        row.update(replayed_comm(steps[i], weights[i]))
        point.report.parallel = ParallelReport(
            config={**asdict(self.cfg), "reshard_after_forward": self.cfg.reshards_after_forward},
            world=self.cfg.world,
            batch_per_rank=batch,
            global_batch=self.cfg.global_batch(batch) if batch is not None else None,
            micro_batch=micro,
            worst_rank=reports[worst].ranks[0],
            shown_rank=rank if rank is not None else reports[worst].ranks[0],
            classes=reports,
            time_by_class=time_rows,
        ).to_dict()
        return point

    def fits(self, bindings: Mapping[sympy.Symbol, int]) -> bool:
        bindings = self.program_bindings(bindings)
        return all(a.evaluate(bindings, memory_only=True).report.memory.fits for a in self.analyses)

    def program_bindings(self, bindings: Mapping[sympy.Symbol, int]) -> Mapping[sympy.Symbol, int]:
        """Pipeline stage programs, and the rank program under gradient accumulation, run one micro-batch at
        a time: the batch symbol at ``batch / M``."""
        if self.cfg.pp == 1 and self.cfg.accumulation_steps == 1:
            return bindings
        from boomfx.distributed.pipeline_stages import micro_bindings

        return micro_bindings(self.program, self.cfg, bindings)

    def _batch(self, bindings: Mapping[sympy.Symbol, int]) -> Optional[int]:
        for info in self.program.symbols.values():
            if info.role == "batch":
                return bindings.get(info.symbol)
        return None

    def _class_report(
        self, rc: RankClass, analysis: Analysis, point: PointResult, bindings: Mapping[sympy.Symbol, int],
        weights: Optional[Mapping[str, float]] = None,
    ) -> RankClassReport:
        m = point.report.memory
        a = m.allocator
        return RankClassReport(
            list(rc.ranks),
            rc.description,
            m.peak_live_bytes,
            m.resident_bytes,
            a.peak_allocated_bytes if a else None,
            a.peak_reserved_bytes if a else None,
            m.total_device_bytes,
            m.fits,
            point.report.time.total_ns,
            collectives(rc.program, analysis.evaluator(bindings), weights),
        )


def collectives(program: Program, ev: Any, weights: Optional[Mapping[str, float]] = None) -> list[CollectiveReport]:
    """Every collective node of ``program`` (and pipeline send/recv) in program order, with its buffers'
    sizes at ``ev``; ``weights``: a replayed stage's (``pipeline_compose``), each node as often as it runs."""
    from boomfx.core.layers import module_path
    from boomfx.passes.liveness import _compute_nbytes

    out = []
    for node in program.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace not in (_C10D_NAMESPACE, _P2P_NAMESPACE) or target.overloadpacket.__name__ == "wait_tensor":
            continue
        inp = node.args[0]
        group = _group_arg(node)
        in_bytes = ev(_compute_nbytes(inp.meta["val"])) if isinstance(inp, torch.fx.Node) else 0
        out_bytes = (
            ev(_compute_nbytes(node.meta["val"])) if isinstance(node.meta.get("val"), torch.Tensor) else 0
        )
        repeat = int(round(weights.get(node.name, 1.0))) if weights is not None else 1
        out.extend(repeat * [
            CollectiveReport(
                target.overloadpacket.__name__,
                group,
                int(in_bytes),
                int(out_bytes),
                program.phase_of(node),
                module_path(node),
                str(inp.meta["val"].dtype).removeprefix("torch.") if isinstance(inp, torch.fx.Node) else "",
            )
        ])
    return out


def _group_arg(node: torch.fx.Node) -> str:
    for arg in list(node.args) + list(node.kwargs.values()):
        if isinstance(arg, str) and arg not in ("sum", "avg", "max", "min"):
            return arg
    return ""


class MicroBatchSearch:
    """``--max-batch`` under pipeline parallelism: the search walks the micro-batch (a batch the
    micro-batches divide is ``micro x M``); ``evaluate`` multiplies it back."""

    def __init__(self, dist: DistributedAnalysis) -> None:
        self.dist = dist
        self.program = dist.program
        self.device = dist.device
        self.microbatches = dist.cfg.num_microbatches

    def evaluate(self, bindings: Mapping[sympy.Symbol, int], memory_only: bool = False) -> PointResult:
        out = dict(bindings)
        for info in self.program.symbols.values():
            if info.role == "batch" and info.symbol in out:
                out[info.symbol] = int(out[info.symbol]) * self.microbatches
        return self.dist.evaluate(out, memory_only=memory_only)

