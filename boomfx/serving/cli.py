"""``boomfx serve FILE.pt2``: argument parsing and output (the engine options carry vLLM's names)."""
from __future__ import annotations

import argparse
import math
import sys

from boomfx.core.errors import OptionError


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="predict LLM serving: KV-cache plan, step times, TTFT/TPOT at a request rate")
    p.add_argument("file", help="a .pt2 inference export of a decoder (dynamic batch and sequence)")
    p.add_argument("--device", default="a100-80gb", help="target device (see `boomfx devices`)")
    p.add_argument("--db", default="auto", help="kernel database: a path, 'default', 'auto' or 'none'")
    p.add_argument("--engine", default="vllm", help="serving engine whose rules are followed (vllm: vLLM V1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-write", choices=("paged", "concat"), default=None,
                   help="how the KV cache is written: paged (the engine's block writes; the default) or concat "
                        "(transformers' DynamicCache: torch.cat of the whole cache every step, and the attention "
                        "the model itself calls)")
    p.add_argument("--collect", action="store_true",
                   help="first measure, on this machine, every kernel the report's steps price into --db (a path, "
                        "else the device's user-cache database), then price from it (boomfx/serving/collect.py)")
    p.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="window of the sliding layers (all layers when the masks show none)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="sliding layers keep full-attention KV (the engine's flag)")
    p.add_argument("--request-rate", type=float, default=None, help="requests/s (Poisson; inf: all at once)")
    p.add_argument("--fixed-interval", action="store_true", help="arrivals at a fixed interval instead of Poisson")
    p.add_argument("--concurrency", type=int, default=None, help="keep this many requests in flight")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", default=None, metavar="FILE.jsonl", help="prompt_len/output_len per line")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help="decode-latency table over batch sizes and context lengths")
    p.add_argument("--trace", default=None, metavar="FILE.json", help="Chrome trace of the simulated steps")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    p.add_argument("--verbose", "-v", action="store_true")


def _sweep_axes(max_num_seqs: int, max_model_len: int) -> tuple[list[int], list[int]]:
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= max_num_seqs} | {max_num_seqs})
    contexts = sorted({c for c in (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
                       if c <= max_model_len} | {max_model_len})
    return batches, contexts


def run_serve(args: argparse.Namespace) -> int:
    from boomfx.frontend.capture import capture
    from boomfx.core.devices import get_device
    from boomfx.core.program import ProgramOptions
    from boomfx.cli.progress import StageProgress
    from boomfx.serving.engine import get_engine
    from boomfx.serving.report import render_text, write_trace
    from boomfx.serving.serve import build_report, report_steps, run_workload, setup, step_rows
    from boomfx.serving.steps import KV_WRITE_CONCAT
    from boomfx.serving.workload import Workload, read_dataset
    if args.request_rate is not None and args.concurrency is not None:
        raise OptionError("give one of --request-rate and --concurrency")
    progress = StageProgress(enabled=True if args.verbose else None)
    device = get_device(args.device)
    progress.stage("loading and capturing the program")
    program = capture(args.file, options=ProgramOptions(target_kind=device.kind))
    progress.stage("planning the KV cache")
    options = dict(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
                   tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                   sliding_window=args.sliding_window,
                   disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager)
    # --collect: planned without the database it is about to fill (a path that may not exist yet)
    s = setup(program, device, get_engine(args.engine), db="none" if args.collect else args.db, **options)
    if not s.plan.fits:
        raise OptionError(f"{args.file} on {device.name}: {s.plan.verdict}")
    batches, contexts = _sweep_axes(s.config.max_num_seqs, s.config.max_model_len) if args.sweep else (None, None)
    if args.collect:
        from boomfx.serving.collect import collect_serving, local_device
        local_device(device)     # refused before anything is measured
        path = _collect_path(args.db, device.name)
        progress.stage("measuring the serving steps' kernels on this machine")
        collected = collect_serving(s.pricer(kv_write=args.kv_write),
                                    report_steps(s, args.input_len, args.output_len, batches, contexts), path, device)
        sys.stderr.write(f"[boomfx] {collected.describe()}\n")
        if device.kind == "cpu" and (args.kv_write or s.engine.kv_write) == KV_WRITE_CONCAT:
            from boomfx.kernels_db.measure import Measurer
            from boomfx.kernels_db.store import Store
            from boomfx.serving.host_overhead import collect_module_call
            progress.stage("measuring transformers' Python per module call (calibration Llamas)")
            per_call = collect_module_call(Store(path), Measurer("cpu"))
            if per_call is None:
                sys.stderr.write("[boomfx] transformers is not installed: its Python per module call is not "
                                 "measured (the steps' host_overhead stays 0)\n")
        s = setup(program, device, get_engine(args.engine), db=str(path), **options)
    progress.stage("pricing prefill and decode steps")
    pricer = s.pricer(kv_write=args.kv_write)
    rows = step_rows(s, pricer, args.input_len, args.output_len, batches, contexts)
    if args.sweep:
        rows = [r for r in rows if r.kind == "decode"]
    wl = None
    if args.request_rate is not None or args.concurrency is not None:
        lengths = read_dataset(args.dataset) if args.dataset else ()
        workload = Workload(args.num_prompts, args.input_len, args.output_len, args.request_rate, args.concurrency,
                            fixed_interval=args.fixed_interval, seed=args.seed,
                            lengths=lengths).check(s.config.max_model_len)
        progress.stage(f"simulating {workload.num_prompts} requests")
        bar = _bar(progress.enabled)
        wl = run_workload(s, workload, progress=bar, kv_write=args.kv_write)
        if args.trace:
            write_trace(args.trace, wl)
    progress.done()
    report = build_report(s, device, rows, wl)
    if args.kv_write is not None and args.kv_write != s.engine.kv_write:
        report.warnings.append(f"--kv-write {args.kv_write}: the KV cache is written as transformers' DynamicCache "
                               f"does (torch.cat every step), not by {s.engine.label}'s {s.engine.kv_write} writes")
    if args.json == "-":
        print(report.to_json())
        return 0
    print(render_text(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(report.to_json())
    return 0


def _collect_path(db: str, device_name: str) -> "Path":
    """Where ``--collect`` writes: ``--db PATH``, else the device's user-cache database."""
    from pathlib import Path

    from boomfx.kernels_db.store import default_db_path
    if db == "none":
        raise OptionError("--collect measures into a database: give --db PATH (or leave --db at auto)")
    return default_db_path(device_name) if db in ("auto", "default") else Path(db)


def _bar(enabled: bool):
    """A stderr progress callback for long simulations (None when the bar is off)."""
    if not enabled:
        return None
    shown = [-1]

    def update(done: int, total: int) -> None:
        pct = math.floor(100 * done / total)
        if pct != shown[0] and pct % 5 == 0:
            shown[0] = pct
            sys.stderr.write(f"\r[boomfx]   {done}/{total} requests finished ({pct}%)")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return update
