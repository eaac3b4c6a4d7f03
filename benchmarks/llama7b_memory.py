"""Will a Llama-7B fit? The memory questions of the memory issue, answered for Llama-7B-shaped exports.

Exports transformers' LlamaConfig defaults (32 layers, hidden 4096, MLP 11008, 32 heads, vocab 32000)
on the meta device (no weights; cached under benchmarks/.cache/) in bf16 and fp32, then asks boomfx:
1. bf16 weights, inference, batch 1, seq 2048 on a 24 GB GPU (rtx-4090): fits?
2. fp32 weights, AdamW training, batch 1, seq 2048 on an 80 GB GPU (a100-80gb): fits?
3. bf16 inference at seq 2048 on an 80 GB GPU: the largest batch that fits (exact at the boundary).
Writes benchmarks/results/llama7b_memory.{json,md}.

    python benchmarks/llama7b_memory.py
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch.export import Dim

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results"


def export_llama7b(dtype: torch.dtype) -> Path:
    path = CACHE / f"llama7b-{str(dtype).split('.')[-1]}.pt2"
    if path.exists():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM
    CACHE.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig()            # the 7B defaults
    config.use_cache = False
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    dynamic = {"input_ids": {0: Dim("batch", min=1, max=1024), 1: Dim("seq", min=2, max=4096)}}
    ep = torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes=dynamic, strict=False)
    torch.export.save(ep, str(path))
    return path


def main() -> None:
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.frontend.capture import capture, resolve_bindings
    from boomfx.core.devices import get_device
    from boomfx.core.program import ProgramOptions
    from boomfx.analysis.search import largest_fitting
    from boomfx.core.units import fmt_bytes, fmt_time

    results: dict = {"torch": torch.__version__, "cases": []}
    bf16, fp32 = export_llama7b(torch.bfloat16), export_llama7b(torch.float32)

    def case(title: str, path: Path, device: str, train: bool, batch: int, seq: int) -> dict:
        started = time.perf_counter()
        program = capture(str(path), options=ProgramOptions(train=train))
        spec = get_device(device)
        analysis = Analysis(program, spec, AnalyzeOptions(spec.name))
        rep = analysis.evaluate(resolve_bindings(program, {}, batch=batch, seq=seq)).report
        m = rep.memory
        row = {"case": title, "device": device, "train": train, "batch": batch, "seq": seq,
               "peak_live_bytes": m.peak_live_bytes, "by_category_bytes": m.by_category_bytes,
               "peak_allocated_bytes": m.allocator.peak_allocated_bytes if m.allocator else None,
               "peak_reserved_bytes": m.allocator.peak_reserved_bytes if m.allocator else None,
               "outside_allocator_bytes": m.outside_allocator_bytes, "total_device_bytes": m.total_device_bytes,
               "capacity_bytes": m.device_capacity_bytes, "fits": m.fits, "margin_bytes": m.margin_bytes,
               "oom_node": m.oom_node, "oom_module": m.oom_module, "time_ns": rep.time.total_ns,
               "analysis_s": time.perf_counter() - started}
        results["cases"].append(row)
        print(f"{title}: {'fits' if m.fits else 'DOES NOT FIT'}; total {fmt_bytes(m.total_device_bytes)} of "
              f"{fmt_bytes(m.device_capacity_bytes)}; step {fmt_time(rep.time.total_ns)} ({row['analysis_s']:.0f} s)")
        return row

    case("bf16 inference b1 s2048 on a 24 GB GPU", bf16, "rtx-4090", False, 1, 2048)
    case("fp32 AdamW training b1 s2048 on an 80 GB GPU", fp32, "a100-80gb", True, 1, 2048)

    program = capture(str(bf16))
    spec = get_device("a100-80gb")
    analysis = Analysis(program, spec, AnalyzeOptions(spec.name))
    seq_bind = resolve_bindings(program, {}, seq=2048, allow_unbound=True)
    batch_info = program.symbol("batch")
    started = time.perf_counter()
    found = largest_fitting(analysis, batch_info, seq_bind)
    ok = analysis.evaluate({**seq_bind, batch_info.symbol: found.largest_fitting}, memory_only=True).report.memory
    bad = analysis.evaluate({**seq_bind, batch_info.symbol: found.first_failing}, memory_only=True).report.memory
    results["max_batch"] = {"device": "a100-80gb", "seq": 2048, "largest_fitting": found.largest_fitting,
                            "first_failing": found.first_failing, "evaluations": found.evaluations,
                            "total_at_largest_bytes": ok.total_device_bytes, "fits_at_largest": ok.fits,
                            "fits_at_next": bad.fits, "search_s": time.perf_counter() - started}
    print(f"max batch for bf16 inference at seq 2048 on a100-80gb: {found.largest_fitting} "
          f"({fmt_bytes(ok.total_device_bytes)}); {found.first_failing} does not fit")

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llama7b_memory.json").write_text(json.dumps(results, indent=2))
    lines = ["# Llama-7B-shaped memory questions (boomfx predictions)", "",
             "| case | device | fits | peak allocated | peak reserved | device total | capacity | margin |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in results["cases"]:
        lines.append(f"| {r['case']} | {r['device']} | {'yes' if r['fits'] else 'NO'} | "
                     f"{fmt_bytes(r['peak_allocated_bytes'] or 0)} | {fmt_bytes(r['peak_reserved_bytes'] or 0)} | "
                     f"{fmt_bytes(r['total_device_bytes'])} | {fmt_bytes(r['capacity_bytes'])} | "
                     f"{fmt_bytes(r['margin_bytes'])} |")
    mb = results["max_batch"]
    lines += ["", f"Largest batch for bf16 inference at seq 2048 on a100-80gb: **{mb['largest_fitting']}** "
              f"(device total {fmt_bytes(mb['total_at_largest_bytes'])}); batch {mb['first_failing']} does not fit "
              f"({mb['evaluations']} evaluations, {mb['search_s']:.1f} s)."]
    (RESULTS / "llama7b_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
