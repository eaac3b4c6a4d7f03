"""What one ``--search`` evaluation costs on an 80-layer training program, and what a full search would take.

Loads a Llama-70B-shaped export (``benchmarks/speed_llama70b.py`` builds and caches it; pass ``--pt2``),
captures the training step once (the symbolic part every plan of one program key shares), then times per
point what a plan's evaluation repeats: ``Analysis.evaluate`` at the plan's micro-batch (binding, pricing,
single-stream schedule, allocator replay) and ``schedule_rank`` (the rank's ops on compute and communication
streams). The projection multiplies by the plans ``enumerate_plans`` lists for 8 nodes x 8 GPUs.

NB: the program here is the single-device one (no collectives: the per-rank rewrites are on another branch),
so the streams part is a lower bound of a sharded rank's (which adds one op per collective and wait).

Run: ``python benchmarks/search_eval_cost.py [--pt2 PATH]``; writes ``benchmarks/results/search_eval_cost.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PT2 = ROOT / "benchmarks" / ".cache" / "llama70b_80l.pt2"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pt2", default=str(DEFAULT_PT2))
    parser.add_argument("--points", type=int, default=3)
    args = parser.parse_args()
    from boomfx.analysis.analysis import Analysis
    from boomfx.core.devices import get_device
    from boomfx.core.program import ProgramOptions
    from boomfx.distributed.rank_schedule import schedule_rank
    from boomfx.distributed.search import SearchSpace, enumerate_plans
    from boomfx.frontend.capture import capture, resolve_bindings

    load = [os.getloadavg()]
    device = get_device("h100-sxm")
    t0 = time.perf_counter()
    program = capture(args.pt2, options=ProgramOptions(train=True, amp="bf16", target_kind="cuda"))
    analysis = Analysis(program, device)
    build_s = time.perf_counter() - t0
    evaluate_s, schedule_s, ops = [], [], 0
    for batch in (1, 2, 4)[: args.points]:
        bindings = resolve_bindings(program, {}, batch, 2048)
        t1 = time.perf_counter()
        point = analysis.evaluate(bindings)
        t2 = time.perf_counter()
        step = schedule_rank(analysis, bindings, {}, point=point)
        t3 = time.perf_counter()
        evaluate_s.append(t2 - t1)
        schedule_s.append(t3 - t2)
        ops = len(step.timeline.spans)
        assert abs(step.step_ns - point.report.time.total_ns) <= 1e-6 * point.report.time.total_ns
    load.append(os.getloadavg())
    plans = len(enumerate_plans(SearchSpace(nodes=8, gpus_per_node=8, global_batch=512, layers=80, heads=64,
                                            kv_heads=8)))
    per_plan = statistics.median(evaluate_s) + statistics.median(schedule_s)
    result = {"pt2": args.pt2, "nodes_in_program": len(list(program.graph.nodes)), "stream_ops": ops,
              "build_s": build_s, "evaluate_s": evaluate_s, "schedule_rank_s": schedule_s,
              "plans_8x8": plans, "projected_search_s_one_class": plans * per_plan, "loadavg": load}
    out = ROOT / "benchmarks" / "results" / "search_eval_cost.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
