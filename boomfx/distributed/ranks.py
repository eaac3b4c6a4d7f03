"""What each distinct rank runs: the training program rewritten per rank class.

All ranks of a data-parallel group run the same graph; FSDP ranks differ only where ``torch.chunk``
gives the last ranks fewer rows (a parameter whose dim 0 does not divide by the shard degree), so
ranks are grouped into classes by the shapes they hold and each class is analysed once.

Supported here: DDP (``dp_replicate``), FSDP2 (``dp_shard``), HSDP (both) and pipeline stages
(``pp``, one class per stage: ``pipeline_stages.py``). Tensor parallelism is validated by
``plan.py`` but its rewrite is not built yet (OptionError).
"""

from __future__ import annotations

from dataclasses import dataclass

from boomfx.distributed.fsdp import ShardSpec, ddp_rank_program, fsdp_rank_program, local_shard_shape
from boomfx.distributed.plan import ParallelConfig
from boomfx.core.errors import OptionError
from boomfx.core.program import ROLE_PARAM, Program


@dataclass(frozen=True)
class RankClass:
    """Ranks that run the same program (``ranks`` in global numbering)."""

    ranks: tuple[int, ...]
    program: Program
    description: str


def rank_programs(program: Program, cfg: ParallelConfig) -> list[RankClass]:
    if cfg.is_single_device:
        return [RankClass((0,), program, "single device")]
    if cfg.pp > 1:
        return _pipeline_classes(program, cfg)
    if cfg.tp > 1:
        raise OptionError(
            f"--parallel {cfg.describe()}: per-rank programs for tensor parallelism "
            "are not built yet (dp_replicate, dp_shard and pp are)"
        )
    if cfg.fsdp_param_dtype or cfg.fsdp_reduce_dtype:
        raise OptionError("--fsdp-param-dtype/--fsdp-reduce-dtype: FSDP mixed precision is not modelled yet")
    if cfg.gradient_as_bucket_view:
        raise OptionError("--gradient-as-bucket-view: not modelled yet (the default, False, is)")
    world = list(range(cfg.world))
    if cfg.dp_shard == 1:
        rewritten = ddp_rank_program(program, cfg.dp_replicate, cfg.bucket_cap_mb)
        return [RankClass(tuple(world), rewritten, f"DDP rank (all {cfg.world})")]
    spec = ShardSpec(
        cfg.dp_shard, reshard_after_forward=cfg.reshard_after_forward, replicate_world=cfg.dp_replicate
    )
    shapes = [
        list(n.meta["val"].shape)
        for n in program.graph.nodes
        if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM
    ]
    by_signature: dict[tuple, list[int]] = {}
    for rank in world:
        shard = cfg.coords(rank)["dp_shard"]
        key = tuple(tuple(local_shard_shape(s, cfg.dp_shard, shard)) for s in shapes)
        by_signature.setdefault(key, []).append(rank)
    classes = []
    for ranks in by_signature.values():
        shard = cfg.coords(ranks[0])["dp_shard"]
        label = "HSDP" if cfg.dp_replicate > 1 else "FSDP"
        classes.append(
            RankClass(
                tuple(ranks),
                fsdp_rank_program(program, spec, shard),
                f"{label} shard {shard} of {cfg.dp_shard}",
            )
        )
    return classes


def _pipeline_classes(program: Program, cfg: ParallelConfig) -> list[RankClass]:
    """One class per pipeline stage: the ranks whose ``pp`` coordinate is the stage."""
    from boomfx.distributed.pipeline_stages import stage_programs

    classes = []
    for stage in stage_programs(program, cfg):
        ranks = tuple(r for r in range(cfg.world) if cfg.coords(r)["pp"] == stage.stage)
        layers = f"{stage.layers[0]}..{stage.layers[-1]}" if len(stage.layers) > 1 else stage.layers[0]
        classes.append(RankClass(ranks, stage.program,
                                 f"pipeline stage {stage.stage} of {cfg.pp} ({layers}, {cfg.pp_schedule}, "
                                 f"{cfg.num_microbatches} micro-batches)"))
    return classes
