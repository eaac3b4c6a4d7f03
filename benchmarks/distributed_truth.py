"""Ground truth for distributed training on this machine: real multi-process steps on gloo (CPU).

Each configuration (DDP, FSDP2, tensor parallel, pipeline parallel, HSDP, TP x FSDP) runs a few
real AdamW training steps of a small model in 2 or 4 processes on 127.0.0.1 (one thread each).
After two warm-up steps (AdamW creates its state on the first), MEASURED_STEPS steps run under the
profiler (RECHECK_STEPS more on every rank when any rank's steps disagree) and each rank records:

- its peak live tensor memory above the step's starting point (the CPU allocator's count of live
  bytes that each profiler ``[memory]`` event carries, counted on every thread: gloo's worker
  thread frees collective tensors with no event of its own, see ``_profiled_steps``);
- the bytes resident at the start of the step (its parameters as stored, optimizer state);
- every collective the backend ran (the profiler's ``gloo:*`` events: name, dtype, element count of
  each input), in issue order;
- its local parameter shapes and storage sizes (FSDP2 pads dim-0 shards; the storage shows it);
- the median wall time of the steps after warm-up (for the collective time model, issue 18).

All configurations of one world size run in ONE start of ``world`` processes, one after the other.
The processes are forked from a forkserver that imported torch and this module once (``_START``): a
test session pays ``import torch`` once, not once per rank (2 + 4 + 8 ranks), and no rank is forked
from a process whose thread pools already run (the pytest worker's).

Used by ``benchmarks/distributed_gloo.py`` (all configurations, results in ``benchmarks/results/``)
and by ``tests/test_distributed_memory.py`` (session-scoped runs). Never used inside predictions.

Known limitations (gloo and CPU):
- gloo has no reduce-scatter: ``reduce_scatter_tensor`` runs as a full ``all_reduce`` of the input
  followed by a copy of this rank's chunk (the profiler shows ``gloo:all_reduce`` of the full size),
  so its transient buffer is the full input, unlike NCCL's.
- No streams on CPU: FSDP2's all-gather/reduce-scatter run on the default stream, so overlap (and
  the memory it holds in flight on a GPU) is not exercised; prefetch order still is.
- Mixed precision (``MixedPrecisionPolicy`` with bf16 parameters, fp32 or bf16 reduction) runs on CPU
  and gloo: the default set has it for fsdp, hsdp, tp_fsdp and pp_fsdp.
- Sequence parallelism (``tp_sp``): gloo has no reduce-scatter, so each
  ``Partial -> Shard(1)`` runs as a ``gloo:all_reduce`` of the whole [batch, seq, d]; the norm
  weights' gradients stay ``Partial`` and AdamW's foreach ops all-reduce them again on each read
  (three ``all_reduce`` of [d] per norm weight after backward).
- Tensor parallelism here splits Llama's q/k/v/o and gate/up/down and GPT's MLP (fc/fc_out); GPT's
  fused qkv projection cannot be column-split by head with ``ColwiseParallel`` and stays replicated.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

PARALLELISMS = ("ddp", "fsdp", "tp", "tp_vocab", "tp_sp", "pp", "hsdp", "tp_fsdp", "pp_tp", "pp_tp_vocab", "pp_tp_sp",
                "pp_ddp", "pp_fsdp",
                "pp_hsdp")
VOCAB = 256
# The models' sizes: small enough for seconds per run on 2 shared cores, large enough that tensor
# sizes dominate the allocator's and gloo's fixed-size scratch.
MODEL_DIMS = {
    "llama": dict(vocab=VOCAB, d=64, layers=2, heads=4, kv_heads=2, hidden=128),
    "gpt": dict(vocab=VOCAB, d=64, layers=2, heads=4, max_seq=64),
    # 4 layers: interleaved 1F1B's 2 ranks x 2 chunks of one layer each
    "llama4": dict(vocab=VOCAB, d=64, layers=4, heads=4, kv_heads=2, hidden=128),
    "gpt4": dict(vocab=VOCAB, d=64, layers=4, heads=4, max_seq=64),
    # GPT-2's tied head (lm_head.weight is wte.weight): under pp both end stages hold it, and the step
    # all-reduces its gradient over them before AdamW (Megatron's embedding group)
    "gpt_tied": dict(vocab=VOCAB, d=64, layers=2, heads=4, max_seq=64, tied=True),
    # 8 layers: interleaved 1F1B with 4 chunks per rank (the runtime then reshards and re-gathers chunks)
    "llama8": dict(vocab=VOCAB, d=64, layers=8, heads=4, kv_heads=2, hidden=128),
    # wider (d=256, 4 layers): step time where kernels, not Python's per-op work, decide it
    # (distributed_gloo_time.py --models llama_m,gpt_m)
    "llama_m": dict(vocab=VOCAB, d=256, layers=4, heads=8, kv_heads=4, hidden=704),
    "gpt_m": dict(vocab=VOCAB, d=256, layers=4, heads=8, max_seq=256),
}
TP_PLANS = {  # module-name suffix inside each layer -> "colwise" | "rowwise"
    "llama": {
        "q": "colwise",
        "k": "colwise",
        "v": "colwise",
        "o": "rowwise",
        "gate": "colwise",
        "up": "colwise",
        "down": "rowwise",
    },
    "gpt": {"fc": "colwise", "fc_out": "rowwise"},
}


@dataclass(frozen=True)
class TruthConfig:
    """One real run. ``batch`` is the batch each data-parallel rank feeds its model per step
    (per-rank batch; TP ranks of one group see the same batch; for pipeline parallelism it is the
    whole step's batch, cut into ``microbatches``)."""

    model: str
    parallel: str
    world: int
    batch: int = 4
    seq: int = 32
    reshard_after_forward: bool = True
    schedule: str = "1f1b"
    microbatches: int = 4
    bucket_cap_mb: float = 25.0
    timed_steps: int = 3   # wall-timed steps after the profiled ones (0: none, step_time_s stays 0)
    gradient_as_bucket_view: bool = False  # DDP's option ("ddp", "pp_ddp")
    # FSDP2 MixedPrecisionPolicy(param_dtype, reduce_dtype) as torch dtype names ("bfloat16"); None: off
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    fsdp_wrap: str = "layers"  # "root": one fully_shard on the whole model
    stages_per_rank: int = 2   # interleaved 1F1B's chunks per rank (boomfx's default --pp-stages-per-rank)
    # the step's loss: "mean" of the logits, or "cross_entropy" against random next-token labels (a
    # language model's, boomfx's --train default for logits); loss_parallel (tp_vocab, tp_sp with
    # cross_entropy): the head's logits stay Shard(-1) and the loss runs under loss_parallel()
    loss: str = "mean"
    loss_parallel: bool = False
    # gradient accumulation without pipelining (ddp, fsdp): the batch as this many micro-batches, each
    # forward and backward with its collectives (torchtitan's loop), one AdamW step
    accumulation: int = 1

    @property
    def name(self) -> str:
        extra = ""
        if self.parallel in ("fsdp", "hsdp", "tp_fsdp", "pp_fsdp", "pp_hsdp"):
            extra = "-reshard" if self.reshard_after_forward else "-noreshard"
        if self.parallel.startswith("pp"):
            extra += f"-{self.schedule}-mb{self.microbatches}"
            if self.schedule == "interleaved_1f1b" and self.stages_per_rank != 2:
                extra += f"-v{self.stages_per_rank}"
        if self.gradient_as_bucket_view:
            extra += "-bucketview"
        if self.param_dtype or self.reduce_dtype:
            extra += f"-mp-{self.param_dtype or 'same'}-{self.reduce_dtype or 'same'}"
        if self.fsdp_wrap != "layers":
            extra += f"-wrap{self.fsdp_wrap}"
        if self.loss != "mean":
            extra += "-lossparallel" if self.loss_parallel else "-ce"
        if self.accumulation > 1:
            extra += f"-acc{self.accumulation}"
        return f"{self.model}-{self.parallel}{extra}-w{self.world}-b{self.batch}-s{self.seq}"


@dataclass
class RankTruth:
    rank: int
    peak_bytes: int  # peak above the start of the measured step (profiler events)
    start_param_bytes: int  # this rank's parameter storages at the start of the step
    start_optimizer_bytes: int  # this rank's AdamW state storages
    collectives: list[dict]  # {"op": "all_gather", "dtype": "float", "numel": [...]} in order
    # name -> {"shape", "storage_bytes", "grad_shape": the local shape of the .grad AdamW steps}
    local_params: dict[str, dict] = field(default_factory=dict)
    step_time_s: float = 0.0
    peak_samples: list[int] = field(default_factory=list)  # each measured step's peak; peak_bytes = min


@dataclass
class ConfigTruth:
    config: TruthConfig
    ranks: list[RankTruth]

    def to_json(self) -> dict:
        return {
            "name": self.config.name,
            "config": asdict(self.config),
            "ranks": [asdict(r) for r in self.ranks],
        }


# ---------------------------------------------------------------------------------------------
# models and how each parallelism wraps them


def build_model(name: str) -> torch.nn.Module:
    from models import GPT, Llama

    torch.manual_seed(0)
    return Llama(**MODEL_DIMS[name]) if name.startswith("llama") else GPT(**MODEL_DIMS[name])


def model_family(name: str) -> str:
    """"llama" or "gpt": which architecture (and TP plan) a MODEL_DIMS entry is."""
    return "llama" if name.startswith("llama") else "gpt"


def layer_list(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.layers if hasattr(model, "layers") else model.h


def _tp_plan(model_name: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {module: styles[style]() for module, style in TP_PLANS[model_family(model_name)].items()}


def _apply_tp(model: torch.nn.Module, model_name: str, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in layer_list(model):
        parallelize_module(layer, mesh, _tp_plan(model_name))


def _head_plan(loss_parallel: bool, **layouts: Any) -> Any:
    """torchtitan's output head: colwise, its logits gathered to Replicate, or with loss parallel kept
    ``Shard(-1)`` as a DTensor for ``loss_parallel()``'s cross-entropy."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    if loss_parallel:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False, **layouts)
    return ColwiseParallel(output_layouts=Replicate(), **layouts)


def _apply_vocab_parallel(model: torch.nn.Module, mesh: Any, loss_parallel: bool = False) -> None:
    """torchtitan's Llama plan for the ends of the model, without sequence parallelism: the embedding
    rowwise over the vocabulary (token ids arrive replicated) and the head colwise (``_head_plan``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    _parallelize_present(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": _head_plan(loss_parallel),
    })


def _parallelize_present(model: torch.nn.Module, mesh: Any, plan: dict) -> None:
    """``parallelize_module`` with the entries of ``plan`` whose module ``model`` has (a pipeline stage
    holds the embedding only on the first stage, the final norm and head only on the last)."""
    from torch.distributed.tensor.parallel import parallelize_module

    present = {name: style for name, style in plan.items() if hasattr(model, name)}
    if present:
        parallelize_module(model, mesh, present)


def _apply_sequence_parallel(model: torch.nn.Module, mesh: Any, loss_parallel: bool = False) -> None:
    """torchtitan's Llama plan with sequence parallelism, on this model's modules: activations
    between blocks split on the sequence dim (``Shard(1)``); each norm ``SequenceParallel`` with its
    output all-gathered once to Replicate for the colwise projections reading it (torchtitan's
    ``PrepareModuleInput`` on its attention / feed-forward modules, which this Llama has not); the
    rowwise projections' outputs reduce-scattered to ``Shard(1)``; the embedding rowwise over the
    vocabulary into ``Shard(1)``; the head colwise from ``Shard(1)`` (``_head_plan``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # use_local_output=False: the projections read one Replicate DTensor, so their input gradients
    # sum as Partial and are reduce-scattered once (torchtitan's PrepareModuleInput does the same)
    gather = {"output_layouts": Shard(1), "desired_output_layouts": Replicate(), "use_local_output": False}
    for layer in layer_list(model):
        plan = {m: ColwiseParallel() for m in ("q", "k", "v", "gate", "up")}
        plan.update({m: RowwiseParallel(output_layouts=Shard(1)) for m in ("o", "down")})
        plan.update({m: SequenceParallel() for m in ("input_norm", "post_norm")})
        parallelize_module(layer, mesh, plan)
        parallelize_module(layer, mesh, {m: PrepareModuleOutput(**gather) for m in ("input_norm", "post_norm")})
    _parallelize_present(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": _head_plan(loss_parallel, input_layouts=Shard(1)),
    })


def _mixed_precision(cfg: "TruthConfig") -> Any:
    """The configuration's ``MixedPrecisionPolicy`` (defaults when no dtype is given)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def dtype(name: Optional[str]) -> Optional[torch.dtype]:
        return getattr(torch, name) if name else None

    return MixedPrecisionPolicy(param_dtype=dtype(cfg.param_dtype), reduce_dtype=dtype(cfg.reduce_dtype))


def _apply_fsdp(model: torch.nn.Module, mesh: Any, reshard: bool, mp_policy: Any = None,
                wrap: str = "layers") -> None:
    """torchtitan's wrapping: each layer is a unit, then the root (embeddings, final norm, head);
    ``wrap="root"``: the whole model is one unit."""
    from torch.distributed.fsdp import fully_shard

    extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in layer_list(model) if wrap == "layers" else ():
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **extra)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **extra)


class _Stage(torch.nn.Module):
    """The layers ``[lo, hi)`` of a GPT/Llama model, with the embedding on the first stage and the
    final norm and head on the last (the manual stage split torchtitan uses)."""

    def __init__(self, model: torch.nn.Module, lo: int, hi: int, first: bool, last: bool,
                 seq_shards: int = 1) -> None:
        super().__init__()
        # sequence parallelism: a later stage receives its TP rank's 1/seq_shards of the sequence
        self.seq_shards = 1 if first else seq_shards
        self.is_llama = hasattr(model, "layers")
        self.first, self.last = first, last
        if first:
            self.embed = model.embed if self.is_llama else model.wte
            if not self.is_llama:
                self.wpe = model.wpe
        self.layers = torch.nn.ModuleList(list(layer_list(model))[lo:hi])
        if last:
            self.norm = model.norm if self.is_llama else model.ln_f
            self.lm_head = model.lm_head
        self.head_dim = getattr(model, "head_dim", 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1] * self.seq_shards  # the sequence length (token ids on the first stage)
        if self.first:
            x = self.embed(x) if self.is_llama else self.embed(x) + self.wpe(torch.arange(t))
        if self.is_llama:
            inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
            freqs = torch.outer(torch.arange(t).float(), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            for layer in self.layers:
                x = layer(x, cos, sin)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.lm_head(self.norm(x)) if self.last else x


def _pp_root_reshard(cfg: "TruthConfig") -> dict:
    """A stage module's (the FSDP root's) ``reshard_after_forward``: False as torchtitan passes with pp,
    else fully_shard's own default (None: the root is never resharded after forward, its layers are)."""
    return {} if cfg.reshard_after_forward else {"reshard_after_forward": False}


def stage_layer_ranges(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers per stage: as even as possible, earlier stages take the remainder."""
    base, extra = divmod(n_layers, stages)
    ranges, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def _mean_loss(output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return output.mean()


def _cross_entropy(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A language model's loss on [batch, seq, vocab] logits (a DTensor under loss parallel)."""
    return torch.nn.functional.cross_entropy(output.flatten(0, 1), labels.flatten(0, 1))


def _loss_fn(cfg: "TruthConfig") -> Any:
    return _cross_entropy if cfg.loss == "cross_entropy" else _mean_loss


def _labels(cfg: "TruthConfig", seed: int) -> torch.Tensor:
    """The step's targets, allocated before it: next-token ids, or the unused target of a mean loss."""
    if cfg.loss == "cross_entropy":
        return torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(seed + 500))
    return torch.zeros(cfg.batch, 1)


def _loss_context(cfg: "TruthConfig") -> Any:
    if cfg.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# one rank's run of one configuration


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _prepare(cfg: TruthConfig, rank: int) -> tuple[Any, list[torch.nn.Parameter], dict]:
    """(one-step function, parameters, names) of this rank for ``cfg``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = build_model(cfg.model)
    gen = torch.Generator().manual_seed(1000 + rank)
    if cfg.parallel in ("pp", "pp_fsdp") and cfg.schedule == "interleaved_1f1b":
        return _interleaved_step(cfg, model, rank)
    if cfg.parallel.startswith("pp"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        # pp_tp / pp_ddp: a (pp=2, tp or dp) mesh as torchtitan lays it out (pp outer). pp_tp: each
        # stage's layers are parallelize_module'd over its TP group; pp_ddp: the stage module is
        # wrapped in DistributedDataParallel over its dp group (PipelineStage runs every micro-batch
        # but the last under no_sync); pp_fsdp: each stage layer and the stage module are fully_shard'ed
        # over its dp group (torchtitan's default with pp: reshard_after_forward=False; PipelineStage
        # keeps parameters gathered and gradients unsharded until its last backward); pp_hsdp: the same
        # on a (pp=2, replicate=2, shard) mesh, fully_shard over its 2-D dp mesh. The stage sends
        # over its pp group.
        stages, stage_id, group, inner, data_seed = cfg.world, rank, None, None, 7
        if cfg.parallel == "pp_hsdp":
            mesh = init_device_mesh("cpu", (2, 2, cfg.world // 4), mesh_dim_names=("pp", "replicate", "shard"))
            stages, stage_id, group = 2, mesh["pp"].get_local_rank(), mesh["pp"].get_group()
            inner = mesh["replicate", "shard"]
            data_seed = 1000 + mesh["replicate"].get_local_rank() * (cfg.world // 4) + mesh["shard"].get_local_rank()
        elif cfg.parallel != "pp":
            inner_name = "tp" if cfg.parallel.startswith("pp_tp") else "dp"
            mesh = init_device_mesh("cpu", (2, cfg.world // 2), mesh_dim_names=("pp", inner_name))
            stages, stage_id, group, inner = 2, mesh["pp"].get_local_rank(), mesh["pp"].get_group(), mesh[inner_name]
            if cfg.parallel in ("pp_ddp", "pp_fsdp"):
                data_seed = 1000 + inner.get_local_rank()
        lo, hi = stage_layer_ranges(len(layer_list(model)), stages)[stage_id]
        module = _Stage(model, lo, hi, stage_id == 0, stage_id == stages - 1,
                        seq_shards=cfg.world // 2 if cfg.parallel == "pp_tp_sp" else 1)
        if cfg.parallel in ("pp_tp", "pp_tp_vocab"):
            # pp_tp_vocab: torchtitan's ends too (the first stage's embedding, the last's head)
            _apply_tp(module, cfg.model, inner)
            if cfg.parallel == "pp_tp_vocab":
                _apply_vocab_parallel(module, inner, cfg.loss_parallel)
        elif cfg.parallel == "pp_tp_sp":
            _apply_sequence_parallel(module, inner, cfg.loss_parallel)
        if cfg.parallel in ("pp_fsdp", "pp_hsdp"):
            from torch.distributed.fsdp import fully_shard

            mp = {"mp_policy": _mixed_precision(cfg)} if cfg.param_dtype or cfg.reduce_dtype else {}
            for layer in module.layers if cfg.fsdp_wrap == "layers" else ():
                fully_shard(layer, mesh=inner, reshard_after_forward=cfg.reshard_after_forward, **mp)
            fully_shard(module, mesh=inner, **_pp_root_reshard(cfg), **mp)
        opt = torch.optim.AdamW(_param_groups(module), foreach=True)
        named = dict(module.named_parameters())
        if cfg.parallel == "pp_ddp":
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(module, process_group=inner.get_group(), bucket_cap_mb=cfg.bucket_cap_mb,
                                             gradient_as_bucket_view=cfg.gradient_as_bucket_view)
        stage = PipelineStage(module, stage_id, stages, torch.device("cpu"), group=group)
        cls = Schedule1F1B if cfg.schedule == "1f1b" else ScheduleGPipe
        schedule = cls(stage, cfg.microbatches, loss_fn=_loss_fn(cfg))
        idx = torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(data_seed))
        target = _labels(cfg, data_seed)
        sync = None
        if MODEL_DIMS[cfg.model].get("tied"):
            # the tied weight's copies on the end stages sum their gradients over a group of their own
            # (Megatron's embedding group; on the pp group itself gloo pairs the group's first collective,
            # tag 0, with the stages' sends); the stage's own parameter: TP and FSDP replace it with a
            # DTensor of their own, whose local part is reduced
            tied_group = _end_stage_group(cfg.world, stages, rank)
            stage_module = module.module if hasattr(module, "no_sync") else module
            if tied_group is not None:
                tied = stage_module.embed.weight if stage_id == 0 else stage_module.lm_head.weight

                def sync() -> None:
                    dist.all_reduce(_local(tied.grad), group=tied_group)

        return (_schedule_step(schedule, opt, idx, target, stage_id == 0, stage_id == stages - 1,
                               lambda: _loss_context(cfg), sync),
                opt, named)

    idx = torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=gen)
    if cfg.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb,
                                        gradient_as_bucket_view=cfg.gradient_as_bucket_view)
    elif cfg.parallel == "fsdp":
        _apply_fsdp(model, init_device_mesh("cpu", (cfg.world,)), cfg.reshard_after_forward, _mixed_precision(cfg),
                    cfg.fsdp_wrap)
    elif cfg.parallel == "tp_sp":
        _apply_sequence_parallel(model, init_device_mesh("cpu", (cfg.world,)), cfg.loss_parallel)
        idx = torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(7))
    elif cfg.parallel in ("tp", "tp_vocab"):
        mesh = init_device_mesh("cpu", (cfg.world,))
        _apply_tp(model, cfg.model, mesh)
        if cfg.parallel == "tp_vocab":
            _apply_vocab_parallel(model, mesh, cfg.loss_parallel)
        idx = torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(7))
    elif cfg.parallel == "hsdp":
        mesh = init_device_mesh("cpu", (2, cfg.world // 2), mesh_dim_names=("replicate", "shard"))
        _apply_fsdp(model, mesh, cfg.reshard_after_forward, _mixed_precision(cfg))
    elif cfg.parallel == "tp_fsdp":
        mesh = init_device_mesh("cpu", (cfg.world // 2, 2), mesh_dim_names=("dp", "tp"))
        _apply_tp(model, cfg.model, mesh["tp"])
        _apply_fsdp(model, mesh["dp"], cfg.reshard_after_forward, _mixed_precision(cfg))
        dp_rank = mesh["dp"].get_local_rank()
        idx = torch.randint(
            0, VOCAB, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(1000 + dp_rank)
        )
    else:
        raise ValueError(f"unknown parallelism {cfg.parallel!r}")
    del dist
    opt = torch.optim.AdamW(_param_groups(model), foreach=True)
    # the data-parallel ranks' own labels (the TP ranks of a group share theirs, as they share the ids)
    labels = _labels(cfg, int(idx.sum()))
    loss_fn = _loss_fn(cfg)

    # accumulation: views of the step's batch, one forward and backward each (no copies: the batch is
    # allocated before the step, as the prediction's inputs are resident)
    micro = list(zip(idx.chunk(cfg.accumulation), labels.chunk(cfg.accumulation)))

    def step() -> None:
        with _loss_context(cfg):
            for ids, target in micro:
                loss_fn(model(ids), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt, dict(model.named_parameters())




def _interleaved_step(cfg: TruthConfig, model: torch.nn.Module, rank: int) -> tuple[Any, Any, dict]:
    """``ScheduleInterleaved1F1B`` over ``pp`` ranks holding ``cfg.stages_per_rank`` chunks each: pipeline rank
    r runs virtual stages r, r + pp, ... of the ``pp x stages_per_rank``-stage split. ``pp``: the world;
    pp_fsdp: 2, on a (pp, dp) mesh, each chunk's layers and the chunk module ``fully_shard``ed over its
    dp group (the runtime unshards a rank's chunks before its first action and reduce-scatters each
    after its last backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    pp, group, data_seed, dp = cfg.world, None, 7, None
    if cfg.parallel == "pp_fsdp":
        mesh = init_device_mesh("cpu", (2, cfg.world // 2), mesh_dim_names=("pp", "dp"))
        pp, group, dp = 2, mesh["pp"].get_group(), mesh["dp"]
        rank, data_seed = mesh["pp"].get_local_rank(), 1000 + dp.get_local_rank()
    total = pp * cfg.stages_per_rank
    ranges = stage_layer_ranges(len(layer_list(model)), total)
    chunks = [c * pp + rank for c in range(cfg.stages_per_rank)]
    modules = [_Stage(model, *ranges[k], k == 0, k == total - 1) for k in chunks]
    if dp is not None:
        from torch.distributed.fsdp import fully_shard

        mp = {"mp_policy": _mixed_precision(cfg)} if cfg.param_dtype or cfg.reduce_dtype else {}
        for module in modules:
            for layer in module.layers if cfg.fsdp_wrap == "layers" else ():
                fully_shard(layer, mesh=dp, reshard_after_forward=cfg.reshard_after_forward, **mp)
            fully_shard(module, mesh=dp, **_pp_root_reshard(cfg), **mp)
    stages = [PipelineStage(mod, k, total, torch.device("cpu"), group=group) for mod, k in zip(modules, chunks)]
    schedule = ScheduleInterleaved1F1B(stages, cfg.microbatches, loss_fn=_loss_fn(cfg))
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, foreach=True)
    named = {f"chunk{k}.{n}": p for mod, k in zip(modules, chunks) for n, p in mod.named_parameters()}
    idx = torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(data_seed))
    target = _labels(cfg, data_seed)
    return _schedule_step(schedule, opt, idx, target, 0 in chunks, total - 1 in chunks), opt, named


def _end_stage_group(world: int, stages: int, rank: int) -> Any:
    """The process group of ``rank``'s first and last pipeline stages (None for a rank of neither), made on
    every rank: pp alone has one stage per rank; the combined meshes put pp=2 outermost."""
    import torch.distributed as dist

    half = world // 2
    pairs = [(0, world - 1)] if stages == world else [(j, half + j) for j in range(half)]
    groups = [dist.new_group(list(pair)) for pair in pairs]
    return next((g for pair, g in zip(pairs, groups) if rank in pair), None)


def _schedule_step(schedule: Any, opt: Any, idx: torch.Tensor, target: torch.Tensor, first: bool,
                   last: bool, context: Any = None, sync: Any = None) -> Any:
    """One pipeline training step: the rank holding the first stage feeds the batch, the one holding the
    last the loss target, then AdamW. ``context``: makes the context entered around the schedule (loss
    parallel's, as torchtitan's ``train_context`` wraps ``pp_schedule.step``); ``sync``: runs between the
    schedule and AdamW (a tied weight's gradient all-reduce)."""

    def step() -> None:
        with context() if context is not None else contextlib.nullcontext():
            if first:
                schedule.step(idx)
            elif last:
                schedule.step(target=target, losses=[])
            else:
                schedule.step()
        if sync is not None:
            sync()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """DTensor and plain parameters in separate groups: a foreach op cannot mix them (tensor
    parallelism leaves the embeddings, norms and head replicated as plain tensors)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [
        [p for p in params if isinstance(p, DTensor)],
        [p for p in params if not isinstance(p, DTensor)],
    ]
    return [{"params": g} for g in groups if g]


MEASURED_STEP = "boomfx_truth_measured_step"
MEASURED_STEPS = 2   # profiled steps; the peak is the min over them (see _profiled_steps) ...
RECHECK_STEPS = 6    # ... and over this many more, on every rank, when any rank's steps disagreed
# c10's switch (``--caffe2_report_cpu_memory_usage``) that makes the CPU allocator count every block it
# hands out and takes back, on every thread, not only on threads that carry the profiler's state
_COUNT_EVERY_THREAD_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


@contextlib.contextmanager
def _cpu_allocator_counts_every_thread():
    """Turn on c10's process-wide count of live CPU bytes for the ``with`` block.

    Without it the CPU allocator accounts a free only on a thread whose thread-local state carries the
    profiler (``memoryProfilingEnabled()``). ProcessGroupGloo's worker carries it only while it runs a
    collective (its allocations there have events) and drops its reference to the finished Work later
    (``workInProgress_[i].reset()`` in ``runLoop``), so when that reference is the last one (the main
    thread already dropped its own) the collective's tensors are freed there with no ``[memory]`` event
    and stay in the allocator's count forever. With the flag, that free updates the count, and every later event's
    ``total_allocated`` shows it."""
    import ctypes

    libs = sorted((Path(torch.__file__).parent / "lib").glob("libc10.*"))
    if not libs:
        raise RuntimeError(f"libc10 not found next to {torch.__file__}: cannot count gloo's frees")
    flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(libs[0])), _COUNT_EVERY_THREAD_FLAG)
    old = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = old


_SETTLE_LIMIT_S = 1.0   # a thread that stays runnable this long is not gloo finishing a Work: stop waiting
_SETTLE_POLL_S = 0.0002   # between looks at the threads


def _other_threads_settled() -> None:
    """Return once no other thread of this process is runnable (Linux ``/proc``; elsewhere at once).

    gloo's worker marks a Work completed, which wakes the main thread, and only then drops its own
    reference to it; woken, the main thread often takes the core, and the worker's free of the
    Work's tensors lands milliseconds later, past the next peak (seen: a 147,968 B FSDP all-gather
    output freed 2.5 ms after FSDP dropped it). A worker that has dropped it sleeps on its queue."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    me = str(threading.get_native_id())
    deadline = time.monotonic() + _SETTLE_LIMIT_S
    while time.monotonic() < deadline:
        if not any(_runnable(task) for task in tasks.iterdir() if task.name != me):
            return
        time.sleep(_SETTLE_POLL_S)   # not a spin: the threads waited for need this core


def _runnable(task: Path) -> bool:
    """Whether the thread ``/proc/self/task/<tid>`` is running or waiting for a core (state R)."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
    except OSError:   # the thread ended meanwhile
        return False


@contextlib.contextmanager
def _waits_let_gloo_release():
    """Every wait on a collective (``Work.wait``, functional collectives' ``wait_tensor``) also waits
    for gloo's threads to settle (``_other_threads_settled``), so the tensors a finished Work held are
    freed before the main thread goes on, in program order."""
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import Work

    work_wait, wait_tensor = Work.wait, funcol.wait_tensor

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        out = work_wait(work, *args, **kwargs)
        _other_threads_settled()
        return out

    def settled_wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        out = wait_tensor(tensor)
        _other_threads_settled()
        return out

    Work.wait, funcol.wait_tensor = wait, settled_wait_tensor
    try:
        yield
    finally:
        Work.wait, funcol.wait_tensor = work_wait, wait_tensor


def _events(tree: list) -> list:
    """Every event of the profiler's event tree, parents and children."""
    out, stack = [], list(tree)
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(e.children)
    return out


def _window_peaks(windows: list[tuple[int, int]], allocations: list) -> list[int]:
    """Each window's peak of the allocator's live bytes above the value just before its first event.

    ``allocations`` are the profiler's allocation events sorted by time; each carries the allocator's
    count of live bytes after it (``total_allocated``), which includes frees that had no event of
    their own (a summed ``alloc_size`` would never take those back)."""
    peaks = []
    for lo, hi in windows:
        inside = [a.extra_fields for a in allocations if lo <= a.start_time_ns <= hi]
        start = inside[0].total_allocated - inside[0].alloc_size
        peaks.append(max([start] + [a.total_allocated for a in inside]) - start)
    return peaks


def _profiled_steps(step: Any, steps: int = MEASURED_STEPS) -> tuple[list[int], list[dict]]:
    """(peak bytes above its start of each of ``steps`` real steps, collectives of the first).

    The profiler window holds one step before them: a block allocated before the window and freed
    inside it has no allocation event, so its free would be dropped (the profiler warns "Memory block
    of unknown size"); e.g. a pipeline stage keeps the previous step's outputs until the next step.

    Two ways gloo's worker thread made a step's peak one or more blocks too high, both because it
    drops its reference to a finished Work (and so may free the Work's tensors: FSDP all-gather
    outputs, functional all-gather outputs, gloo's reduce-scatter copies) after the main thread has
    dropped its own:
    - the free has no ``[memory]`` event (the thread no longer carries the profiler's state), so the
      summed event sizes never took it back, often in every step of a run (seen: the address of a
      147,968 B FSDP all-gather output handed out again with no free in between and the step ending
      147,968 B above its start; +32 KiB blocks in Llama's sequence-parallel steps). The peak is now
      the allocator's own count of live bytes, counted on every thread
      (``_cpu_allocator_counts_every_thread``);
    - the free comes milliseconds late, past the next peak, when the woken main thread took the core
      (``_other_threads_settled``): every wait now also waits for gloo's threads to settle
      (``_waits_let_gloo_release``), so the frees land in program order, as the prediction has them.
    With both, every measured step of every 2-rank test configuration had the same peak in 10 runs
    each; the minimum over the steps stays for a worker that sleeps on a lock before its release,
    which a settled thread cannot be told apart from. Two steps are profiled (each costs the settle
    waits and the profiler's bookkeeping: 6 steps made the suite's truth runs twice as long); when
    they disagree on any rank, ``run_config_on_rank`` profiles RECHECK_STEPS more on every rank.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    gc.disable()  # a cyclic collection inside the step would free autograd cycles at random points
    try:
        with _cpu_allocator_counts_every_thread(), _waits_let_gloo_release(), profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True
        ) as prof:
            step()
            for _ in range(steps):
                gc.collect()
                time.sleep(0.01)   # let gloo's thread release the last step's buffers before the next starts
                with record_function(MEASURED_STEP):
                    step()
    finally:
        gc.enable()
    tree = _events(prof.profiler.kineto_results.experimental_event_tree())
    windows = sorted((e.start_time_ns, e.end_time_ns) for e in tree if e.name == MEASURED_STEP)
    allocations = sorted((e for e in tree if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    peaks = _window_peaks(windows, allocations)
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    first = next(e for e in events if e.name() == MEASURED_STEP)
    collectives = []
    for e in events:
        if e.name().startswith("gloo:") and first.start_ns() <= e.start_ns() <= first.end_ns():
            numels = [_numel(s) for s in e.shapes() if s]
            collectives.append({"op": e.name()[len("gloo:") :], "dtype": (e.dtypes() or [""])[0], "numel": numels})
    return peaks, collectives


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the world (one tiny all-reduce, outside any profiled step)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_config_on_rank(cfg: TruthConfig, rank: int) -> RankTruth:
    import torch.distributed as dist

    step, opt, named = _prepare(cfg, rank)
    grads: dict[str, list[int]] = {}

    def record_grads(*_: Any) -> None:  # what AdamW steps: each .grad's local shape
        grads.update({n: list(_local(p.grad).shape) for n, p in named.items() if p.grad is not None})

    hook = opt.register_step_pre_hook(record_grads)
    step()  # AdamW creates its state (and DDP its buckets) on the first step
    hook.remove()
    dist.barrier()
    params = [_local(p) for p in named.values()]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    start_params = _storage_bytes(params)
    start_opt = _storage_bytes([_local(v) for v in state])
    local = {
        n: {"shape": list(_local(p).shape), "storage_bytes": _local(p).untyped_storage().nbytes(),
            "grad_shape": grads.get(n)}
        for n, p in named.items()
    }
    peaks, collectives = _profiled_steps(step)
    if _any_rank(len(set(peaks)) > 1):   # every rank profiles again, or their collectives would not pair
        peaks += _profiled_steps(step, RECHECK_STEPS)[0]
    times = []
    for _ in range(cfg.timed_steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return RankTruth(
        rank, min(peaks), start_params, start_opt, collectives, local, statistics.median(times) if times else 0.0,
        peaks
    )


# what the configurations import: the forkserver imports them before forking any rank
# (``_use_forkserver``), and each rank's frozen heap holds them (``_freeze_imported_heap``)
_PRELOADED = ("torch", "torch.distributed._functional_collectives", "torch.distributed.fsdp",
              "torch.distributed.pipelining", "torch.distributed.tensor.parallel", "torch.profiler")


def _freeze_imported_heap() -> None:
    """Import ``_PRELOADED``, collect, and freeze the heap (``gc.freeze``): each profiled step is
    preceded by ``gc.collect()``, which otherwise walks every object of torch, dynamo and pipelining
    again (180 ms a call on this VM, about 2 CPU-minutes over the test suite's truth runs). The steps'
    own garbage is created after the freeze, so the collections still free it."""
    import importlib

    for name in _PRELOADED:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def _worker(rank: int, world: int, port: int, configs: list[TruthConfig], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _freeze_imported_heap()
    try:
        results = []
        for cfg in configs:
            results.append(asdict(run_config_on_rank(cfg, rank)))
            gc.collect()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_START = "forkserver"


def _use_forkserver() -> None:
    """Have the forkserver (started at its first use, with this process's sys.path and environment)
    import ``_PRELOADED`` and this module before it forks any rank."""
    import multiprocessing

    multiprocessing.set_forkserver_preload([*_PRELOADED, __name__])


def run_configs(configs: list[TruthConfig]) -> list[ConfigTruth]:
    """Run every configuration (all with the same world size) in one start of ``world`` processes."""
    import torch.multiprocessing as mp

    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one world size per spawn, got {sorted(worlds)}")
    world = worlds.pop()
    with tempfile.TemporaryDirectory() as out_dir:
        env = {"OMP_NUM_THREADS": "1"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            _use_forkserver()
            mp.start_processes(_worker, (world, _free_port(), list(configs), out_dir), nprocs=world, join=True,
                               start_method=_START)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    return [
        ConfigTruth(cfg, [RankTruth(**per_rank[r][i]) for r in range(world)]) for i, cfg in enumerate(configs)
    ]


def default_configs() -> list[TruthConfig]:
    """The benchmark's set: both models under every parallelism (2 ranks; HSDP, TP x FSDP and the
    pipeline combinations on 4; pp x HSDP on 8)."""
    configs = []
    for model in ("llama", "gpt"):
        configs += [
            TruthConfig(model, "ddp", 2),
            TruthConfig(model, "fsdp", 2, reshard_after_forward=True),
            TruthConfig(model, "fsdp", 2, reshard_after_forward=False),
            TruthConfig(model, "tp", 2),
            *([TruthConfig(model, "tp_vocab", 2), TruthConfig(model, "tp_sp", 2)] if model == "llama" else []),
            TruthConfig(model, "pp", 2, schedule="1f1b"),
            TruthConfig(model, "pp", 2, schedule="gpipe"),
            TruthConfig(model, "hsdp", 4),
            TruthConfig(model, "tp_fsdp", 4),
            TruthConfig(model, "pp_tp", 4, schedule="1f1b"),
            # torchtitan's plan on the stages: the vocabulary-parallel ends, cross-entropy (gathered, or
            # loss parallel), and Llama with sequence parallelism
            TruthConfig(model, "pp_tp_vocab", 4, loss="cross_entropy", loss_parallel=model == "gpt"),
            *([TruthConfig(model, "pp_tp_vocab", 4, loss="cross_entropy", loss_parallel=True),
               TruthConfig(model, "pp_tp_sp", 4, loss="cross_entropy", loss_parallel=True),
               TruthConfig(model, "tp_vocab", 2, loss="cross_entropy"),
               TruthConfig(model, "tp_vocab", 2, loss="cross_entropy", loss_parallel=True),
               TruthConfig(model, "tp_sp", 2, loss="cross_entropy", loss_parallel=True),
               # 8 micro-batches: the last stage peaks at _merge_outputs' cat of its output chunks
               TruthConfig(model, "pp_tp_vocab", 4, batch=8, microbatches=8, loss="cross_entropy")]
              if model == "llama" else []),
            TruthConfig(model, "pp", 2, batch=8, microbatches=8, loss="cross_entropy"),
            TruthConfig(model, "pp_ddp", 4, schedule="1f1b"),
            TruthConfig(model, "pp_fsdp", 4, schedule="1f1b", reshard_after_forward=False),
            # pp x FSDP resharding the layers after forward (the stage module keeps fully_shard's root
            # default): 1F1B with 2 layers per stage, GPipe, 8 micro-batches, mixed precision
            TruthConfig(f"{model}4", "pp_fsdp", 4, schedule="1f1b", reshard_after_forward=True),
            TruthConfig(model, "pp_fsdp", 4, schedule="gpipe", reshard_after_forward=True),
            TruthConfig(model, "pp_fsdp", 4, schedule="1f1b", reshard_after_forward=True, batch=8, microbatches=8),
            TruthConfig(model, "pp_fsdp", 4, schedule="1f1b", reshard_after_forward=True, param_dtype="bfloat16",
                        reduce_dtype="float32"),
            # DDP's gradient_as_bucket_view, each next to the default at the same shapes: at seq 8 the
            # optimizer step (all gradients alive without the option) is the peak, so the option shows
            *[TruthConfig(model, parallel, world, batch=batch, seq=8, gradient_as_bucket_view=view)
              for parallel, world, batch in (("ddp", 2, 2), ("pp_ddp", 4, 4)) for view in (False, True)],
            # FSDP2 MixedPrecisionPolicy: bf16 parameters, fp32 (torchtitan's default) or bf16 reduction
            TruthConfig(model, "fsdp", 2, param_dtype="bfloat16", reduce_dtype="float32"),
            TruthConfig(model, "fsdp", 2, reshard_after_forward=False, param_dtype="bfloat16",
                        reduce_dtype="float32"),
            TruthConfig(model, "fsdp", 2, param_dtype="bfloat16", reduce_dtype="bfloat16"),
            TruthConfig(model, "hsdp", 4, param_dtype="bfloat16", reduce_dtype="float32"),
            TruthConfig(model, "tp_fsdp", 4, param_dtype="bfloat16", reduce_dtype="float32"),
            *[TruthConfig(model, "pp_fsdp", 4, schedule="1f1b", reshard_after_forward=False, param_dtype="bfloat16",
                          reduce_dtype=reduce) for reduce in ("float32", "bfloat16")],
            # pp x HSDP on 8 ranks (pp=2 x replicate=2 x shard=2), also with mixed precision
            TruthConfig(model, "pp_hsdp", 8, schedule="1f1b", reshard_after_forward=False),
            TruthConfig(model, "pp_hsdp", 8, schedule="1f1b", reshard_after_forward=False, param_dtype="bfloat16",
                        reduce_dtype="float32"),
            # fully_shard on the whole model only: one unit
            TruthConfig(model, "fsdp", 2, fsdp_wrap="root"),
            TruthConfig(model, "fsdp", 2, reshard_after_forward=False, fsdp_wrap="root"),
            # ScheduleInterleaved1F1B: the 4-layer model, 2 ranks x 2 chunks of one layer
            TruthConfig(f"{model}4", "pp", 2, schedule="interleaved_1f1b", microbatches=4),
            TruthConfig(f"{model}4", "pp", 2, schedule="interleaved_1f1b", microbatches=2),
            # ... and with each chunk fully_shard'ed over a dp group of 2 (pp=2 x dp_shard=2), also with
            # mixed precision
            TruthConfig(f"{model}4", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=False),
            TruthConfig(f"{model}4", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=False,
                        param_dtype="bfloat16", reduce_dtype="float32"),
            # ... with the layers resharding after forward
            TruthConfig(f"{model}4", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=True),
            # each stage module fully_shard'ed alone (--fsdp-wrap root)
            TruthConfig(model, "pp_fsdp", 4, schedule="1f1b", reshard_after_forward=False, fsdp_wrap="root"),
            # 4 chunks per rank (8 layers; Llama): the runtime keeps 3 gathered, re-gathering the others
            # (async, mid-step: gloo's temporaries of a re-gather live until the peer arrives, so the real
            # per-step peaks of these rows vary by up to 6%; peak_bytes is their minimum)
            *([TruthConfig("llama8", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=reshard,
                           stages_per_rank=4) for reshard in (False, True)]
              + [TruthConfig("llama8", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=False,
                             stages_per_rank=4, param_dtype="bfloat16", reduce_dtype="float32"),
                 TruthConfig("llama8", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=False,
                             stages_per_rank=4, fsdp_wrap="root")]
              if model == "llama" else []),
        ]
    return configs
