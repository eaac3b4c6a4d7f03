"""boomfx's per-rank prediction for a ground-truth configuration of distributed_truth.py, on this CPU.

The same model is exported at the configuration's per-rank batch, captured as an AdamW training
step for a CPU target, rewritten into each rank's program (boomfx.distributed), and every compute
kernel's scratch is measured here (a kernel database collected on the fly, as
tests/test_cpu_memory_accuracy.py does for one process). Returns each rank's predicted peak above
the step's start (``peak_live_bytes - resident_bytes``, less what a pipeline stage carries over from
the previous step and frees first), the quantity the harness measures.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

import distributed_truth as truth
from boomfx.core.program import Program


def parallel_config(cfg: truth.TruthConfig):
    from boomfx.distributed.plan import ParallelConfig

    degrees = {
        "ddp": dict(dp_replicate=cfg.world),
        "fsdp": dict(dp_shard=cfg.world),
        "hsdp": dict(dp_replicate=2, dp_shard=cfg.world // 2),
        "tp": dict(tp=cfg.world),
        "tp_vocab": dict(tp=cfg.world, vocab_parallel=True),
        "tp_sp": dict(tp=cfg.world, vocab_parallel=True, sp=True),
        "pp": dict(pp=cfg.world),
        "tp_fsdp": dict(dp_shard=cfg.world // 2, tp=2),
        "pp_tp": dict(pp=2, tp=cfg.world // 2),
        "pp_tp_vocab": dict(pp=2, tp=cfg.world // 2, vocab_parallel=True),
        "pp_tp_sp": dict(pp=2, tp=cfg.world // 2, vocab_parallel=True, sp=True),
        "pp_ddp": dict(pp=2, dp_replicate=cfg.world // 2),
        "pp_fsdp": dict(pp=2, dp_shard=cfg.world // 2),
        "pp_hsdp": dict(pp=2, dp_replicate=2, dp_shard=cfg.world // 4),
    }[cfg.parallel]
    return ParallelConfig(
        **degrees,
        reshard_after_forward=cfg.reshard_after_forward,
        pp_schedule=cfg.schedule,
        pp_stages_per_rank=cfg.stages_per_rank if cfg.schedule == "interleaved_1f1b" else None,
        microbatches=cfg.microbatches if cfg.parallel.startswith("pp") else (
            cfg.accumulation if cfg.accumulation > 1 else None),
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        fsdp_param_dtype=cfg.param_dtype,
        fsdp_reduce_dtype=cfg.reduce_dtype,
        fsdp_wrap=cfg.fsdp_wrap,
        loss_parallel=cfg.loss_parallel if degrees.get("vocab_parallel") else None,
        backend="gloo",
    )


def export(cfg: truth.TruthConfig) -> torch.export.ExportedProgram:
    """``cfg``'s model exported at its per-rank shapes (batch and sequence dynamic)."""
    return _export(cfg.model, cfg.batch, cfg.seq)


@functools.lru_cache(maxsize=None)
def _export(model_name: str, batch: int, seq: int) -> torch.export.ExportedProgram:
    from torch.export import Dim

    model = truth.build_model(model_name)
    idx = torch.randint(0, truth.VOCAB, (batch, seq))
    dims = {"idx": {0: Dim("batch", min=1, max=512), 1: Dim("seq", min=2, max=256)}}
    return torch.export.export(model, (idx,), dynamic_shapes=dims)


def training_program(cfg: truth.TruthConfig) -> Program:
    """``cfg``'s AdamW training step captured for a CPU target, once per model, shapes and loss: the
    configurations of one model share it (``rank_programs`` rewrites copies and leaves it as it is)."""
    return _training_program(cfg.model, cfg.batch, cfg.seq, cfg.loss)


@functools.lru_cache(maxsize=None)
def _training_program(model_name: str, batch: int, seq: int, loss: str) -> Program:
    from boomfx.core.program import ProgramOptions
    from boomfx.frontend.capture import capture

    return capture(_export(model_name, batch, seq), options=ProgramOptions(True, "adamw", target_kind="cpu", loss=loss,
                                                                                 foreach=True))   # as the truth's AdamW


def predicted_rank_peaks(cfg: truth.TruthConfig, db: str | None = None, classes=None) -> list[int] | None:
    """Each rank's predicted peak above the step's start; ``classes``: the configuration's rank
    classes when the caller already built them (``rank_programs`` of ``training_program(cfg)``)."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.frontend.capture import resolve_bindings
    from boomfx.core.devices import cpu_spec
    from boomfx.distributed.pipeline_stages import carried_bytes
    from boomfx.distributed.ranks import rank_programs
    from boomfx.core.errors import OptionError
    from boomfx.kernels_db.collect import collect_calls
    from boomfx.kernels_db.measure import Measurer
    from boomfx.kernels_db.store import Store

    spec = cpu_spec()
    if classes is None:
        try:
            classes = rank_programs(training_program(cfg), parallel_config(cfg))
        except OptionError:
            return None
    bindings = resolve_bindings(classes[0].program, {}, cfg.batch, cfg.seq)
    pp = parallel_config(cfg).pp > 1
    if pp or cfg.accumulation > 1:  # the stage programs (and accumulation) run one micro-batch at a time
        from boomfx.distributed.pipeline_stages import micro_bindings

        bindings = micro_bindings(classes[0].program, parallel_config(cfg), bindings)
    tmp = None
    if db is None:
        tmp = tempfile.TemporaryDirectory()
        db = str(Path(tmp.name) / "cpu.db")
    measurer = Measurer("cpu", warmup_s=0.0, target_s=0.0, min_runs=1, max_runs=1, min_sample_ns=0)
    peaks: dict[int, int] = {}
    for rc in classes:
        calls = [
            c
            for c in Analysis(rc.program, spec, AnalyzeOptions(spec.name, db="none")).kernel_calls(bindings)
            if c.op.namespace == "aten"
        ]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)   # the ranks' thread count: oneDNN's bf16 GEMM scratch depends on it
        try:
            # read for workspaces only: the one-sample times of a loaded machine are not judged
            collect_calls(Store(db), calls, "cpu", progress=False, measurer=measurer, check_plausible=False)
        finally:
            torch.set_num_threads(threads)
        analysis = Analysis(rc.program, spec, AnalyzeOptions(spec.name, db=db))
        memory = analysis.evaluate(bindings, memory_only=True).report.memory
        if cfg.accumulation > 1:   # the later micro-batches, every gradient alive from their start
            from boomfx.distributed.accumulation import accumulated_memory

            memory = accumulated_memory(analysis, bindings)
        # a pipeline stage starts its step with the last step's output chunks / input gradients alive
        # and frees them first: the measured peak above the start does not count them
        carried = carried_bytes(rc.program, analysis.evaluator(bindings)) if pp else 0
        for r in rc.ranks:
            peaks[r] = memory.peak_live_bytes - memory.resident_bytes - carried
    if tmp is not None:
        tmp.cleanup()
    return [peaks[r] for r in range(cfg.world)]
