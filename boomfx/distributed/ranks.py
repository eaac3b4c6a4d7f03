"""What each distinct rank runs: the training program rewritten per rank class.

All ranks of a data-parallel group run the same graph; FSDP ranks differ only where ``torch.chunk``
gives the last ranks fewer rows (a parameter whose dim 0 does not divide by the shard degree), so
ranks are grouped into classes by the shapes they hold and each class is analysed once.

Supported here: DDP (``dp_replicate``), FSDP2 (``dp_shard``), HSDP (both), tensor parallelism
(``tp``, ``tensor_parallel.py``: every rank of a TP group runs the same program) and its
combinations with them (FSDP / DDP rewrite the TP rank's program: FSDP shards the TP-local
parameters over ``dp_shard``, as ``fully_shard`` of a ``parallelize_module``d model does), and
pipeline stages (``pp``, one class per stage: ``pipeline_stages.py``; with ``dp_shard`` one per
(stage, shard shapes): ``pp_fsdp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from boomfx.distributed import mixed_precision
from boomfx.distributed.fsdp import ShardSpec, ddp_rank_program, fsdp_rank_program, local_shard_shape
from boomfx.distributed.plan import ParallelConfig
from boomfx.core.errors import OptionError
from boomfx.core.program import EAGER_PROGRAM, ROLE_PARAM, Program


@dataclass(frozen=True)
class RankClass:
    """Ranks that run the same program (``ranks`` in global numbering)."""

    ranks: tuple[int, ...]
    program: Program
    description: str


def rank_programs(program: Program, cfg: ParallelConfig, pipeline_copies: Optional[int] = None) -> list[RankClass]:
    """``pipeline_copies``: pipeline stage programs hold that many micro-batches instead of the config's
    (a template that ``pipeline_compose`` replays for the config's count).

    A compiled program (``--compile``) is rewritten from its eager program and each rank's program is
    then compiled: the collectives, FSDP's copy-in/copy-out and the pipeline's sends are kernels of
    their own that no fusion crosses, as each compiled region of a real run ends at them (torchtitan
    compiles each block; FSDP2's hooks and the pipeline's communication stay outside)."""
    if cfg.is_single_device:
        return [RankClass((0,), program, "single device")]
    if not program.options.compile:
        return _rank_classes(program, cfg, pipeline_copies)
    eager = program.derived.get(EAGER_PROGRAM)
    if eager is None:
        raise OptionError("--parallel with --compile needs the program as captured (boomfx.capture(..., "
                          "options=ProgramOptions(compile=True)))")
    from boomfx.passes.compiled import compile_program

    return [replace(rc, program=compile_program(rc.program)) for rc in _rank_classes(eager, cfg, pipeline_copies)]


def _rank_classes(program: Program, cfg: ParallelConfig, pipeline_copies: Optional[int]) -> list[RankClass]:
    reason = cfg.not_modelled()
    if reason:
        raise OptionError(reason)
    program = foreach_step(program)
    mp = mixed_precision.policy(program, cfg)
    program = mixed_precision.compute_program(program, mp)   # bf16 parameters: the step re-traced
    if cfg.pp > 1:   # stages cut from that step
        return _pipeline_classes(program, cfg, mp, pipeline_copies)
    tp_label = ""
    if cfg.tp > 1:
        from boomfx.distributed.tensor_parallel import tp_rank_program

        program = tp_rank_program(program, cfg)
        tp_label = f"TP {cfg.tp}"
        if cfg.dp == 1:
            return [RankClass(tuple(range(cfg.world)), program, f"{tp_label} rank (all {cfg.world})")]
    world = list(range(cfg.world))
    if cfg.dp_shard == 1:
        rewritten = ddp_rank_program(program, cfg.dp_replicate, cfg.bucket_cap_mb,
                                     gradient_as_bucket_view=cfg.gradient_as_bucket_view)
        label = f"DDP x {tp_label}" if tp_label else "DDP"
        return [RankClass(tuple(world), rewritten, f"{label} rank (all {cfg.world})")]
    spec = ShardSpec(
        cfg.dp_shard,
        reshard_after_forward=cfg.reshards_after_forward,
        replicate_world=cfg.dp_replicate,
        all_gather_scratch=cfg.backend == "gloo",
        wrap=cfg.fsdp_wrap,
        master_dtype=mp.master,
        reduce_dtype=mp.reduce,
    )
    classes = []
    for ranks in _by_shard_shapes(program, world, cfg):
        shard = cfg.coords(ranks[0])["dp_shard"]
        label = ("HSDP" if cfg.dp_replicate > 1 else "FSDP") + (f" x {tp_label}" if tp_label else "")
        classes.append(
            RankClass(
                tuple(ranks),
                fsdp_rank_program(program, spec, shard),
                f"{label} shard {shard} of {cfg.dp_shard}",
            )
        )
    return classes


def _pipeline_classes(program: Program, cfg: ParallelConfig, mp: mixed_precision.MixedPrecision,
                      copies: Optional[int] = None) -> list[RankClass]:
    """One class per pipeline stage: the ranks whose ``pp`` coordinate is the stage. With ``tp`` the
    stages are cut from the TP rank's program (every TP rank of a stage runs the same one), as
    torchtitan ``parallelize_module``s each stage's layers over the stage's TP group; with
    ``dp_replicate`` each stage program gets DDP's buckets (a ``DistributedDataParallel`` stage module)."""
    from boomfx.distributed.pipeline_stages import META_GRAD_READY, stage_programs

    if cfg.tp > 1:
        from boomfx.distributed.tensor_parallel import tp_rank_program

        program = tp_rank_program(program, cfg)
    classes = []
    for stage in stage_programs(program, cfg, copies):
        ranks = tuple(r for r in range(cfg.world) if cfg.coords(r)["pp"] == stage.stage)
        layers = stage.describe_layers()
        tp = f"TP {cfg.tp} x " if cfg.tp > 1 else ""
        stage_program = stage.program
        if cfg.dp_shard > 1:  # fully_shard on each layer of the stage and the stage module
            classes += _fsdp_stage_classes(stage, ranks, cfg, mp, f"{tp}pipeline stage {stage.stage} of {cfg.pp} "
                                           f"({layers}, {cfg.pp_schedule}, {cfg.num_microbatches} micro-batches)")
            continue
        if cfg.dp_replicate > 1:  # PipelineStage syncs DDP's buckets in the last micro-batch's backward only
            stage_program = ddp_rank_program(stage_program, cfg.dp_replicate, cfg.bucket_cap_mb,
                                             ready=stage_program.gm.meta[META_GRAD_READY],
                                             gradient_as_bucket_view=cfg.gradient_as_bucket_view)
            tp = f"DDP x {tp}"
        classes.append(RankClass(ranks, stage_program,
                                 f"{tp}pipeline stage {stage.stage} of {cfg.pp} ({layers}, {cfg.pp_schedule}, "
                                 f"{cfg.num_microbatches} micro-batches)"))
    return classes


def _fsdp_stage_classes(stage, ranks: tuple[int, ...], cfg: ParallelConfig, mp: mixed_precision.MixedPrecision,
                        label: str) -> list[RankClass]:
    """A stage's ranks grouped by the shard shapes they hold (``torch.chunk``), one program each."""
    from boomfx.distributed.pp_fsdp import fsdp_stage_program

    program = stage.program
    spec = ShardSpec(cfg.dp_shard, reshard_after_forward=cfg.reshards_after_forward, replicate_world=cfg.dp_replicate,
                     all_gather_scratch=cfg.backend == "gloo", master_dtype=mp.master, reduce_dtype=mp.reduce,
                     wrap=cfg.fsdp_wrap)
    classes = []
    for members in _by_shard_shapes(program, ranks, cfg):
        shard = cfg.coords(members[0])["dp_shard"]
        classes.append(RankClass(tuple(members), fsdp_stage_program(stage, spec, shard),
                                 f"{'HSDP' if cfg.dp_replicate > 1 else 'FSDP'} shard {shard} of {cfg.dp_shard} x {label}"))
    return classes


def _by_shard_shapes(program: Program, ranks: Sequence[int], cfg: ParallelConfig) -> list[list[int]]:
    """``ranks`` grouped by the shapes of the parameter shards they hold (``torch.chunk`` over dp_shard:
    ranks holding fewer rows of some parameter run a program of their own)."""
    shapes = [list(n.meta["val"].shape) for n in program.graph.nodes
              if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM]
    by_signature: dict[tuple, list[int]] = {}
    for rank in ranks:
        shard = cfg.coords(rank)["dp_shard"]
        key = tuple(tuple(local_shard_shape(s, cfg.dp_shard, shard)) for s in shapes)
        by_signature.setdefault(key, []).append(rank)
    return list(by_signature.values())


FOREACH_STEP = "foreach_step"     # Program.derived key of the step re-traced with the foreach optimizer


def foreach_step(program: Program) -> Program:
    """The step every rank rewrite starts from: its optimizer traced foreach (torch's default for CUDA
    tensors). The rewrites read the foreach ops (FSDP's sharded optimizer, a pipeline stage's cut of
    the foreach lists, TP's reads of DTensor gradients), so a step traced with torch.optim's
    per-parameter loop (``--no-foreach``) is traced again with foreach, once per program (kept in
    ``program.derived``). Known limitation: on CPU ranks (gloo) torch's default
    is that loop; per rank its temporaries are modelled as foreach's (all parameters' at once)."""
    options = program.options
    if not options.train or options.uses_foreach or options.optimizer == "none":
        return program
    if FOREACH_STEP not in program.derived:
        from boomfx.frontend.capture import capture, export_of

        ep = export_of(program)
        if ep is None:
            raise OptionError("--parallel rewrites the step traced with the foreach optimizer: give the program as "
                              "captured from its export (boomfx.capture(..., options=ProgramOptions(train=True)))")
        program.derived[FOREACH_STEP] = capture(ep, options=replace(options, foreach=True))
    return program.derived[FOREACH_STEP]
