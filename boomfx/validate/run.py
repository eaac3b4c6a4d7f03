"""``boomfx.validate``: predict one step, run the same step for real on this machine, compare.

This is the check a user runs on their desktop before trusting a prediction for a bigger model or
another device: the same program, options and sizes, priced by boomfx and measured as people run it
(torch's thread count unless told otherwise, wall-clock time, the allocator's peak).
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import sympy
import torch

from boomfx.core.errors import OptionError
from boomfx.validate.result import OpComparison, ValidationResult
from boomfx.kernels_db.block_runner import free_memory_bytes

# Sizes are lowered (batch halved) until the predicted step fits in this share of the memory free
# now: the rest is left to the allocator's caching, the profiler and other processes.
FIT_FRACTION = 0.5
FUSED_OP_CLASS = "fused"        # Inductor's generated kernels (boomfx::fused), one class


def validate(source: Any, *, train: bool = False, optimizer: str = "adamw", amp: Optional[str] = None,
             compile: bool = False, resident_grads: bool = False, dims: Optional[Mapping[str, int]] = None,
             batch: Optional[int] = None, seq: Optional[int] = None, db: Optional[str] = "auto",
             threads: Optional[int] = None, repeats: int = 10, warmup: int = 3, device: str = "auto",
             calibrate: bool = False, seed: int = 0, loss: str = "auto",
             foreach: Optional[bool] = None) -> ValidationResult:
    """Predicted vs measured step time and peak memory of ``source`` on this machine.

    Args:
        source: a ``.pt2`` path or an ExportedProgram (weights without data are drawn at random:
            boomfx/validate/materialize.py).
        train/optimizer/amp/compile/resident_grads/loss/foreach: the step, as ``boomfx analyze`` takes them
            (``optimizer="none"``: forward and backward only; ``foreach``: the prediction's and the real
            step's optimizer, foreach unless False).
        dims/batch/seq: sizes; unbound ones take the export's example size. Sizes not given are
            lowered until the step fits this machine; sizes given that do not fit raise OptionError.
        db: the kernel database pricing the prediction (as ``--db``: a path, auto, default, none).
        threads: torch intra-op threads for the real step (default: torch's own choice).
        repeats/warmup: timed and untimed real steps.
        device: "auto" (CUDA when present, else CPU), "cpu" or "cuda".
        calibrate: store each op class's in-situ / predicted ratio in ``db`` (boomfx/validate/calibration.py).

    Example::

        >>> r = boomfx.validate("examples/mlp.pt2", batch=64)
        >>> r.predicted_time_ns, r.measured_time_ns
    """
    if repeats < 1 or warmup < 0:
        raise OptionError("--repeats must be at least 1 and --warmup at least 0")
    if calibrate and db in (None, "none"):
        raise OptionError("--calibrate stores factors in a kernel database: give --db PATH (or default)")
    if threads is not None and threads < 1:
        raise OptionError(f"--threads must be at least 1, got {threads}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _validate(source, train, optimizer, amp, compile, resident_grads, dims, batch, seq, db, repeats,
                         warmup, device, calibrate, seed, loss, foreach)
    finally:
        torch.set_num_threads(before)


def _validate(source: Any, train: bool, optimizer: str, amp: Optional[str], compile: bool, resident_grads: bool,
              dims: Optional[Mapping[str, int]], batch: Optional[int], seq: Optional[int], db: Optional[str],
              repeats: int, warmup: int, device: str, calibrate: bool, seed: int, loss: str,
              foreach: Optional[bool]) -> ValidationResult:
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.frontend.capture import capture, to_exported_program
    from boomfx.core.program import ProgramOptions
    from boomfx.frontend.foreign import with_library_ops
    from boomfx.passes.costs.grouped_mm import TRANSFORMERS_GROUPED_MM
    from boomfx.passes.eager_grouped_mm import call_native_grouped_mm, eager_grouped_products, has_cpu_grouped_mm
    local = _local_device(device)
    spec = _local_spec(local)
    # eager CPU inference: transformers' experts call torch's grouped matmul, not the fallback the export traced
    # (passes/eager_grouped_mm.py); the real step runs the export's graph with the same rewrite
    native_experts = local.type == "cpu" and not train and not compile and has_cpu_grouped_mm()
    reload = (lambda: to_exported_program(source)) if isinstance(source, (str, os.PathLike)) else None
    ep = with_library_ops(to_exported_program(source), reload,
                          called=lambda name: not (native_experts and name == TRANSFORMERS_GROUPED_MM))
    options = ProgramOptions(train, optimizer, amp, target_kind=spec.kind, compile=compile,
                             resident_grads=resident_grads, loss=loss, foreach=foreach,
                             python_locals=False)   # the real step runs the export's graph: its frees
    program = capture(ep, options=options)
    if native_experts:
        program = eager_grouped_products(program)
    analysis = Analysis(program, spec, AnalyzeOptions(spec.name, db=db))
    bindings, reduced = fitting_bindings(analysis, dims or {}, batch, seq, free_memory_bytes(local))
    point = analysis.evaluate(bindings)
    report = point.report

    from boomfx.validate.materialize import materialise
    from boomfx.validate.measure import peak_memory, profile_ops, time_step
    from boomfx.validate.real_step import build_step, densify_optimizer_state
    from boomfx.training.trace import resolved_loss
    by_name = {str(s): v for s, v in bindings.items()}
    real = materialise(ep, by_name, local, seed)
    for gm in real.module.modules() if native_experts else ():
        if isinstance(gm, torch.fx.GraphModule) and call_native_grouped_mm(gm.graph):
            gm.recompile()
    step = build_step(real.module, real.args, real.kwargs, train=train, optimizer=optimizer, amp=amp,
                      compile=compile, resident_grads=resident_grads, device=local,
                      loss=resolved_loss(ep, loss), foreach=options.uses_foreach if train else None)
    step.run()                                       # optimizer state, compilation, first-touch pages
    densify_optimizer_state(step.optimizer, seed)
    timed = time_step(step.run, repeats, warmup, local)
    if train and not resident_grads:
        for p in real.module.parameters():           # a step starts without gradients (set_to_none)
            p.grad = None
    memory = peak_memory(step.run, local)
    predicted_ops = _predicted_ops(report)
    prof = profile_ops(step.run, set(predicted_ops), local)
    measured_ops = {o.op: o for o in prof.ops}
    ops = tuple(OpComparison(op, predicted_ops.get(op, (0.0, 0))[0],
                             measured_ops[op].time_ns if op in measured_ops else 0.0,
                             predicted_ops.get(op, (0.0, 0))[1],
                             measured_ops[op].calls if op in measured_ops else 0)
                for op in sorted(set(predicted_ops) | set(measured_ops)))
    kernel_ns = sum(k.time_ns for k in report.kernels)
    sources: dict[str, float] = {}
    for k in report.kernels:
        sources[k.source] = sources.get(k.source, 0.0) + k.time_ns
    resident_real = real.resident_bytes + step.resident_state_bytes() + (step.resident_grad_bytes()
                                                                         if resident_grads else 0)
    notes = []
    if amp and local.type == "cpu":
        notes.append("amp on a CPU: the real step uses CPU autocast's op lists, the prediction CUDA's")
    if compile:
        notes.append("compiled: Inductor's generated kernels run outside aten ops; in situ they are in "
                     "'(outside aten ops)', predicted under 'fused'")
    result = ValidationResult(
        source=str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__,
        device=spec.description, mode="train" if train else "inference",
        options={"optimizer": optimizer if train else None, "amp": amp, "compile": compile,
                 "resident_grads": resident_grads, "loss": resolved_loss(ep, loss) if train else None,
                 "foreach": options.uses_foreach if train else None},
        bindings=by_name, bindings_reduced=reduced, threads=timed.threads,
        predicted_time_ns=report.time.total_ns, measured_time_ns=timed.median_ns,
        measured_time_samples_ns=timed.samples_ns,
        predicted_peak_above_start_bytes=int(report.memory.peak_live_bytes - report.memory.resident_bytes),
        measured_peak_above_start_bytes=int(memory.peak_above_start_bytes),
        predicted_resident_bytes=int(report.memory.resident_bytes), measured_resident_bytes=int(resident_real),
        measured_reserved_above_start_bytes=memory.reserved_above_start_bytes, memory_source=memory.source,
        ops=ops, profiled_step_ns=prof.step_ns, measured_outside_ns=prof.outside_ns,
        predicted_outside_ns=max(0.0, report.time.total_ns - kernel_ns),
        db=_db_label(db, spec), price_sources=sources, load_average=os.getloadavg(),
        measured_thread_time_ns=timed.thread_median_ns, notes=tuple(notes),
        **_fault_pages(analysis, report), measured_faults_per_step=timed.faults_per_step)
    if calibrate:
        from boomfx.validate.calibration import store_calibration
        result = store_calibration(result, analysis, db)
    return result


def _fault_pages(analysis: Any, report: Any) -> dict[str, float]:
    """The page faults a CPU prediction charges and reports, in pages (none without this host's probe)."""
    from boomfx.kernels_db.pricing import cpu_host_model
    model = cpu_host_model(analysis.pricer)
    if model is None or not model.profile.page_fault_ns:
        return {}
    per_page = model.profile.page_fault_ns
    return {"predicted_fault_pages": report.time.page_faults_ns / per_page,
            "predicted_refault_pages": report.time.heap_refault_estimate_ns / per_page}


def _local_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise OptionError("--device cuda: no CUDA device is available on this machine")
    if name != "cpu" and not name.startswith("cuda"):
        raise OptionError(f"validate runs on this machine: --device cpu, cuda or auto, got '{name}'")
    return torch.device(name)


def _local_spec(device: torch.device) -> Any:
    from boomfx.kernels_db.measure import local_device_spec
    try:
        return local_device_spec(device)
    except LookupError as exc:
        raise OptionError(str(exc)) from None


def fitting_bindings(analysis: Any, dims: Mapping[str, int], batch: Optional[int], seq: Optional[int],
                     free_bytes: int) -> tuple[dict[sympy.Symbol, int], bool]:
    """Sizes for the real run: the ones given, the export's example sizes for the rest, the batch (else
    the first free symbol) halved until the predicted peak fits ``FIT_FRACTION`` of ``free_bytes``."""
    from boomfx.frontend.capture import resolve_bindings
    program = analysis.program
    given = resolve_bindings(program, dims, batch, seq, allow_unbound=True)
    bindings = dict(given)
    free = [info for info in program.symbols.values() if info.symbol not in given]
    for info in free:
        bindings[info.symbol] = info.hint if info.hint is not None else max(info.min_value, 1)
    budget = FIT_FRACTION * free_bytes
    shrinkable = sorted(free, key=lambda i: (i.role != "batch", i.role != "seq"))
    reduced = False
    while analysis.evaluate(bindings, memory_only=True).report.memory.peak_live_bytes > budget:
        target = next((i for i in shrinkable if bindings[i.symbol] // 2 >= max(i.min_value, 1)), None)
        if target is None:
            raise OptionError("the step does not fit in half of this machine's free memory "
                              f"({free_bytes / 2**30:.1f} GiB free) at these sizes; bind smaller ones")
        bindings[target.symbol] //= 2
        reduced = True
    return bindings, reduced


def _predicted_ops(report: Any) -> dict[str, tuple[float, int]]:
    """Predicted time and kernel count per op class (aten op name; Inductor kernels as one class)."""
    from boomfx.validate.measure import op_name
    out: dict[str, list[float]] = {}
    for k in report.kernels:
        name = op_name(k.op) or FUSED_OP_CLASS
        slot = out.setdefault(name, [0.0, 0])
        slot[0] += k.time_ns
        slot[1] += 1
    return {k: (t, int(n)) for k, (t, n) in out.items()}


def _db_label(db: Optional[str], spec: Any) -> Optional[str]:
    from boomfx.kernels_db.pricing import resolve_db_path
    path = resolve_db_path(db, spec)
    return str(path) if path is not None else None
