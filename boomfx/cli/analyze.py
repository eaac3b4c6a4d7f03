"""``boomfx analyze``: one point, a sweep table, or a max-batch/max-seq search."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.frontend.capture import DEFAULT_OPTIMIZER, capture, resolve_bindings
from boomfx.cli.args import parse_dim, parse_sweep
from boomfx.core.device_spec_file import load_device_spec
from boomfx.core.devices import get_device
from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.cli.progress import StageProgress
from boomfx.core.units import fmt_bytes, fmt_time


def run_analyze(args: argparse.Namespace) -> int:
    progress = StageProgress(enabled=True if args.verbose else None)
    device = load_device_spec(args.device_spec) if getattr(args, "device_spec", None) else get_device(args.device)
    dims = dict(parse_dim(d) for d in args.dim)
    sweeps = [parse_sweep(s) for s in args.sweep]
    if (args.max_batch or args.max_seq) and sweeps:
        raise OptionError("--max-batch/--max-seq and --sweep cannot be combined")
    if args.optimizer is not None and not args.train:
        raise OptionError("--optimizer needs --train (an inference step has no optimizer)")
    if args.loss != "auto" and not args.train:
        raise OptionError("--loss needs --train (an inference step has no loss)")
    if args.foreach is not None and not args.train:
        raise OptionError("--foreach/--no-foreach needs --train (an inference step has no optimizer)")
    from boomfx.distributed.cli import parallel_config
    parallel = None if args.search else parallel_config(args)     # --parallel: checked before the (slow) capture
    foreach = args.foreach
    if foreach is None and (parallel is not None or args.search):
        foreach = True   # every rank rewrite starts from the foreach step (distributed/ranks.py): traced once
    options = ProgramOptions(args.train, args.optimizer or DEFAULT_OPTIMIZER, args.amp, args.checkpoint, target_kind=device.kind,
                             compile=args.compile or args.cudagraphs, cudagraphs=args.cudagraphs,  # --compile
                             checkpoint_layers=args.checkpoint_layers,  # "h.0,h.2": split by ProgramOptions
                             resident_grads=args.resident_grads, loss=args.loss, foreach=foreach,
                             python_locals=args.python_locals)
    if args.search:   # --search: the fastest parallel plans that fit (boomfx/distributed/search_cli.py)
        from boomfx.distributed.search_cli import run_search
        return run_search(args, device, options, dims, AnalyzeOptions(device.name, args.alloc_conf, args.outside_memory,
                                                                      args.db, args.from_db),
                          log=progress.log if args.verbose else None)
    if parallel is not None and not args.train:
        raise OptionError("--parallel needs --train (the per-rank programs are training steps)")
    progress.stage("loading and capturing the program")
    program = capture(args.file, options=options, log=progress.log if args.verbose else None)
    progress.stage("running the analysis passes")
    analyze_options = AnalyzeOptions(device.name, args.alloc_conf, args.outside_memory, args.db, args.from_db)
    if parallel is not None:   # --parallel: one analysis per rank class (boomfx/distributed)
        from boomfx.distributed.analysis import DistributedAnalysis
        if sweeps:
            raise OptionError("--parallel and --sweep cannot be combined yet")
        analysis = DistributedAnalysis(program, parallel, device, analyze_options, reuse_blocks=not args.no_reuse)
    else:
        analysis = Analysis(program, device, analyze_options, reuse_blocks=not args.no_reuse)
    if sweeps:
        return _run_sweep(args, analysis, dims, sweeps, progress)
    if args.max_batch or args.max_seq:
        return _run_search(args, analysis, dims, progress)
    bindings = resolve_bindings(program, dims, args.batch, args.seq)
    progress.stage("pricing kernels and simulating the step")
    if parallel is not None:
        point = analysis.evaluate(bindings, rank=args.rank, record_trace=bool(args.memory_snapshot))
    else:
        point = analysis.evaluate(bindings, record_trace=bool(args.memory_snapshot))
    progress.done()
    report = point.report
    report.analysis_seconds = progress.elapsed_s
    if args.memory_snapshot and point.replay is None:   # refused before anything is written
        raise OptionError("--memory-snapshot needs a CUDA device (the CPU has no caching allocator)")
    if args.trace:
        from boomfx.report.trace import write_trace
        write_trace(args.trace, report, point.timeline, point.events)
        _say_written(args.trace, "Chrome/Perfetto trace of the simulated step (open in ui.perfetto.dev)")
    if args.memory_snapshot:
        from boomfx.report.snapshot import write_snapshot
        write_snapshot(args.memory_snapshot, point.replay.allocator)
        _say_written(args.memory_snapshot, "memory snapshot (open in pytorch.org/memory_viz)")
    if args.json == "-":
        print(report.to_json())
    else:
        from boomfx.report.text import render_text
        print(render_text(report, top=args.top, kernels=args.kernels))
        if report.parallel is not None:
            from boomfx.distributed.cli import render_parallel
            print(render_parallel(report.parallel))
        if args.json:
            with open(args.json, "w") as f:
                f.write(report.to_json())
    return 0


def _say_written(path: str, what: str) -> None:
    """One stderr line per file written, so stdout stays the report (or the JSON of --json)."""
    print(f"boomfx: wrote {path} ({fmt_bytes(os.path.getsize(path))}): {what}", file=sys.stderr)


def _run_sweep(args: argparse.Namespace, analysis: Analysis, dims: dict, sweeps: list, progress: StageProgress) -> int:
    names = [name for name, _ in sweeps]
    rows = []
    for values in itertools.product(*(vals for _, vals in sweeps)):
        point_dims = dict(dims)
        point_dims.update(zip(names, values))
        bindings = resolve_bindings(analysis.program, point_dims, args.batch, args.seq)
        progress.stage(f"evaluating {', '.join(f'{n}={v}' for n, v in zip(names, values))}")
        rep = analysis.evaluate(bindings).report
        alloc = rep.memory.allocator
        rows.append({**dict(zip(names, values)), "time_ns": rep.time.total_ns,
                     "peak_allocated_bytes": alloc.peak_allocated_bytes if alloc else rep.memory.peak_live_bytes,
                     "peak_reserved_bytes": alloc.peak_reserved_bytes if alloc else rep.memory.peak_live_bytes,
                     "total_device_bytes": rep.memory.total_device_bytes, "fits": rep.memory.fits})
    progress.done()
    if args.json == "-":
        print(json.dumps({"device": analysis.device.name, "points": rows}, indent=2))
        return 0
    header = names + ["time", "peak allocated", "peak reserved", "device total", "fits"]
    table = [[str(r[n]) for n in names] + [fmt_time(r["time_ns"]), fmt_bytes(r["peak_allocated_bytes"]),
                                           fmt_bytes(r["peak_reserved_bytes"]), fmt_bytes(r["total_device_bytes"]),
                                           "yes" if r["fits"] else "NO"] for r in rows]
    widths = [max(len(x[i]) for x in table + [header]) for i in range(len(header))]
    print(f"boomfx sweep: {analysis.program.source} on {analysis.device.description}")
    for r in [header] + table:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": analysis.device.name, "points": rows}, f, indent=2)
    return 0


def _run_search(args: argparse.Namespace, analysis: Analysis, dims: dict, progress: StageProgress) -> int:
    from boomfx.analysis.search import largest_fitting, symbol_for
    results = []
    for role, wanted in (("batch", args.max_batch), ("seq", args.max_seq)):
        if not wanted:
            continue
        info = symbol_for(analysis, role)
        fixed = resolve_bindings(analysis.program, dims, None if role == "batch" else args.batch,
                                 None if role == "seq" else args.seq, allow_unbound=True)
        fixed.pop(info.symbol, None)
        others = [s for s in analysis.program.symbols.values() if s.symbol not in fixed and s.symbol != info.symbol]
        if others:
            raise OptionError("bind the other dimensions first: " + ", ".join(s.describe() for s in others))
        progress.stage(f"searching the largest {role} that fits")
        cfg = getattr(analysis, "cfg", None)
        split = cfg is not None and (cfg.pp > 1 or cfg.accumulation_steps > 1)
        scale = cfg.num_microbatches if role == "batch" and split else 1
        if scale > 1:   # pipeline stages, accumulation: search the micro-batch; the batch is micro-batch x M
            from dataclasses import replace
            from boomfx.distributed.analysis import MicroBatchSearch
            micro = replace(info, max_value=None if info.max_value is None else info.max_value // scale)
            res = largest_fitting(MicroBatchSearch(analysis), micro, fixed)
            res = replace(res, largest_fitting=res.largest_fitting and res.largest_fitting * scale,
                          first_failing=res.first_failing and res.first_failing * scale)
        else:
            res = largest_fitting(analysis, info, fixed)
        results.append((role, res))
    progress.done()
    out = {role: {"largest_fitting": r.largest_fitting, "first_failing": r.first_failing,
                  "evaluations": r.evaluations} for role, r in results}
    if args.json == "-":
        print(json.dumps({"device": analysis.device.name, **out}, indent=2))
        return 0
    for role, r in results:
        if r.largest_fitting is None:
            print(f"max {role}: nothing fits on {analysis.device.name} (even {role}={r.first_failing} runs out of memory)")
        elif r.first_failing is None:
            print(f"max {role}: {r.largest_fitting} (the largest exported value) fits on {analysis.device.name}")
        else:
            print(f"max {role}: {r.largest_fitting} fits on {analysis.device.name}; {r.first_failing} does not "
                  f"({r.evaluations} evaluations)")
    return 0
