"""Distributed step time against real gloo training steps (issue 18's ground truth on this machine).

For each configuration (DDP, FSDP2 with and without reshard after forward, TP, PP with 1F1B and GPipe, on a
Llama-style and a GPT-2-style model, 2 ranks of one thread each, as ``distributed_truth`` runs them; ``--world
4``: ``configs``' 4-rank set, two ranks a core):

1. **real**: ``distributed_truth.run_configs`` with ``--steps`` wall-timed steps after warm-up (each after a
   barrier); a rank's time is the median of its steps, the step's the slowest rank's; ``--rounds`` fresh
   runs of every configuration, the lowest round's step kept (neighbours on this VM's host slow whole runs
   down by up to 2x: the same single-process step measured 4.3 and 8.0 ms an hour apart);
2. **predicted**: the same per-rank programs boomfx builds for ``--parallel`` on a CPU target
   (``DistributedAnalysis``), priced by one database holding what ``boomfx kernels collect --threads 1``
   measures for their kernels (the default protocol of a one-thread collection) and gloo collectives
   measured at exactly the message sizes the schedule asks for, among as many ranks as each one's group
   has, and the pipeline stages' sends (``collect_collectives``, as
   ``boomfx kernels collect --collectives`` measures them); the step is the slowest rank class's
   (pipelines: the schedule's end, bubble included).

Both columns run on this 2-core VM, which other jobs share: the load average is recorded before and after.
Nothing here is fitted: the database is measured, the schedule is the product's.

    python benchmarks/distributed_gloo_time.py [--only llama] [--steps 10] [--rounds 3]
    python benchmarks/distributed_gloo_time.py --models llama_m,gpt_m --seq 128 --out distributed_gloo_time_wide
    python benchmarks/distributed_gloo_time.py --world 4 --steps 20 --rounds 2 --out distributed_gloo_time_4rank

Writes ``benchmarks/results/<--out>.{json,md}`` (default ``distributed_gloo_time``). The default models
(d=64, 2 layers, ~4-30 ms steps) are ruled by Python's per-op work and gloo's per-message costs; the wide
ones (d=256, 4 layers, sequence 128, ~100-250 ms) by kernels, as real training is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import distributed_predict as predict  # noqa: E402
import distributed_truth as truth  # noqa: E402
import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def configs(steps: int, models: tuple[str, ...] = ("llama", "gpt"), batch: int = 4,
            seq: int = 32, world: int = 2) -> list[truth.TruthConfig]:
    """Two ranks (one per core of this machine): every parallelism the issue names, each model. Four
    (``world=4``, two ranks a core: ``cpu_core_sharing``'s base 2): DDP, FSDP2, FSDP2 x TP (TP 4 would split
    Llama's 2 KV heads) and pipelines of 2 stages over DDP and FSDP2 pairs."""
    out = []
    for model in models:
        if world == 4:
            out += [truth.TruthConfig(model, "ddp", 4),
                    truth.TruthConfig(model, "fsdp", 4, reshard_after_forward=True),
                    truth.TruthConfig(model, "fsdp", 4, reshard_after_forward=False),
                    truth.TruthConfig(model, "tp_fsdp", 4, reshard_after_forward=True),
                    truth.TruthConfig(model, "pp_ddp", 4, schedule="1f1b"),
                    truth.TruthConfig(model, "pp_fsdp", 4, schedule="1f1b", reshard_after_forward=False)]
            continue
        out += [truth.TruthConfig(model, "ddp", 2),
                truth.TruthConfig(model, "fsdp", 2, reshard_after_forward=True),
                truth.TruthConfig(model, "fsdp", 2, reshard_after_forward=False),
                truth.TruthConfig(model, "tp", 2),
                truth.TruthConfig(model, "pp", 2, schedule="1f1b"),
                truth.TruthConfig(model, "pp", 2, schedule="gpipe")]
    return [dataclasses.replace(c, timed_steps=steps, batch=batch, seq=seq) for c in out]


def _collect_kernels(dist: Any, bindings: Any, db: str) -> None:
    """``boomfx kernels collect --threads 1`` for every rank class's compute kernels (collectives apart)."""
    from boomfx.kernels_db.collect import collect_calls
    from boomfx.kernels_db.host_overheads import collect_host_costs
    from boomfx.kernels_db.framework_overheads import collect_framework_costs
    from boomfx.kernels_db.in_step import collect_in_step
    from boomfx.kernels_db.measure import protocol_measurer
    from boomfx.kernels_db.store import Store

    calls = [c for a in dist.analyses for c in a.kernel_calls(bindings) if c.op.namespace == "aten"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measurer = protocol_measurer("cpu")      # after set_num_threads(1): this thread's CPU time
        collect_calls(Store(db), calls, "cpu", progress=False, measurer=measurer)
        collect_host_costs(Store(db), measurer, compiled=False)
        collect_framework_costs(Store(db), measurer)   # FSDP2's hooks, as `kernels collect --collectives` does
        for a in dist.analyses:   # each rank class's kernels timed inside its step, as `kernels collect --for` does
            program_calls = [c for c in a.kernel_calls(bindings) if c.op.namespace == "aten"]
            collect_in_step(Store(db), program_calls, measurer)
    finally:
        torch.set_num_threads(threads)


def _collect_collectives(report: dict, db: str) -> None:
    """gloo collectives at every (op, group size, message size) the schedule priced (pipeline stages' sends
    included: 2 ranks), each among as many local ranks as its group has (a TP pair of a 4-rank world: 2)."""
    from boomfx.kernels_db.collective_bench import collect_collectives
    from boomfx.kernels_db.store import Store

    wanted: dict[tuple[str, int], set[int]] = {}    # (op, the group's ranks) -> message sizes
    for row in report["time_by_class"]:
        for c in row["collectives"]:
            if c["source"] != "measured":
                wanted.setdefault((c["op"], c["group_size"]), set()).add(int(c["message_bytes"]))
        if row.get("send_bytes") and row.get("send_source") != "measured":   # a pipeline stage's send
            wanted.setdefault(("send_recv", 2), set()).add(int(row["send_bytes"]))
    for (op, ranks), sizes in sorted(wanted.items()):
        collect_collectives(Store(db), world=ranks, ops=(op,), sizes=sorted(sizes), backend="gloo")


def predicted_step(cfg: truth.TruthConfig, db: str) -> dict[str, Any]:
    """boomfx's step for ``cfg`` priced by ``db`` (filled here with what it lacks)."""
    from boomfx.analysis.analysis import AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.distributed.analysis import DistributedAnalysis
    from boomfx.frontend.capture import resolve_bindings

    spec = cpu_spec()
    program = predict.training_program(cfg)
    pcfg = predict.parallel_config(cfg)
    dist = DistributedAnalysis(program, pcfg, spec, AnalyzeOptions(spec.name, db="none"))   # its kernels' sizes
    bindings = resolve_bindings(dist.classes[0].program, {}, cfg.batch, cfg.seq)
    _collect_kernels(dist, dist.program_bindings(bindings), db)
    priced = DistributedAnalysis(program, pcfg, spec, AnalyzeOptions(spec.name, db=db))
    first = priced.evaluate(bindings)
    _collect_collectives(first.report.parallel, db)
    # each evaluation reads the database's collective rows afresh (rank_schedule.default_pricer)
    parallel = priced.evaluate(bindings).report.parallel
    rows = parallel["time_by_class"]
    step = max(r.get("pipeline_step_ns", r["step_time_ns"]) for r in rows)
    unshared = None
    if cfg.parallel in ("ddp", "fsdp", "tp", "tp_fsdp"):   # the same schedule without the cores' sharing (A/B)
        from boomfx.distributed.step_time import class_steps
        from boomfx.simulate.streams import NO_SLOWDOWN

        unshared = max(c.step.step_ns for c in class_steps(priced, priced.program_bindings(bindings),
                                                             slowdown=NO_SLOWDOWN))
    sources = sorted({c["source"] for r in rows for c in r["collectives"]})
    kernel_sources = {g.name: g.time_ns for g in first.report.by_source}
    return {"step_ns": step, "unshared_step_ns": unshared,
            "classes": [{"ranks": r["ranks"], "step_time_ns": r["step_time_ns"],
                         "single_stream_ns": r["single_stream_ns"], "exposed_comm_ns": r["exposed_comm_ns"],
                         "hidden_comm_ns": r["hidden_comm_ns"], "collectives": len(r["collectives"]),
                         "comm_ns": sum(c["time_ns"] for c in r["collectives"]),
                         "bubble_fraction": r.get("bubble_fraction")} for r in rows],
            "collective_sources": sources, "kernel_sources": kernel_sources}


def single_process(model: str, db: str, batch: int = 4, seq: int = 32) -> dict[str, float]:
    """The same model's step in one process (no parallelism, batch 4, one thread): ``boomfx.validate`` of
    its export against the database above: how much of a gap is there before any rank runs."""
    from boomfx.validate import validate

    cfg = truth.TruthConfig(model, "ddp", 2, batch=batch, seq=seq)
    with tempfile.TemporaryDirectory(prefix="boomfx-gloo-single-") as tmp:
        path = str(Path(tmp) / f"{model}.pt2")
        torch.export.save(predict.export(cfg), path)
        r = validate(path, train=True, db=db, threads=1, repeats=10, device="cpu", batch=cfg.batch, seq=cfg.seq,
                     loss=cfg.loss)
    return {"predicted_ns": r.predicted_time_ns, "real_ns": r.measured_thread_time_ns,
            "signed_error": r.predicted_time_ns / r.measured_thread_time_ns - 1.0}


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Distributed step time: real gloo training steps vs boomfx (CPU, {meta.get('world', 2)} ranks x 1 thread)", "",
             f"`{meta['command']}`; torch {meta['torch']}; batch {meta['batch']}, sequence {meta['seq']}; "
             f"{meta['rounds']} rounds of {meta['steps']} wall-timed steps per rank after warm-up; load average "
             f"before {_load(meta['load_before'])}, after {_load(meta['load_after'])}; {meta['wall_s']:.0f} s in all. "
             "Real: the slowest rank's median step, in the round where it was lowest (every round's in the last "
             "column). Predicted: the slowest rank class of `DistributedAnalysis` on a CPU target, kernels from a "
             "one-thread collection, gloo collectives measured at the schedule's sizes. "
             "Error = predicted / real - 1.", "",
             "| configuration | real | predicted | signed error | without core sharing | compute (one stream) | "
             "exposed comm | hidden comm | collectives | real rank medians | each round's step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {_ms(r.get('real_ns'))} | error: {r['error']} | | | | | | | | |")
            continue
        worst = max(r["predicted"]["classes"], key=lambda c: c["step_time_ns"])
        lines.append(f"| {r['name']} | {_ms(r['real_ns'])} | {_ms(r['predicted']['step_ns'])} | "
                     f"{r['signed_error'] * 100:+.1f}% | {_unshared(r)} | {_ms(worst['single_stream_ns'])} | "
                     f"{_ms(worst['exposed_comm_ns'])} | {_ms(worst['hidden_comm_ns'])} | {worst['collectives']} | "
                     f"{', '.join(_ms(t) for t in r['rank_medians_ns'])} | "
                     f"{', '.join(_ms(t) for t in r.get('round_steps_ns', []))} |")
    if meta.get("single_process"):
        lines += ["", f"The same models in one process (`boomfx.validate`, training step at batch {meta['batch']}, one thread, thread "
                      "time; the database above):", "", "| model | real | predicted | signed error |", "|---|---|---|---|"]
        for model, r in meta["single_process"].items():
            if "error" in r:
                lines.append(f"| {model} | error: {r['error']} | | |")
            else:
                lines.append(f"| {model} | {_ms(r['real_ns'])} | {_ms(r['predicted_ns'])} | "
                             f"{r['signed_error'] * 100:+.1f}% |")
    unshared = [r["predicted"]["unshared_step_ns"] / r["real_ns"] - 1 for r in rows
                if "signed_error" in r and r["predicted"].get("unshared_step_ns") is not None]
    shared = [r["signed_error"] for r in rows if "signed_error" in r and r["predicted"].get("unshared_step_ns")]
    if unshared:
        lines += ["", f"DDP, FSDP2 and TP rows ({len(shared)}): median |error| with core sharing "
                      f"{statistics.median(abs(e) for e in shared) * 100:.1f}%, without "
                      f"{statistics.median(abs(e) for e in unshared) * 100:.1f}% (mean signed "
                      f"{statistics.fmean(shared) * 100:+.1f}% vs {statistics.fmean(unshared) * 100:+.1f}%)."]
    errs = [r["signed_error"] for r in rows if "signed_error" in r]
    if errs:
        lines += ["", f"median |error| {statistics.median(abs(e) for e in errs) * 100:.1f}%, mean signed "
                      f"{statistics.fmean(errs) * 100:+.1f}%, worst {max(errs, key=abs) * 100:+.1f}% over {len(errs)} "
                      "configurations (target, issue 18: median |error| <= 10%)."]
    return "\n".join(lines) + "\n"


def _unshared(row: dict) -> str:
    """The prediction without ``cpu_core_sharing`` and its error ("-": no collectives to share with)."""
    ns = row["predicted"].get("unshared_step_ns")
    return "-" if ns is None else f"{_ms(ns)} ({(ns / row['real_ns'] - 1) * 100:+.1f}%)"


def _ms(ns: Any) -> str:
    return "-" if ns is None else f"{ns / 1e6:.2f} ms"


def _load(load: Any) -> str:
    return " / ".join(f"{x:.1f}" for x in load)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="configurations whose name contains this")
    parser.add_argument("--steps", type=int, default=10, help="wall-timed steps per rank (default 10)")
    parser.add_argument("--models", default="llama,gpt", help="MODEL_DIMS entries of distributed_truth.py")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--world", type=int, choices=(2, 4), default=2, help="ranks (4: two a core here)")
    parser.add_argument("--out", default="distributed_gloo_time", help="results file stem")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="gradient-accumulation micro-batches: only the DDP and FSDP2 configurations, each "
                             "rank's batch as this many forward/backward passes (default 1: none)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="real runs of every configuration; the least-disturbed round's step is kept (default 3)")
    args = parser.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    chosen = [c for c in configs(args.steps, models, args.batch, args.seq, args.world) if args.only in c.name]
    if args.accumulation > 1:
        chosen = [dataclasses.replace(c, accumulation=args.accumulation) for c in chosen if c.parallel in ("ddp", "fsdp")]
    start = time.perf_counter()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="boomfx-gloo-time-") as tmp:
        db = str(Path(tmp) / "cpu.db")
        predicted = {}
        for cfg in chosen:
            try:
                predicted[cfg.name] = predicted_step(cfg, db)
            except Exception as exc:     # recorded in the table, the other configurations still run
                predicted[cfg.name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        # rounds: every configuration once a round, a fresh start of the ranks each; a configuration's real
        # step is its least-disturbed round's (this VM's neighbours slow a whole run down up to 2x)
        rounds = [truth.run_configs(chosen) for _ in range(args.rounds)]
        singles = {}
        for model in sorted({c.model for c in chosen}):
            try:
                singles[model] = single_process(model, db, args.batch, args.seq)
            except Exception as exc:
                singles[model] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    for runs in zip(*rounds):
        res = min(runs, key=lambda run: max(r.step_time_s for r in run.ranks))
        medians = [r.step_time_s * 1e9 for r in res.ranks]
        row = {"name": res.config.name, "real_ns": max(medians), "rank_medians_ns": medians,
               "round_steps_ns": [max(r.step_time_s for r in run.ranks) * 1e9 for run in runs],
               "predicted": predicted[res.config.name]}
        if "error" in row["predicted"]:
            row["error"] = row["predicted"]["error"]
        else:
            row["signed_error"] = row["predicted"]["step_ns"] / row["real_ns"] - 1.0
        rows.append(row)
    meta = {"torch": torch.__version__, "world": args.world, "steps": args.steps, "rounds": args.rounds, "batch": args.batch, "seq": args.seq,
            "command": "python benchmarks/distributed_gloo_time.py " + " ".join(argv if argv is not None else sys.argv[1:]), "load_before": load_before,
            "load_after": os.getloadavg(), "wall_s": time.perf_counter() - start, "single_process": singles}
    write_results(args.out, meta, rows, _markdown(rows, meta))
    return 0


def write_results(stem: str, meta: dict, rows: list[dict], markdown: str) -> None:
    """``benchmarks/results/<stem>.{json,md}``, the table printed."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / f"{stem}.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    raise SystemExit(main())
