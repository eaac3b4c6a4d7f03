"""How long does ``boomfx analyze --train --search`` take on an 80-layer model, and what does it evaluate?

Target (issue 18): a full search over hundreds of plans of an 80-layer model in under a minute.

The model is the Llama-2-70B-shaped export of ``benchmarks/speed_llama70b.py`` (80 layers, cached under
``benchmarks/.cache/``; built on first use), searched on 8 nodes x 8 H100 at sequence 2048 with bf16
autocast, as ``benchmarks/search_eval_cost.py`` sized it (566 plans). Each search runs in a fresh
subprocess (no cache warmed by another), timed end to end inside it (load and capture included).

The machine is shared with other agents: ``os.getloadavg()`` is recorded before and after each run, and so
are the numbers that do not depend on load: how many plans each stage discarded and how many evaluations
of each kind ran.

Run: ``python benchmarks/search_speed.py [--pt2 PATH]``; writes ``benchmarks/results/search_speed.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NODES, GPUS, SEQ, DEVICE = 8, 8, 2048, "h100-sxm"
# (layers, global batch): at 512 no data-parallel plan of the 80-layer model fits its 8 sequences per rank in
# one pass (only as accumulated micro-batches), at 128 some do; the 8-layer model (same layer shape) shows
# what the bounds prune where a search finishes
RUNS = ((80, 512), (80, 128), (8, 128))
TARGET_S = 60.0

# what search_plans does, with the search object at hand: a search stopped at the time limit still reports
# what it had built and evaluated by then
_ONE = """
import json, signal, sys, time
start = time.perf_counter()
from boomfx.analysis.analysis import AnalyzeOptions
from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions
from boomfx.distributed.plan_search import ParallelSearch, SearchRequest, program_maker
spec = get_device(sys.argv[6])
request = SearchRequest(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), top=5)
make = program_maker(sys.argv[1], options=ProgramOptions(train=True, target_kind=spec.kind, amp="bf16"))
search = ParallelSearch(make, spec, request, AnalyzeOptions(spec.name))
def stop(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, stop)
signal.alarm(max(1, int(float(sys.argv[7]) - (time.perf_counter() - start))))
try:
    out, stopped = search.run(), False
except TimeoutError:
    out, stopped = search.outcome, True
d = out.to_dict()
d["stages"] = d.pop("seconds")
d["seconds"] = time.perf_counter() - start
d["stopped"] = stopped
print(json.dumps(d))
"""


def run_one(pt2: Path, global_batch: int, timeout_s: float) -> dict:
    """One search in a fresh subprocess, timed end to end inside it."""
    load_before = os.getloadavg()
    try:
        proc = subprocess.run([sys.executable, "-c", _ONE, str(pt2), str(NODES), str(GPUS), str(global_batch),
                               str(SEQ), DEVICE, str(timeout_s)], capture_output=True, text=True, cwd=ROOT,
                              timeout=timeout_s + 120)
    except subprocess.TimeoutExpired:
        return {"global_batch": global_batch, "error": [f"did not finish in {timeout_s:.0f} s (stopped)"],
                "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    load_after = os.getloadavg()
    if proc.returncode != 0:
        return {"global_batch": global_batch, "error": proc.stderr.strip().splitlines()[-1:],
                "loadavg_before": load_before, "loadavg_after": load_after}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ev = result["evaluations"]
    result.update(global_batch=global_batch, loadavg_before=load_before, loadavg_after=load_after,
                  seconds_per_plan=result["seconds"] / result["plans"],
                  seconds_per_build=result["stages"].get("per-rank programs", 0.0) / max(1, ev.get("rank_program_builds", 0)))
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pt2", default=None, help="search this export instead of the Llama-shaped ones")
    parser.add_argument("--runs", default=",".join(f"{n}:{gb}" for n, gb in RUNS),
                        help="LAYERS:GLOBAL_BATCH,... (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="stop a search after this long")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from speed_llama70b import cached_export
    runs = []
    for item in args.runs.split(","):
        layers, gb = (int(x) for x in item.split(":"))
        pt2 = Path(args.pt2) if args.pt2 else cached_export(layers)[0]
        t0 = time.perf_counter()
        r = run_one(pt2, gb, args.timeout_s)
        r["wall_s"] = time.perf_counter() - t0
        r["layers"] = layers
        runs.append(r)
        print(json.dumps({k: r.get(k) for k in ("layers", "global_batch", "seconds", "plans", "evaluations",
                                                 "loadavg_after")}))
    previous = RESULTS / "search_eval_cost.json"
    before = json.loads(previous.read_text()).get("projected_search_s_one_class") if previous.exists() else None
    payload = {"nodes": NODES, "gpus_per_node": GPUS, "seq": SEQ, "device": DEVICE,
               "target_s": TARGET_S, "projected_before_s": before, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "search_speed.json").write_text(json.dumps(payload, indent=2))
    (RESULTS / "search_speed.md").write_text(render(payload))
    print(render(payload))
    return 0


def render(payload: dict) -> str:
    lines = ["# `--search` speed on an 80-layer model", "",
             f"Llama-2-70B-shaped exports (80 layers; 8 layers of the same shape), {payload['nodes']} x "
             f"{payload['gpus_per_node']} "
             f"{payload['device']}, seq {payload['seq']}, bf16 autocast, top 5; target < {payload['target_s']:.0f} s "
             f"end to end (load and capture included). Before this work the same search projected to "
             f"{payload['projected_before_s'] or float('nan'):.0f} s (benchmarks/results/search_eval_cost.json: "
             "every plan evaluated with two allocator replays).", "",
             "| layers | global batch | plans | seconds | s/plan | memory bound | not modelled | rank liveness | "
             "time floor | "
             "allocator OOM | not checked | listed | builds | probe builds | time evals | full evals | "
             "load before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["runs"]:
        if "error" in r:
            lines.append(f"| {r.get('layers', 80)} | {r['global_batch']} | error: {r['error']} |")
            continue
        ev = r["evaluations"]
        lines.append(
            f"| {r.get('layers', 80)} | {r['global_batch']} | {r['plans']} | {r['seconds']:.1f}"
            f"{' (stopped, unfinished)' if r.get('stopped') else ''} | "
            f"{r['seconds_per_plan']:.3f} | "
            f"{r['pruned_by_memory_bound']} | {sum(r['not_modelled'].values())} | {r['pruned_by_rank_liveness']} | "
            f"{r['skipped_by_time_bound']} | {r['over_memory']} | {r['not_checked']} | {len(r['ranked'])} | "
            f"{ev.get('rank_program_builds', 0)} | {ev.get('probe_builds', 0)} | {ev.get('time_evaluations', 0)} | "
            f"{ev.get('full_evaluations', 0)} | "
            f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f} |")
    lines += ["", "Seconds by stage (wall time inside the search):", ""]
    for r in payload["runs"]:
        if "error" not in r:
            stages = ", ".join(f"{k} {v:.1f}" for k, v in r["stages"].items())
            lines.append(f"- {r.get('layers', 80)} layers, global batch {r['global_batch']}: {stages}")
    lines += ["", "Plans listed:", ""]
    for r in payload["runs"]:
        if r.get("stopped"):
            lines.append(f"- {r.get('layers', 80)} layers, gb {r['global_batch']}: stopped at the time limit; "
                         "the best found by then (not the search's answer):")
        for i, row in enumerate(r.get("ranked", []), 1):
            lines.append(f"- {r.get('layers', 80)} layers, gb {r['global_batch']} #{i} {row['plan']}: "
                         f"step {row['step_ns'] / 1e6:.0f} ms, "
                         f"peak {row['peak_bytes'] / 2**30:.1f} GiB, MFU {row['mfu']:.1%}")
        if "error" in r:
            lines.append(f"- {r.get('layers', 80)} layers, gb {r['global_batch']}: {r['error'][0]}")
        elif not r.get("ranked"):
            lines.append(f"- {r.get('layers', 80)} layers, gb {r['global_batch']}: no modelled plan fits")
    lines += ["", "Tensor and pipeline plans are built and timed like the data-parallel ones; combinations whose "
              "per-rank programs are not built (pp with HSDP, ...) are counted 'not modelled' before any rewrite runs. "
              "A pipeline plan's stage programs hold one forward and backward per micro-batch, so its build grows with "
              "the micro-batch count. Timings are disturbed by other agents on this machine (load averages above); "
              "the plan and evaluation counts are not.", "",
              "Before tensor and pipeline parallelism were modelled (git history of this file, 2026-12-01 ~13:00 UTC) "
              "the same searches took 55 s and 53 s: every TP/PP plan was then 'not modelled'.", "",
              "The step-time floors (docs/design.md, 'Parallel plan search') count the data-parallel collectives, the "
              "TP all-reduces, the optimizer's share, FSDP's copies and the overlap slowdown since 2026-12-05; before "
              "that the 8-layer search built 131 per-rank programs and did not finish in 600 s. Since the same day "
              "(later) a stack of 14+ layers is built at two shallow depths and carried on to its depth "
              "(docs/design.md, 'Depth probes'; 'builds' above counts full-depth builds, 'probe builds' the shallow "
              "ones), and a pipeline's floor counts the head and loss on its last stage and each micro-batch's "
              "gradient accumulation; before that no 80-layer search finished in 600 s (one 80-layer per-rank build "
              "cost ~14 s).", "",
              "Plans without pipelining also split the rank's batch into accumulated micro-batches since 2026-12-06 "
              "(docs/design.md, 'Gradient accumulation without pipelining'; before that `--microbatches` was ignored "
              "without pp): at global batch 512, where no plan ran its 8 sequences per rank in one pass, the search "
              "built pipeline plans until the 600 s limit and listed nothing (566 plans); it now lists "
              "`dp_shard=64 microbatches=2` first and finishes (754 plans). At 128 it took 117 s before (358 plans). "
              "Built whole at 80 layers, that first plan's step is the listed one and its total 58.2 GiB (listed, "
              "carried on from the probes: 59.3 GiB; 55.7 GiB in a first run whose probes read the first "
              "micro-batch's liveness, without the accumulated gradients).", "",
              "Since 2026-12-06 (later) the TP rank's footprint that tightens a TP plan's floors is built at the two "
              "probe depths and carried on (docs/design.md, 'Parallel plan search'; 'tp_rank_analyses' counts two "
              "per degree) instead of expanded and analysed at 80 layers: the same plans listed with the same "
              "numbers, 'time bound' 43.5 -> 30.6 s at global batch 128 (98.5 -> 82.6 s in all) and 45.6 -> 28.4 s "
              "at 512 (203 -> 186 s). A first version took the pipeline floors of TP plans from the "
              "single-device footprint over tp (no per-layer lists carried): 20 more program keys, mostly TP pipelines, were built "
              "and the search at 128 took 205 s; the per-layer lists are carried too since.", "",
              "Timings move with this VM's load by a third: the code that took 82.6 s at global batch 128 (the "
              "paragraph above) took 56.0 s at 2026-12-06 21:40 UTC (the same plans, steps and counts). Since "
              "22:00 the same day the GPU model's calibration is read once (it was read twice per analysis: 2.8 s "
              "of a profiled search) and the block pass no longer prints symbolic sizes for its keys (~5% of a "
              "search profiled); the table above is the run after those. Profiled (cProfile, global batch 512), "
              "what remains: the TP ranks' truncated re-traces (7 traces, ~2.5 s each), one Analysis per rank "
              "class and probe depth (241 at global batch 512, ~0.16 s each: the block, cost and liveness "
              "passes), fx's node copies in the rank rewrites (torch 2.13's create_node walks every node's "
              "arguments with pytree: ~12% of the profile), and pipeline stages' replays; a pipeline plan of "
              "16 stages and 64 micro-batches costs 11-14 s to build at its two probe depths, and three of them "
              "lie within 2% of the fifth plan's step.", "",
              "Since 2026-12-07 01:00 UTC (the table above): (1) the search pauses Python's cyclic collector, as "
              "`boomfx analyze` already did around the whole command (the library path did not; this benchmark "
              "measures that path): each automatic collection walked every node built so far, 128.9 -> 86.7 s at "
              "global batch 512 in one A/B, peak RSS 3.5 -> 4.5 GB in that run (2.2 GB for the CLI below); (2) the rank rewrites copy nodes without "
              "torch 2.13's per-node pytree walk (boomfx/core/fx_copy.py) and a template stage's replay places "
              "whole actions (pipeline_compose.py); (3) a pipeline stage's memory floor counts what it holds after "
              "its first backward: its gradients, FSDP's gathered layers (PipelineStage turns resharding after "
              "backward off) or DDP's buckets, and the micro-batches 1F1B puts in flight again (search_bounds.py): "
              "at global batch 512, 30 of the 48 probe builds were pipeline plans (pp 2, 4, 8, 16) that the "
              "liveness check then found over memory; 18 of those are no longer built (48 -> 16 probe builds). "
              "The same plans are listed with the same numbers. The CLI, `boomfx analyze llama70b_80l.pt2 --train "
              "--amp bf16 --search --nodes 8 --gpus-per-node 8 --global-batch 512 --seq 2048 --device h100-sxm`, "
              "took 54.5 s wall (process start to exit, /usr/bin/time; 44.5 s inside the search). What remains at "
              "512: the TP ranks' re-traces ('time bound'), and three pp=16 plans of 64 micro-batches (6-8 s each; "
              "two over memory by a margin the floor does not see: each micro-batch's receive buffers, DDP's "
              "bucket views).", "",
              "Target (< " + f"{payload['target_s']:.0f}" + " s on 80 layers): " + (
                  "met" if all(r.get("seconds", 1e9) < payload["target_s"] and not r.get("stopped")
                               for r in payload["runs"] if r.get("layers") == 80) else
                  "not met: what remains is listed by stage above (the TP ranks' re-traces, ~5 s per degree and "
                  "checkpointing setting, under 'time bound'; plans' probe builds under 'per-rank programs': at "
                  "global batch 512 the pipeline plans whose floors lie under the fifth plan's step)")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
