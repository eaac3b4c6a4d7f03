"""``boomfx analyze FILE.pt2 --train --search --nodes N --gpus-per-node G --global-batch B``: its options,
their checks (one line, exit 2, before the slow capture) and the table it prints."""
from __future__ import annotations

import argparse
import json
from typing import Any

from boomfx.analysis.analysis import AnalyzeOptions
from boomfx.core.devices import DeviceSpec
from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.core.units import fmt_bytes, fmt_time
from boomfx.distributed.cli import on_off
from boomfx.distributed.plan_search import ParallelSearch, SearchOutcome, SearchRequest, parse_pinned, program_maker


def add_search_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel plan search (with --train; see docs/user-guide.md)")
    g.add_argument("--search", action="store_true",
                   help="find the fastest parallel plans that fit on --nodes x --gpus-per-node GPUs "
                        "(degrees, micro-batches, checkpointing on/off); --top plans are listed; "
                        "--parallel holds some degrees fixed (e.g. tp=8)")
    g.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step over all data-parallel ranks (with --search)")
    g.add_argument("--max-microbatches", type=int, default=None,
                   help="with --search: the most micro-batches tried, pipeline or gradient accumulation "
                        "(default: any divisor of the rank's batch)")
    g.add_argument("--no-depth-probes", action="store_true",
                   help="with --search: build every plan at the model's depth (default: a deep stack is built at "
                        "two shallow depths and carried on; docs/design.md, 'Parallel plan search')")


def check_search_args(args: argparse.Namespace) -> None:
    """Everything that is wrong with the command line, found before the program is loaded."""
    if not args.train:
        raise OptionError("--search needs --train (it searches how to parallelise a training step)")
    if args.gpus_per_node is None:
        raise OptionError("--search needs --gpus-per-node (the world is --nodes x --gpus-per-node)")
    if args.global_batch is None:
        raise OptionError("--search needs --global-batch (sequences per step over all data-parallel ranks)")
    for flag, value in (("--batch", args.batch), ("--rank", args.rank), ("--microbatches", args.microbatches)):
        if value is not None:
            raise OptionError(f"{flag} cannot be combined with --search (the search chooses it per plan)")
    for flag, given in (("--sweep", args.sweep), ("--max-batch", args.max_batch), ("--max-seq", args.max_seq),
                        ("--trace", args.trace), ("--memory-snapshot", args.memory_snapshot),
                        ("--checkpoint-layers", args.checkpoint_layers)):
        if given:
            raise OptionError(f"{flag} cannot be combined with --search")


def search_request(args: argparse.Namespace, dims: dict) -> SearchRequest:
    tp_plan = tuple((pattern.strip(), style.strip()) for pattern, _, style in
                    (item.partition("=") for item in args.tp_plan.split(",") if item.strip()))
    request = SearchRequest(
        args.nodes, args.gpus_per_node, args.global_batch, args.seq, dims, args.top,
        (True,) if args.checkpoint else (False, True), parse_pinned(args.parallel), args.network,
        args.max_microbatches,
        {"pp_schedule": args.pp_schedule, "pp_stages_per_rank": args.pp_stages_per_rank,
         "reshard_after_forward": on_off(args.reshard_after_forward),
         "fsdp_param_dtype": args.fsdp_param_dtype, "fsdp_reduce_dtype": args.fsdp_reduce_dtype,
         "fsdp_wrap": args.fsdp_wrap,
         "bucket_cap_mb": args.bucket_cap_mb, "gradient_as_bucket_view": args.gradient_as_bucket_view,
         "tp_plan": tp_plan}, depth_probes=not args.no_depth_probes)
    request.check()
    return request


def run_search(args: argparse.Namespace, device: DeviceSpec, options: ProgramOptions, dims: dict,
               analyze_options: AnalyzeOptions, log: Any = None) -> int:
    check_search_args(args)
    request = search_request(args, dims)
    program_for = program_maker(args.file, options=options, log=log)
    outcome = ParallelSearch(program_for, device, request, analyze_options, reuse_blocks=not args.no_reuse).run()
    payload = {"device": device.name, "nodes": request.nodes, "gpus_per_node": request.gpus_per_node,
               "global_batch": request.global_batch, **outcome.to_dict()}
    if args.json == "-":
        print(json.dumps(payload, indent=2))
        return 0
    print(render_search(outcome, request, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


def render_search(outcome: SearchOutcome, request: SearchRequest, device: DeviceSpec) -> str:
    world = request.nodes * request.gpus_per_node
    lines = [f"boomfx --search: {request.nodes} node(s) x {request.gpus_per_node} {device.name} = {world} GPUs, "
             f"global batch {request.global_batch}; the {request.top} fastest plans that fit"]
    header = ["#", "plan", "micro-batch", "step", "peak/GPU", "MFU", "tokens/s/GPU", "exposed comm"]
    rows = [[str(i), r.plan.describe(), str(r.micro_batch), fmt_time(r.step_ns), fmt_bytes(r.peak_bytes),
             f"{r.mfu:.1%}", f"{r.tokens_per_s_per_gpu:,.0f}", fmt_time(r.exposed_comm_ns)]
            for i, r in enumerate(outcome.ranked, 1)]
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        lines.append("  " + "  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if not rows:
        lines.append("  no modelled plan fits")
    listed = len(outcome.ranked)
    lines.append(f"{outcome.plans} plans: {listed} listed, {outcome.pruned_by_bound} over memory by the state + "
                 f"activation bound, {outcome.pruned_by_liveness} over memory by rank liveness, "
                 f"{outcome.over_memory} over memory in the allocator replay, "
                 f"{outcome.not_checked} slower than #{listed}, "
                 f"{outcome.skipped_by_time_bound} under a step-time floor above #{listed}, "
                 f"{sum(outcome.not_modelled.values())} not modelled")
    for reason, count in outcome.not_modelled.most_common():
        lines.append(f"  not modelled ({count} plans): {reason}")
    e = outcome.evaluations
    lines.append(f"evaluations: {e['rank_program_builds']} per-rank program builds, {e['probe_builds']} at probe "
                 f"depths, {e['time_evaluations']} step times, {e['full_evaluations']} full (allocator) evaluations in "
                 f"{sum(outcome.seconds.values()):.1f} s")
    probed = sorted({r.probed_from for r in outcome.ranked if r.probed_from})
    if probed:
        depths = ", ".join(f"{a} and {b}" for a, b in probed)
        lines.append(f"rows from per-rank programs built at {depths} layers, carried on to the model's depth "
                     f"(step time as the full build; peak memory ~1-3% low: confirm the chosen plan with --parallel; "
                     f"--no-depth-probes builds every plan whole)")
    return "\n".join(lines)
