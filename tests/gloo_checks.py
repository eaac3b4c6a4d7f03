"""Checks the distributed tests share: a configuration's per-rank programs, the resident bytes of a role,
and predicted per-rank peaks against a real gloo run of the same configuration."""
from __future__ import annotations

import functools

import distributed_predict as predict
import distributed_truth as truth

TOLERANCE = 0.01   # predicted peak within 1% of the profiler's (issue 17)

# data parallelism (tests/test_distributed_memory.py): DDP and FSDP2 with and without reshard after forward
# on 2 ranks (timed_steps=0 everywhere: the tests read memory and collectives; the benchmark times steps)
MEMORY_TWO_RANKS = [
    truth.TruthConfig(model, parallel, 2, reshard_after_forward=reshard, timed_steps=0)
    for model in ("llama", "gpt")
    for parallel, reshard in (("ddp", True), ("fsdp", True), ("fsdp", False))
]
# DDP's gradient_as_bucket_view next to the default at the same shapes: at seq 8 the optimizer step,
# where every gradient is alive without the option, is the peak, so the option changes it
BUCKET_VIEW = [
    truth.TruthConfig(model, "ddp", 2, batch=2, seq=8, gradient_as_bucket_view=view, timed_steps=0)
    for model in ("llama", "gpt")
    for view in (False, True)
]
MEMORY_TWO_RANKS += BUCKET_VIEW
# FSDP2 MixedPrecisionPolicy: bf16 parameters, fp32 (torchtitan's default) or bf16 gradient reduction
MIXED_PRECISION = [
    truth.TruthConfig("llama", "fsdp", 2, timed_steps=0, param_dtype="bfloat16", reduce_dtype="float32"),
    truth.TruthConfig("llama", "fsdp", 2, timed_steps=0, param_dtype="bfloat16", reduce_dtype="bfloat16"),
    truth.TruthConfig("gpt", "fsdp", 2, reshard_after_forward=False, timed_steps=0, param_dtype="bfloat16",
                      reduce_dtype="float32"),
]
MEMORY_TWO_RANKS += MIXED_PRECISION
# fully_shard on the whole model only (one unit: every parameter gathered at once)
MEMORY_TWO_RANKS += [
    truth.TruthConfig("llama", "fsdp", 2, timed_steps=0, fsdp_wrap="root"),
    truth.TruthConfig("gpt", "fsdp", 2, reshard_after_forward=False, timed_steps=0, fsdp_wrap="root")]
# gradient accumulation without pipelining: the batch as 2 micro-batches (later ones hold every gradient
# from their start); DDP's bucket view keeps no gradient storage, so nothing is added there
ACCUMULATION = [
    truth.TruthConfig(model, parallel, 2, accumulation=2, timed_steps=0)
    for model in ("llama", "gpt")
    for parallel in ("ddp", "fsdp")
] + [truth.TruthConfig("gpt", "ddp", 2, batch=2, seq=8, gradient_as_bucket_view=True, accumulation=2, timed_steps=0),
      truth.TruthConfig("llama", "fsdp", 2, batch=8, accumulation=4, reshard_after_forward=False, timed_steps=0)]
MEMORY_TWO_RANKS += ACCUMULATION
# HSDP (replicate 2 x shard 2) on 4 ranks, also with mixed precision
MEMORY_FOUR_RANKS = [truth.TruthConfig(model, "hsdp", 4, timed_steps=0) for model in ("llama", "gpt")] + [
    truth.TruthConfig("llama", "hsdp", 4, timed_steps=0, param_dtype="bfloat16", reduce_dtype="float32")]

# pipeline parallelism on 2 ranks (tests/test_distributed_pp.py): both models under 1F1B and GPipe,
# ScheduleInterleaved1F1B over 4 layers (2 ranks x 2 chunks of one layer), and a language model's loss on
# the last stage (cross-entropy against the micro-batch's labels)
PP_TWO_RANKS = [
    truth.TruthConfig(model, "pp", 2, schedule=schedule, timed_steps=0)
    for model in ("llama", "gpt")
    for schedule in ("1f1b", "gpipe")
] + [
    truth.TruthConfig("llama4", "pp", 2, schedule="interleaved_1f1b", microbatches=4, timed_steps=0),
    truth.TruthConfig("llama4", "pp", 2, schedule="interleaved_1f1b", microbatches=2, timed_steps=0),
    truth.TruthConfig("gpt4", "pp", 2, schedule="interleaved_1f1b", microbatches=4, timed_steps=0),
] + [truth.TruthConfig(model, "pp", 2, timed_steps=0, loss="cross_entropy") for model in ("llama", "gpt")]
# GPT-2's tied embedding and head on the two end stages, the gradient all-reduced between them
PP_TIED = [truth.TruthConfig("gpt_tied", "pp", 2, schedule=schedule, timed_steps=0) for schedule in ("1f1b", "gpipe")]
PP_TWO_RANKS += PP_TIED
# ... with each stage's shards (the local part all-reduced) or TP ranks (the replicated copy)
PP_TIED_FOUR_RANKS = [truth.TruthConfig("gpt_tied", "pp_fsdp", 4, reshard_after_forward=False, timed_steps=0),
                      truth.TruthConfig("gpt_tied", "pp_tp", 4, timed_steps=0)]

# tensor parallelism on 2 ranks (tests/test_distributed_tp.py): both models, then Llama with torchtitan's
# vocabulary-parallel ends and with sequence parallelism, also with a language model's cross-entropy on
# the gathered logits and under torchtitan's loss parallel
TP_TWO_RANKS = [truth.TruthConfig(model, "tp", 2, timed_steps=0) for model in ("llama", "gpt")] + [
    truth.TruthConfig("llama", "tp_vocab", 2, timed_steps=0),
    truth.TruthConfig("llama", "tp_sp", 2, timed_steps=0),
    truth.TruthConfig("llama", "tp_vocab", 2, timed_steps=0, loss="cross_entropy"),
    truth.TruthConfig("llama", "tp_vocab", 2, timed_steps=0, loss="cross_entropy", loss_parallel=True),
    truth.TruthConfig("llama", "tp_sp", 2, timed_steps=0, loss="cross_entropy", loss_parallel=True),
]

# pp x FSDP2 with MixedPrecisionPolicy: bf16 parameters with torchtitan's fp32 reduction (both models)
# and with bf16 reduction (Llama); run with the other 4-rank truths (conftest.four_rank_gloo_runs)
PP_FSDP_MIXED_PRECISION = [
    truth.TruthConfig(model, "pp_fsdp", 4, reshard_after_forward=False, timed_steps=0, param_dtype="bfloat16",
                      reduce_dtype=reduce)
    for model, reduce in (("llama", "float32"), ("gpt", "float32"), ("llama", "bfloat16"))]

# ScheduleInterleaved1F1B with FSDP: the 4-layer models, pp=2 ranks x 2 chunks of one layer, dp_shard=2
PP_FSDP_INTERLEAVED = [
    truth.TruthConfig(model, "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=False, timed_steps=0)
    for model in ("llama4", "gpt4")]

# ... with the layers resharding after forward (their hooks gather again). 4 chunks per rank (the runtime
# reshards chunks and gathers them again mid-step) are compared in benchmarks/results/distributed_gloo.md
# only: the async re-gather's gloo temporaries live until the peer arrives, so the real per-step peak
# varies by up to 6% between steps (the prediction is their minimum); tests check those programs against
# torch's own lowering instead (test_distributed_pp.py)
PP_FSDP_INTERLEAVED_RESHARDING = [
    truth.TruthConfig(model, "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=True, timed_steps=0)
    for model in ("llama4", "gpt4")]

# ... and fully_shard on each stage (or chunk) module only (--fsdp-wrap root): one unit each, gathered once
# a step (the root never reshards after forward)
PP_FSDP_WRAP_ROOT = [
    truth.TruthConfig("llama", "pp_fsdp", 4, reshard_after_forward=False, timed_steps=0, fsdp_wrap="root"),
    truth.TruthConfig("gpt", "pp_fsdp", 4, reshard_after_forward=True, timed_steps=0, fsdp_wrap="root", schedule="gpipe"),
    truth.TruthConfig("llama4", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=False, timed_steps=0,
                      fsdp_wrap="root")]

# pp x FSDP2 resharding after forward (the layers; the stage module, FSDP's root, keeps fully_shard's
# default and stays gathered): 1F1B with two layers per stage, GPipe, 8 micro-batches (built whole: the
# 3-micro-batch template does not replay it), and torchtitan's mixed precision
PP_FSDP_RESHARD = [
    truth.TruthConfig("llama4", "pp_fsdp", 4, reshard_after_forward=True, timed_steps=0),
    truth.TruthConfig("gpt", "pp_fsdp", 4, reshard_after_forward=True, timed_steps=0, schedule="gpipe"),
    truth.TruthConfig("llama", "pp_fsdp", 4, reshard_after_forward=True, timed_steps=0, batch=8, microbatches=8),
    truth.TruthConfig("llama", "pp_fsdp", 4, reshard_after_forward=True, timed_steps=0, param_dtype="bfloat16",
                      reduce_dtype="float32")]

# pp x torchtitan's TP plan (pp=2 x tp=2): the vocabulary-parallel ends on the first and last stages,
# with cross-entropy gathered or under loss parallel, and with sequence parallelism
PP_TP_VOCAB = [
    truth.TruthConfig("llama", "pp_tp_vocab", 4, timed_steps=0, loss="cross_entropy"),
    truth.TruthConfig("llama", "pp_tp_sp", 4, timed_steps=0, loss="cross_entropy", loss_parallel=True),
    truth.TruthConfig("gpt", "pp_tp_vocab", 4, timed_steps=0, loss="cross_entropy", loss_parallel=True),
    # 8 micro-batches: the last stage's peak is _merge_outputs' cat of the gathered logits chunks
    truth.TruthConfig("llama", "pp_tp_vocab", 4, batch=8, microbatches=8, timed_steps=0, loss="cross_entropy")]


@functools.lru_cache(maxsize=None)
def rank_classes(cfg: truth.TruthConfig):
    """The single-device training program of ``cfg``'s model and its rank classes under ``cfg`` (built
    once per configuration: the peak, shard, collective and send checks of one configuration share them)."""
    from boomfx.distributed.ranks import rank_programs

    program = predict.training_program(cfg)
    return program, rank_programs(program, predict.parallel_config(cfg))


def resident_bytes(program, role: str) -> int:
    """Bytes of the placeholders of ``role`` ("param", "opt_state", ...)."""
    from boomfx.passes.liveness import _compute_nbytes

    return sum(int(_compute_nbytes(n.meta["val"])) for n in program.graph.nodes
               if n.op == "placeholder" and program.input_roles.get(n.name) == role)


def assert_peaks_match(cfg: truth.TruthConfig, predicted: list[int], real: truth.ConfigTruth) -> None:
    """Every rank's predicted peak within ``TOLERANCE`` of the gloo run's."""
    assert predicted is not None and len(predicted) == cfg.world
    for rank, (p, r) in enumerate(zip(predicted, real.ranks)):
        assert r.peak_bytes > 0
        assert abs(p - r.peak_bytes) <= TOLERANCE * r.peak_bytes, (
            f"{cfg.name} rank {rank}: predicted {p} B vs gloo {r.peak_bytes} B ({p / r.peak_bytes - 1:+.2%})")
