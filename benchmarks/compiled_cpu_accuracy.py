"""Accuracy of ``--compile`` predictions on this machine's CPU: predicted vs measured torch.compile.

For each small model (examples/models.py) and mode (inference; a training step = compiled forward and
backward plus an eager AdamW step):

1. measured: ``torch.compile(model)`` on CPU, median of ``--iters`` (>= 5) iterations after warm-up;
   peak memory from one profiled iteration (``profile_memory``: running sum of allocations) plus the
   resident parameters/optimizer state/inputs;
2. predicted: ``capture(..., compile=True, target_kind="cpu")`` priced with a kernel database collected
   here first: eager kernels (extern matmuls, attention, optimizer ops) with ``kernels_db.collect``
   and fused groups with ``kernels_db.collect_fused``.

Writes ``benchmarks/results/compiled_cpu_accuracy.{json,md}``. Usage::

    python benchmarks/compiled_cpu_accuracy.py [--models mlp,gpt,llama] [--threads 1] [--iters 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from models import GPT, MLP, Llama  # noqa: E402

from boomfx.analyze import Analysis, AnalyzeOptions  # noqa: E402
from boomfx.capture import capture, resolve_bindings  # noqa: E402
from boomfx.devices import get_device  # noqa: E402
from boomfx.kernels_db.collect import collect_calls  # noqa: E402
from boomfx.kernels_db.collect_fused import collect_fused  # noqa: E402
from boomfx.kernels_db.keys import SymbolicKeyError, UnkeyableCallError, kernel_key  # noqa: E402
from boomfx.kernels_db.measure import Measurer  # noqa: E402
from boomfx.kernels_db.store import Store  # noqa: E402
from boomfx.passes.opcall import bind_call  # noqa: E402
from boomfx.program import ProgramOptions  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def make(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(d_in=256, hidden=1024, d_out=256), torch.randn(256, 256)
    if name == "gpt":
        return GPT(vocab=512, d=128, layers=2, heads=4, max_seq=128), torch.randint(0, 512, (4, 64))
    if name == "llama":
        return Llama(vocab=512, d=128, layers=2, heads=4, kv_heads=2, hidden=352), torch.randint(0, 512, (4, 64))
    raise KeyError(name)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def measure(model: torch.nn.Module, x: torch.Tensor, train: bool, iters: int) -> tuple[float, int]:
    """(median step time in ns, peak bytes) of the compiled model on CPU."""
    torch._dynamo.reset()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=True) if train else None

    def step() -> None:
        if train:
            opt.zero_grad(set_to_none=True)
            _loss(compiled(x)).backward()
            opt.step()
        else:
            with torch.no_grad():
                compiled(x)

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        step()
        times.append(time.perf_counter_ns() - t0)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    resident = sum(p.numel() * p.element_size() for p in model.parameters()) + x.numel() * x.element_size()
    if train:
        resident += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor))
    return float(statistics.median(times)), int(peak + resident)


def predict(model: torch.nn.Module, x: torch.Tensor, train: bool, db: Path, budget_s: float) -> tuple[float, int, dict]:
    ep = torch.export.export(model, (x,))
    program = capture(ep, options=ProgramOptions(train=train, compile=True, target_kind="cpu"))
    device = get_device("cpu")
    analysis = Analysis(program, device)
    bindings = resolve_bindings(program, {})
    ev = analysis.evaluator(bindings)
    eager_calls = []
    for nc in analysis.costs.by_node.values():
        if str(nc.call.op).startswith("boomfx."):
            continue
        call = bind_call(nc.call, ev)
        try:
            kernel_key(call)
        except (SymbolicKeyError, UnkeyableCallError):
            continue        # data-dependent scalars (AdamW's bias correction): priced by the roofline
        eager_calls.append(call)
    with Store(db) as store:
        collect_calls(store, eager_calls, "cpu", budget_s=budget_s, measurer=Measurer("cpu"))
        fused = collect_fused(store, analysis, bindings, budget_s=budget_s)
    priced = Analysis(program, device, AnalyzeOptions("cpu", db=str(db)))
    report = priced.evaluate(bindings).report
    sources = {g.name: round(g.share, 3) for g in report.by_source}
    return report.time.total_ns, report.memory.peak_live_bytes, {"sources": sources,
                                                                 "fused_failed": len(fused.failed),
                                                                 "kernels": len(report.kernels)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,gpt,llama")
    parser.add_argument("--modes", default="inference,train")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--db", default=str(Path.home() / ".cache" / "boomfx" / "compiled-cpu-accuracy.sqlite"),
                        help="kernel database collected on this machine (eager + fused kernels)")
    parser.add_argument("--budget-s", type=float, default=600.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            train = mode == "train"
            model, x = make(name)
            pred_ns, pred_bytes, info = predict(model, x, train, Path(args.db), args.budget_s)
            model, x = make(name)
            meas_ns, meas_bytes = measure(model, x, train, args.iters)
            row = {"model": name, "mode": mode, "predicted_ns": pred_ns, "measured_ns": meas_ns,
                   "time_error": pred_ns / meas_ns - 1, "predicted_peak_bytes": pred_bytes,
                   "measured_peak_bytes": meas_bytes, "memory_error": pred_bytes / meas_bytes - 1, **info}
            print(json.dumps(row), flush=True)
            rows.append(row)
    errors = [abs(r["time_error"]) for r in rows]
    summary = {"median_abs_time_error": statistics.median(errors), "worst_abs_time_error": max(errors),
               "median_abs_memory_error": statistics.median(abs(r["memory_error"]) for r in rows),
               "threads": args.threads, "iters": args.iters, "torch": torch.__version__}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compiled_cpu_accuracy.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    lines = ["# Compiled (torch.compile, CPU) accuracy: predicted vs measured", "",
             f"torch {torch.__version__}, {args.threads} thread(s), median of {args.iters} iterations.", "",
             "| model | mode | predicted | measured | time error | predicted peak | measured peak | memory error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['predicted_ns'] / 1e6:.3f} ms | {r['measured_ns'] / 1e6:.3f} ms "
                     f"| {r['time_error']:+.1%} | {r['predicted_peak_bytes'] / 2**20:.2f} MiB "
                     f"| {r['measured_peak_bytes'] / 2**20:.2f} MiB | {r['memory_error']:+.1%} |")
    lines += ["", f"Median |time error| {summary['median_abs_time_error']:.1%}, worst "
              f"{summary['worst_abs_time_error']:.1%}; median |memory error| {summary['median_abs_memory_error']:.1%}."]
    (RESULTS / "compiled_cpu_accuracy.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
