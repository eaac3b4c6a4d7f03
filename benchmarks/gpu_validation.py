"""GPU validation in one run (about 7 minutes on an H100/H200): collect, predict, run for real, compare.

    python benchmarks/gpu_validation.py --out "$OUT"            # on a CUDA machine
    python benchmarks/gpu_validation.py --dry-run --out /tmp/v  # CPU, tiny sizes: exercises every code path

Stages (each wrapped: a failure is recorded in the results and the next stage still runs; every
stage prints a timestamped line, and the results are rewritten after each one):

1. export: a GPT-2 (transformers GPT2Config, 12 layers), a Llama-style decoder (LlamaConfig, 8 layers,
   GQA) and a ResNet-50 (ResNetConfig), on the meta device with dynamic batch (and seq); in fp32 and,
   for pure-bf16 cases, with bf16 weights.
2. capture: the inference and training programs boomfx analyses: fp32, bf16 autocast (``--amp bf16``)
   or pure bf16 (bf16 weights), eager or ``--compile``; a case's ``phase`` is inference, forward+backward
   (``fwdbwd``: predicted as the step minus its optimizer phase) or the full training step.
3. snapshot: one GPT-2 training step on the GPU with ``torch.cuda.memory._record_memory_history()``
   from an empty allocator, dumped with ``_dump_snapshot`` (``tests/test_snapshot_replay.py`` replays it).
4. measure: each case for real (``torch.compile(model)`` for compiled cases), CUDA events, median of
   >= 5 steps after warm-up; peak ``max_memory_allocated`` / ``max_memory_reserved`` after
   ``reset_peak_memory_stats``; then one step under ``torch.profiler``: every kernel's device time and
   every aten op's, next to boomfx's predicted time per op (``profile`` in the JSON, ``kernels_by_op.md``).
5. collect: the kernel database of this GPU, sweep mode (bf16 and fp32, time-budgeted) then
   model-guided (the kernels of each case) through ``boomfx.kernels_db.collect``.
6. predict: each case with ``--device`` = this GPU's registry name, with the collected DB and without one.
7. blocks (time permitting): block mode, each repeated block measured whole, then predicted again.
8. report: ``gpu_validation.json`` (raw), ``gpu_validation.md`` (error table), ``kernels.csv`` (the DB).

Real runs use ``model.eval()`` (no dropout; BatchNorm running statistics) to run the exported graph;
a training step is ``loss = first_output.mean(); loss.backward(); AdamW(foreach=True).step()``, which
is the step boomfx traces for a model without a ``labels`` input.

Known limitations:
- Measured memory is the caching allocator's (``max_memory_*``); the CUDA context and library
  workspaces outside it are reported by boomfx but not compared.
- One process: the kernel collection runs after the real runs so their allocator state is clean.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TIME_LIMIT_S = 450.0               # the whole script; the device lease is 8 minutes
WARMUP_STEPS = 3
TIMED_STEPS = 7


# ---------------------------------------------------------------------------------------------------
# Cases and sizes
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    model: str                      # "gpt2" | "llama" | "resnet"
    train: bool
    amp: Optional[str]              # None (fp32) or "bf16" autocast
    batch: int
    seq: Optional[int]              # None for images
    pure_bf16: bool = False         # bf16 weights and activations (no autocast)
    compiled: bool = False          # torch.compile(model) / boomfx --compile
    fwd_bwd_only: bool = False      # forward + backward, no optimizer step (train only)

    @property
    def precision(self) -> str:
        return "pure-bf16" if self.pure_bf16 else (self.amp or "fp32")

    @property
    def name(self) -> str:
        mode = ("fwdbwd" if self.fwd_bwd_only else "train") if self.train else "inference"
        return f"{self.model}-{mode}-{self.precision}" + ("-compiled" if self.compiled else "")


def cases(dry_run: bool) -> list[Case]:
    if dry_run:
        return [Case("gpt2", False, None, 2, 16), Case("gpt2", True, None, 2, 16),
                Case("gpt2", True, None, 2, 16, pure_bf16=True, fwd_bwd_only=True),
                Case("gpt2", True, "bf16", 2, 16, compiled=True),
                Case("llama", False, None, 2, 16), Case("llama", True, None, 2, 16),
                Case("resnet", False, None, 2, None), Case("resnet", True, None, 2, None)]
    # ~7 minutes on an H100: the compiled cases pay Inductor's compile (~30-60 s each) in their warm-up.
    return [Case("gpt2", False, None, 8, 512), Case("gpt2", True, None, 8, 512),
            Case("gpt2", True, "bf16", 8, 512), Case("gpt2", True, "bf16", 8, 512, fwd_bwd_only=True),
            Case("gpt2", True, None, 8, 512, pure_bf16=True), Case("gpt2", True, "bf16", 8, 512, compiled=True),
            Case("llama", False, "bf16", 4, 1024), Case("llama", True, "bf16", 4, 512),
            Case("llama", True, None, 4, 512, pure_bf16=True), Case("llama", True, "bf16", 4, 512, compiled=True),
            Case("resnet", False, None, 32, None), Case("resnet", True, "bf16", 32, None)]


def build_model(name: str, dry_run: bool) -> torch.nn.Module:
    """The model (random weights, no download) on the current default device."""
    import transformers
    if name == "gpt2":
        cfg = (transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                                       bos_token_id=0, eos_token_id=0)
               if dry_run else transformers.GPT2Config())            # GPT-2 small: 12 x 768, 124M
        cfg.use_cache = False
        return transformers.GPT2LMHeadModel(cfg).eval()
    if name == "llama":
        cfg = (transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                        max_position_embeddings=128)
               if dry_run else transformers.LlamaConfig(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16,
                                                        num_key_value_heads=4, intermediate_size=2816,
                                                        vocab_size=32000, max_position_embeddings=2048))
        cfg.use_cache = False
        return transformers.LlamaForCausalLM(cfg).eval()
    if name == "resnet":
        cfg = (transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], num_labels=10)
               if dry_run else transformers.ResNetConfig())           # ResNet-50
        return transformers.ResNetForImageClassification(cfg).eval()
    raise KeyError(name)


def image_size(dry_run: bool) -> int:
    return 32 if dry_run else 224


def example_inputs(case: Case, dry_run: bool, device: Any, vocab: int) -> dict[str, torch.Tensor]:
    if case.model == "resnet":
        size = image_size(dry_run)
        return {"pixel_values": torch.randn(case.batch, 3, size, size, device=device)}
    return {"input_ids": torch.randint(0, vocab, (case.batch, case.seq), device=device)}


def export_model(name: str, dry_run: bool, out: Path, pure_bf16: bool = False) -> Path:
    from torch.export import Dim
    with torch.device("meta"):
        model = build_model(name, dry_run)
        if pure_bf16:
            model = model.to(torch.bfloat16)
    batch = Dim("batch", min=1, max=4096)
    if name == "resnet":
        size = image_size(dry_run)
        kwargs = {"pixel_values": torch.randn(2, 3, size, size, device="meta")}
        dynamic = {"pixel_values": {0: batch}}
    else:
        kwargs = {"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")}
        dynamic = {"input_ids": {0: batch, 1: Dim("seq", min=2, max=2048 if not dry_run else 128)}}
    ep = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic, strict=False)
    path = out / "exports" / f"{name}{'-bf16' if pure_bf16 else ''}.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ep, str(path))
    return path


# ---------------------------------------------------------------------------------------------------
# The run: stages, deadline, results
# ---------------------------------------------------------------------------------------------------
@dataclass
class Run:
    out: Path
    dry_run: bool
    device: torch.device
    target: Any                                   # boomfx DeviceSpec of the local device
    deadline: float
    cases: list[Case]
    results: dict[str, Any] = field(default_factory=dict)
    exports: dict[str, Path] = field(default_factory=dict)
    programs: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp} +{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def case(self, case: Case) -> dict:
        return self.results.setdefault("cases", {}).setdefault(case.name, {
            "model": case.model, "train": case.train, "amp": case.amp, "batch": case.batch, "seq": case.seq})

    def stage(self, name: str, fn: Callable[[], Any], min_s: float = 0.0) -> Any:
        """Run one stage; record its time or its error; never raise."""
        if self.remaining_s() < min_s:
            self.log(f"skip {name}: {self.remaining_s():.0f} s left")
            self.results.setdefault("stages", {})[name] = {"status": "skipped (time)"}
            return None
        self.log(f"start {name}")
        t0 = time.monotonic()
        try:
            value = fn()
            status = {"status": "ok"}
        except Exception as exc:  # noqa: BLE001 - one stage's failure must not stop the others
            value = None
            status = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
            self.log(f"error in {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        status["seconds"] = round(time.monotonic() - t0, 2)
        self.results.setdefault("stages", {})[name] = status
        self.log(f"end {name} ({status['status']}, {status['seconds']} s)")
        self.save()
        return value

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_validation.json").write_text(json.dumps(self.results, indent=2, default=str))


# ---------------------------------------------------------------------------------------------------
# Stage bodies
# ---------------------------------------------------------------------------------------------------
def _export_key(case: Case) -> str:
    return case.model + ("-bf16" if case.pure_bf16 else "")


def stage_export(run: Run) -> None:
    for name in sorted({_export_key(c) for c in run.cases}):
        try:
            model, _, weights = name.partition("-")
            run.exports[name] = export_model(model, run.dry_run, run.out, pure_bf16=weights == "bf16")
            run.log(f"  exported {name} -> {run.exports[name]}")
        except Exception as exc:  # noqa: BLE001
            run.results.setdefault("errors", []).append(f"export {name}: {type(exc).__name__}: {exc}")
            run.log(f"  export {name} failed: {exc}")


def _program_options(case: Case, run: Run) -> Any:
    from boomfx.core.program import ProgramOptions
    return ProgramOptions(case.train, "adamw", case.amp, False, target_kind=run.target.kind,
                          compile=case.compiled, foreach=True)   # the real step's AdamW(foreach=True)


def stage_capture(run: Run) -> None:
    from boomfx.frontend.capture import capture
    for case in run.cases:
        if _export_key(case) not in run.exports:
            continue
        try:
            t0 = time.monotonic()
            run.programs[case.name] = capture(str(run.exports[_export_key(case)]), options=_program_options(case, run))
            run.case(case)["capture_s"] = round(time.monotonic() - t0, 2)
        except Exception as exc:  # noqa: BLE001
            run.case(case)["capture_error"] = f"{type(exc).__name__}: {exc}"
        run.log(f"  captured {case.name}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_fn(model: torch.nn.Module, case: Case, inputs: dict, device: torch.device) -> Callable[[], Any]:
    """One inference forward or one training step (forward, mean loss, backward, AdamW foreach; the
    optimizer left out for ``fwd_bwd_only``). Compiled cases call ``torch.compile(model)``."""
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if case.amp == "bf16"
                else torch.autocast(device.type, enabled=False))
    if case.compiled:
        model = torch.compile(model)
    if not case.train:
        def infer() -> Any:
            with torch.no_grad(), autocast:
                return model(**inputs)
        return infer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def train() -> None:
        with autocast:
            out = model(**inputs)
            first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
            loss = first.mean()
        loss.backward()
        if not case.fwd_bwd_only:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return train


def _timed(step: Callable[[], Any], device: torch.device) -> list[float]:
    """Per-step times in ns: CUDA events on GPU, perf_counter on CPU."""
    samples = []
    for _ in range(TIMED_STEPS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) * 1e6)
        else:
            t0 = time.perf_counter_ns()
            step()
            samples.append(float(time.perf_counter_ns() - t0))
    return samples


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


PROFILE_TOP = 60


def profile_step(step: Callable[[], Any], device: torch.device) -> dict:
    """One step under ``torch.profiler``: device time of each kernel (self) and of each aten op (with its
    children), the largest ``PROFILE_TOP`` of each, in ns. On a CPU run the CPU times stand in."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    kernels, ops = [], []
    for ev in prof.key_averages():
        device_ns = float(getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0.0))) * 1e3
        total_device_ns = float(getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0))) * 1e3
        if device.type != "cuda":
            device_ns, total_device_ns = float(ev.self_cpu_time_total) * 1e3, float(ev.cpu_time_total) * 1e3
        row = {"name": ev.key, "count": int(ev.count)}
        if ev.key.startswith("aten::"):
            ops.append({**row, "time_ns": total_device_ns, "self_time_ns": device_ns})
        elif device.type == "cuda" and device_ns > 0:
            kernels.append({**row, "time_ns": device_ns})
    by_time = lambda rows: sorted(rows, key=lambda r: -r["time_ns"])[:PROFILE_TOP]   # noqa: E731
    return {"kernels": by_time(kernels), "aten_ops": by_time(ops)}


def measure_case(run: Run, case: Case) -> dict:
    dev = run.device
    torch.manual_seed(0)
    with torch.device(dev):
        model = build_model(case.model, run.dry_run)
        if case.pure_bf16:
            model = model.to(torch.bfloat16)
    vocab = getattr(model.config, "vocab_size", 2)
    inputs = example_inputs(case, run.dry_run, dev, vocab)
    if case.pure_bf16:
        inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    step = _step_fn(model, case, inputs, dev)
    try:
        for _ in range(WARMUP_STEPS):       # the first training step allocates the optimizer state
            step()
        _sync(dev)
        memory: dict[str, Any] = {}
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base_allocated = torch.cuda.memory_allocated(dev)
            step()
            torch.cuda.synchronize(dev)
            memory = {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(dev),
                      "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                      "allocated_before_step_bytes": base_allocated}
        samples = _timed(step, dev)
        return {"time_ns": statistics.median(samples), "samples_ns": samples, **memory,
                "profile": profile_step(step, dev)}
    finally:
        del step, model, inputs
        _release(dev)


def stage_measure(run: Run) -> None:
    for case in run.cases:
        if run.remaining_s() < 60:
            run.case(case)["measured_error"] = "skipped: out of time"
            continue
        try:
            run.case(case)["measured"] = measure_case(run, case)
            run.log(f"  measured {case.name}: {run.case(case)['measured']['time_ns'] / 1e6:.3f} ms")
        except Exception as exc:  # noqa: BLE001 - e.g. an OOM at these sizes
            run.case(case)["measured_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            run.log(f"  measuring {case.name} failed: {type(exc).__name__}")
            _release(run.device)
        run.save()


def stage_snapshot(run: Run) -> Optional[Path]:
    """One GPT-2 training step recorded from an empty allocator (warm-up step included: it allocates
    the optimizer state), dumped in the format tests/test_snapshot_replay.py replays."""
    if run.device.type != "cuda":
        run.results["snapshot"] = "skipped: needs CUDA"
        return None
    case = next((c for c in run.cases if c.train and c.model == "gpt2"), None)
    if case is None:
        run.results["snapshot"] = "skipped: no GPT-2 training case selected"
        return None
    _release(run.device)
    allocated = torch.cuda.memory_allocated(run.device)
    memory = torch.cuda.memory
    memory._record_memory_history(max_entries=1_000_000)
    path = run.out / f"snapshot_{case.name}.pickle"
    try:
        torch.manual_seed(0)
        with torch.device(run.device):
            model = build_model(case.model, run.dry_run)
        inputs = example_inputs(case, run.dry_run, run.device, model.config.vocab_size)
        step = _step_fn(model, case, inputs, run.device)
        step()
        step()
        torch.cuda.synchronize(run.device)
        memory._dump_snapshot(str(path))
    finally:
        memory._record_memory_history(enabled=None)
        step = model = inputs = None  # noqa: F841
        _release(run.device)
    run.results["snapshot"] = {"path": str(path), "case": case.name, "steps": 2,
                               "allocated_before_recording_bytes": allocated}
    return path


def stage_collect(run: Run, db: Path) -> None:
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.frontend.capture import resolve_bindings
    from boomfx.kernels_db.collect import collect_calls, collect_sweep
    from boomfx.kernels_db.store import Store
    reserve = 30.0 if run.dry_run else 120.0      # left for predictions and the report
    sweep_s = 2.0 if run.dry_run else min(120.0, max(0.0, 0.35 * (run.remaining_s() - reserve)))
    collected: dict[str, Any] = {}
    t0 = time.monotonic()
    result = collect_sweep(Store(db), run.device, dtypes=[torch.bfloat16, torch.float32], budget_s=sweep_s,
                           progress=False)
    collected["sweep"] = {"measured": result.measured, "failed": len(result.failed), "pending": result.pending,
                          "seconds": round(time.monotonic() - t0, 1)}
    run.log(f"  sweep: measured {result.measured}, failed {len(result.failed)}, pending {result.pending}")
    guided = [c for c in run.cases if c.name in run.programs]
    for i, case in enumerate(guided):
        share = max(0.0, (run.remaining_s() - reserve) / max(len(guided) - i, 1))
        budget = 2.0 if run.dry_run else share
        try:
            program = run.programs[case.name]
            analysis = Analysis(program, run.target, AnalyzeOptions(run.target.name, db="none"))
            calls = analysis.kernel_calls(resolve_bindings(program, {}, case.batch, case.seq))
            # the budget goes to the kernels with the most work first (graph order reached the GEMMs of
            # GPT-2's first layer only after its embedding, norms and dropouts on a loaded host)
            calls = sorted(calls, key=_work, reverse=True)
            res = collect_calls(Store(db), calls, run.device, budget, progress=False)
            collected[case.name] = {"kernels": len(calls), "measured": res.measured, "present": res.skipped,
                                    "failed": len(res.failed), "pending": res.pending}
            run.log(f"  guided {case.name}: {collected[case.name]}")
        except Exception as exc:  # noqa: BLE001
            collected[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
    run.results["collect"] = collected


def predict_case(run: Run, case: Case, db: Optional[Path]) -> dict:
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.frontend.capture import resolve_bindings
    program = run.programs[case.name]
    t0 = time.monotonic()
    analysis = Analysis(program, run.target, AnalyzeOptions(run.target.name, db=str(db) if db else "none"))
    report = analysis.evaluate(resolve_bindings(program, {}, case.batch, case.seq)).report
    alloc = report.memory.allocator
    optimizer_ns = sum(g.time_ns for g in report.by_phase if g.name == "optimizer")
    total_ns = report.time.total_ns - (optimizer_ns if case.fwd_bwd_only else 0.0)
    return {"time_ns": total_ns, "device_busy_ns": report.time.device_busy_ns,
            "optimizer_phase_ns": optimizer_ns,
            "by_op_ns": {g.name: g.time_ns for g in report.by_op},
            "host_bound_fraction": report.time.host_bound_fraction,
            "peak_allocated_bytes": alloc.peak_allocated_bytes if alloc else report.memory.peak_live_bytes,
            "peak_reserved_bytes": alloc.peak_reserved_bytes if alloc else None,
            "total_device_bytes": report.memory.total_device_bytes,
            "by_source": {g.name: round(g.share, 4) for g in report.by_source},
            "kernels": len(report.kernels),
            "analysis_s": round(time.monotonic() - t0, 2)}


def stage_predict(run: Run, db: Path) -> None:
    for case in run.cases:
        if case.name not in run.programs:
            continue
        for label, path in (("predicted", db if db.exists() else None), ("predicted_no_db", None)):
            if label == "predicted_no_db" and run.remaining_s() < 40:
                continue
            try:
                run.case(case)[label] = predict_case(run, case, path)
            except Exception as exc:  # noqa: BLE001
                run.case(case)[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
        run.log(f"  predicted {case.name}")
        run.save()


def stage_blocks(run: Run, db: Path) -> None:
    """Block mode (kernels_db/blocks_db.py): measure each repeated block whole at the case's sizes, then
    predict again; the kernels of measured blocks are priced "block-measured"."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.frontend.capture import resolve_bindings
    from boomfx.kernels_db.blocks_db import collect_blocks
    from boomfx.kernels_db.store import Store
    for case in run.cases:
        if case.name not in run.programs:
            continue
        if run.remaining_s() < 30:
            run.case(case)["blocks_error"] = "skipped: out of time"
            continue
        try:
            program = run.programs[case.name]
            analysis = Analysis(program, run.target, AnalyzeOptions(run.target.name, db="none"))
            bindings = resolve_bindings(program, {}, case.batch, case.seq)
            res = collect_blocks(Store(db), analysis, bindings, run.device, budget_s=max(run.remaining_s() - 30, 1),
                                 progress=False, target_s=0.05)
            run.case(case)["blocks"] = {"measured": list(res.measured), "present": list(res.skipped),
                                        "too_large": [list(t) for t in res.too_large],
                                        "failed": [list(t) for t in res.failed], "times_ns": dict(res.times_ns)}
            run.case(case)["predicted_blocks"] = predict_case(run, case, db)
            run.log(f"  blocks {case.name}: {run.case(case)['blocks']['times_ns']}")
        except Exception as exc:  # noqa: BLE001
            run.case(case)["blocks_error"] = f"{type(exc).__name__}: {exc}"
        run.save()


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------
def _err(pred: Optional[float], meas: Optional[float]) -> Optional[float]:
    if pred is None or not meas:
        return None
    return pred / meas - 1.0


def error_rows(results: dict) -> list[dict]:
    rows = []
    for name, c in results.get("cases", {}).items():
        p, p0, m = c.get("predicted") or {}, c.get("predicted_no_db") or {}, c.get("measured") or {}
        pb = c.get("predicted_blocks") or {}
        rows.append({
            "case": name,
            "measured_ms": m.get("time_ns", 0) / 1e6 if m else None,
            "predicted_ms": p.get("time_ns", 0) / 1e6 if p else None,
            "time_error": _err(p.get("time_ns"), m.get("time_ns")),
            "time_error_no_db": _err(p0.get("time_ns"), m.get("time_ns")),
            "time_error_blocks": _err(pb.get("time_ns"), m.get("time_ns")),
            "alloc_error": _err(p.get("peak_allocated_bytes"), m.get("max_memory_allocated_bytes")),
            "reserved_error": _err(p.get("peak_reserved_bytes"), m.get("max_memory_reserved_bytes")),
            "measured_share": (p.get("by_source") or {}).get("measured"),
        })
    return rows


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _num(x: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(results: dict) -> str:
    lines = [f"# GPU validation: {results.get('device', '?')} ({results.get('target', '?')})", "",
             f"torch {results.get('torch')}, CUDA {results.get('cuda')}, dry run: {results.get('dry_run')}", "",
             "Error = predicted / measured - 1. Time: median step (CUDA events); memory: "
             "max_memory_allocated / max_memory_reserved over one step.", "",
             "| case | measured ms | predicted ms | time err | time err (no DB) | time err (blocks) "
             "| allocated err | reserved err | measured share |", "|---|---|---|---|---|---|---|---|---|"]
    for r in error_rows(results):
        cells = [r["case"], _num(r["measured_ms"]), _num(r["predicted_ms"]), _pct(r["time_error"]),
                 _pct(r["time_error_no_db"]), _pct(r["time_error_blocks"]), _pct(r["alloc_error"]),
                 _pct(r["reserved_error"]), _num(r["measured_share"], "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Stages", ""]
    for name, st in results.get("stages", {}).items():
        lines.append(f"- {name}: {st.get('status')} ({st.get('seconds', '-')} s)"
                     + (f": {st['error']}" if st.get("error") else ""))
    return "\n".join(lines) + "\n"


def profiler_op_name(boomfx_op: str) -> str:
    """``aten.mm.default`` -> ``aten::mm``: the profiler's name of the op boomfx prices."""
    parts = boomfx_op.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) >= 2 else boomfx_op


def op_rows(case: dict) -> list[dict]:
    """Per aten op: measured device time of one profiled step next to boomfx's prediction (ns)."""
    measured = {r["name"]: r["time_ns"] for r in ((case.get("measured") or {}).get("profile") or {}).get("aten_ops", [])}
    predicted: dict[str, float] = {}
    for op, t in ((case.get("predicted_no_db") or case.get("predicted") or {}).get("by_op_ns") or {}).items():
        predicted[profiler_op_name(op)] = predicted.get(profiler_op_name(op), 0.0) + t
    rows = [{"op": op, "measured_ns": measured.get(op), "predicted_ns": t, "error": _err(t, measured.get(op))}
            for op, t in predicted.items()]
    return sorted(rows, key=lambda r: -(r["measured_ns"] or r["predicted_ns"]))


def kernels_markdown(results: dict) -> str:
    lines = ["# Kernel by kernel: measured (torch.profiler, one step) vs predicted (no DB), per aten op", ""]
    for name, case in results.get("cases", {}).items():
        rows = op_rows(case)
        if not rows:
            continue
        lines += [f"## {name}", "", "| op | measured ms | predicted ms | error |", "|---|---|---|---|"]
        for r in rows[:25]:
            meas = None if r["measured_ns"] is None else r["measured_ns"] / 1e6
            lines.append(f"| {r['op']} | {_num(meas)} | {_num(r['predicted_ns'] / 1e6)} | {_pct(r['error'])} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def stage_report(run: Run, db: Path) -> None:
    from boomfx.kernels_db.store import Store
    run.results["errors_table"] = error_rows(run.results)
    (run.out / "kernels_by_op.md").write_text(kernels_markdown(run.results))
    if db.exists():
        with Store(db) as store:
            run.results["db_rows"] = store.export_csv(run.out / "kernels.csv")
    text = markdown(run.results)
    (run.out / "gpu_validation.md").write_text(text)
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------
def _local_target(device: torch.device, name: Optional[str]) -> Any:
    from boomfx.core.devices import get_device
    from boomfx.kernels_db.measure import local_device_spec
    if name:
        return get_device(name)
    try:
        return local_device_spec(device)
    except LookupError as exc:
        raise SystemExit(f"{exc}: pass --device") from None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results" / "gpu_validation"),
                   help="output directory (default: $OUT, else benchmarks/results/gpu_validation)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models and budgets (CI)")
    p.add_argument("--device", default=None, help="boomfx registry name of the local GPU (default: detected)")
    p.add_argument("--cases", default=None, help="comma-separated case names to run (default: all)")
    p.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S)
    return p.parse_args(argv)


def _work(call: object) -> int:
    """FLOPs + bytes moved of a bound call (0 when its cost does not evaluate)."""
    from boomfx.passes.costs.registry import price_call
    try:
        flops, read, written = price_call(call).cost.evaluate()
    except ValueError:
        return 0
    return flops + read + written


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    target = _local_target(device, None if args.dry_run else args.device)
    chosen = cases(args.dry_run)
    if args.cases:
        wanted = {c.strip() for c in args.cases.split(",")}
        chosen = [c for c in chosen if c.name in wanted]
    run = Run(out, args.dry_run, device, target, time.monotonic() + args.time_limit_s, chosen)
    run.results.update({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "target": target.name, "torch": torch.__version__, "cuda": torch.version.cuda,
                        "dry_run": args.dry_run, "cases": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
    for c in chosen:
        run.case(c)
    db = out / "kernels.sqlite"
    run.log(f"gpu validation on {run.results['device']} as {target.name}; {len(chosen)} cases; out {out}")
    run.stage("export", lambda: stage_export(run))
    run.stage("capture", lambda: stage_capture(run))
    run.stage("snapshot", lambda: stage_snapshot(run), min_s=60)
    run.stage("measure", lambda: stage_measure(run), min_s=60)   # includes one profiled step per case
    run.stage("collect", lambda: stage_collect(run, db), min_s=40)
    run.stage("predict", lambda: stage_predict(run, db), min_s=10)
    run.stage("blocks", lambda: stage_blocks(run, db), min_s=40)
    run.stage("report", lambda: stage_report(run, db))
    run.results["elapsed_s"] = round(time.monotonic() - run.started, 1)
    run.save()
    run.log(f"done in {run.results['elapsed_s']} s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
