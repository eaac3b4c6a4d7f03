"""``boomfx analyze --parallel ...``: the distributed options, their parsing and the per-rank output."""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from boomfx.distributed.mesh_groups import PP_TIED_GROUP
from boomfx.distributed.plan import DEFAULT_BUCKET_CAP_MB, SCHEDULES, TP_PRESET, ParallelConfig
from boomfx.core.errors import OptionError
from boomfx.core.units import fmt_bytes, fmt_time


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed training (per-rank programs and memory)")
    g.add_argument(
        "--parallel",
        default=None,
        metavar="DEGREES",
        help="dp_replicate=N,dp_shard=N,tp=N,pp=N[,sp]: DDP / FSDP2 / tensor / pipeline degrees; "
        "--batch is then per data-parallel rank",
    )
    g.add_argument("--nodes", type=int, default=1, help="nodes in the world (with --gpus-per-node)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: degrees / nodes)")
    g.add_argument("--network", default="ib-ndr",
                   help="the network between nodes (boomfx/core/networks.py): prices the collectives that cross "
                        "nodes, with --parallel and --search (ib-ndr)")
    g.add_argument("--pp-schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    g.add_argument(
        "--microbatches", type=int, default=None,
        help="micro-batches per step: the pipeline's (default pp); without pp, gradient accumulation (default 1)"
    )
    g.add_argument(
        "--pp-stages-per-rank", type=int, default=None,
        help="interleaved 1F1B: model chunks per pipeline rank (ScheduleInterleaved1F1B's local stages; default 2)"
    )
    g.add_argument(
        "--reshard-after-forward",
        default=None,
        choices=("true", "false"),
        help="FSDP2 reshard_after_forward for every layer unit (default: torchtitan's policy, true without pp "
        "and false with pp; the root is never resharded, fully_shard's default for it)",
    )
    g.add_argument(
        "--fsdp-param-dtype", default=None, help="FSDP2 MixedPrecisionPolicy param_dtype (bf16, fp32)"
    )
    g.add_argument("--fsdp-reduce-dtype", default=None, help="FSDP2 MixedPrecisionPolicy reduce_dtype")
    g.add_argument("--fsdp-wrap", default="layers", choices=("layers", "root"),
                   help="FSDP2 units: each layer then the root (torchtitan's, default), or the whole model as one")
    g.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB, help="DDP bucket size (25)")
    g.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    g.add_argument(
        "--tp-plan",
        default="",
        metavar="PATTERN=STYLE,...",
        help="explicit tensor-parallel plan: module fnmatch pattern = colwise|rowwise|colwise_packed (an "
        "embedding rowwise: vocabulary-parallel; colwise_packed: a fused q|k|v or gate|up projection, each "
        "part split), or 'torchtitan': the derived plan plus the vocabulary-parallel "
        "embedding and output head",
    )
    g.add_argument(
        "--loss-parallel",
        default=None,
        choices=("true", "false"),
        help="torchtitan's loss parallel: the head's logits stay split on the vocabulary and cross-entropy "
        "runs on the split (default: on with --tp-plan torchtitan and a cross-entropy loss, as torchtitan)",
    )
    g.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the rank whose report, trace and snapshot to show " "(default: the worst rank)",
    )


def on_off(value: Optional[str]) -> Optional[bool]:
    """``"true"``/``"false"`` -> the bool; not given -> None (the config's default policy)."""
    return None if value is None else value == "true"


def _defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False)
    add_parallel_args(parser)
    return vars(parser.parse_args([]))


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The options among ``names`` (dests) set to something other than their default, as flags."""
    defaults = _defaults()
    return ["--" + name.replace("_", "-") for name in names if getattr(args, name, None) != defaults[name]]


# options that shape a parallel plan: without --parallel or --search they would be read by nothing
_PLAN_OPTIONS = ("nodes", "gpus_per_node", "network", "pp_schedule", "pp_stages_per_rank", "reshard_after_forward",
                 "fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_wrap", "bucket_cap_mb", "gradient_as_bucket_view",
                 "tp_plan", "loss_parallel")


def parallel_config(args: argparse.Namespace) -> Optional[ParallelConfig]:
    if not args.parallel:
        if args.rank is not None:
            raise OptionError("--rank needs --parallel")
        if getattr(args, "search", False):
            return None
        if args.microbatches is not None:
            raise OptionError("--microbatches needs --parallel (gradient accumulation on one device: "
                              "--parallel dp_shard=1 --microbatches M)")
        unread = _given(args, _PLAN_OPTIONS)
        if unread:
            raise OptionError(f"{', '.join(unread)}: needs --parallel (or --search); without it the step is "
                              "analysed on one device and these would be ignored")
        return None
    plan = []
    preset = args.tp_plan.strip() == TP_PRESET
    for item in (i.strip() for i in ("" if preset else args.tp_plan).split(",") if i.strip()):
        pattern, sep, style = item.partition("=")
        if not sep:
            raise OptionError(f"--tp-plan: {item!r} is not PATTERN=colwise|rowwise|colwise_packed")
        plan.append((pattern.strip(), style.strip()))
    cfg = ParallelConfig.parse(
        args.parallel,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        network=args.network,
        pp_schedule=args.pp_schedule,
        microbatches=args.microbatches,
        pp_stages_per_rank=args.pp_stages_per_rank,
        reshard_after_forward=on_off(args.reshard_after_forward),
        fsdp_param_dtype=args.fsdp_param_dtype,
        fsdp_reduce_dtype=args.fsdp_reduce_dtype,
        fsdp_wrap=args.fsdp_wrap,
        bucket_cap_mb=args.bucket_cap_mb,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        tp_plan=tuple(plan),
        vocab_parallel=preset,
        loss_parallel=on_off(args.loss_parallel),
    )
    if cfg.pp == 1 and not getattr(args, "search", False):
        unread = _given(args, ("pp_schedule", "pp_stages_per_rank"))
        if unread:
            raise OptionError(f"{', '.join(unread)}: needs pipeline stages (pp > 1 in --parallel {args.parallel}); "
                              "without them it would be ignored")
    return cfg


def render_parallel(parallel: dict[str, Any]) -> str:
    """The per-rank table printed under the shown rank's report."""
    cfg = ParallelConfig(
        **{**parallel["config"], "tp_plan": tuple(tuple(x) for x in parallel["config"]["tp_plan"])}
    )
    batch = parallel.get("batch_per_rank")
    lines = ["", f"Per-rank memory: {cfg.describe()} on {parallel['world']} ranks"]
    if batch is not None:
        extra = f", micro-batch {parallel['micro_batch']}" if parallel.get("micro_batch") else ""
        lines.append(
            f"  batch {batch} per data-parallel rank (global batch {parallel['global_batch']}{extra})"
        )
    if cfg.fsdp_param_dtype or cfg.fsdp_reduce_dtype:
        lines.append(f"  FSDP mixed precision: parameters computed in {cfg.fsdp_param_dtype or 'their dtype'}, "
                     f"gradients reduced in {cfg.fsdp_reduce_dtype or 'the compute dtype'}; "
                     f"shards and optimizer state in the parameters' own dtype")
    header = [
        "ranks",
        "program",
        "peak live",
        "peak allocated",
        "peak reserved",
        "device total",
        "fits",
        "step",
    ]
    rows = []
    for c in parallel["classes"]:
        rows.append(
            [
                _ranks(c["ranks"]),
                c["description"],
                fmt_bytes(c["peak_live_bytes"]),
                fmt_bytes(c["peak_allocated_bytes"]) if c["peak_allocated_bytes"] is not None else "-",
                fmt_bytes(c["peak_reserved_bytes"]) if c["peak_reserved_bytes"] is not None else "-",
                fmt_bytes(c["total_device_bytes"]),
                "yes" if c["fits"] else "NO",
                fmt_time(c["step_time_ns"]),
            ]
        )
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        lines.append("  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)))
    lines.append(
        f"  worst rank: {parallel['worst_rank']}; the report above is rank {parallel['shown_rank']}'s"
    )
    tied = [(c["ranks"], col) for c in parallel["classes"] for col in c.get("collectives", ())
            if col["group"] == PP_TIED_GROUP]
    if tied:
        holders = sorted(r for ranks, _ in tied for r in ranks)
        lines.append(f"  a weight tied across the end stages (embedding and head): ranks {_ranks(holders)} hold a copy "
                     f"each and all-reduce its gradient ({fmt_bytes(tied[0][1]['input_bytes'])} per rank) among "
                     "the first and last stage after the pipeline, before the optimizer step (Megatron's embedding group)")
    times = parallel.get("time_by_class") or []
    if times:
        worst = max(times, key=lambda r: r["step_time_ns"])
        count = len(worst["collectives"])
        lines.append(
            f"  step (rank {worst['ranks'][0]}): {fmt_time(worst['step_time_ns'])} on compute and "
            f"communication streams; {count} collectives, {fmt_time(worst['exposed_comm_ns'])} exposed, "
            f"{fmt_time(worst['hidden_comm_ns'])} hidden behind compute"
            + (f"; pipeline bubble {worst['bubble_fraction']:.1%}" if worst.get("bubble_fraction") is not None else "")
            + (f", stage sends {fmt_time(worst['send_ns'])}" if worst.get("send_ns") else "")
        )
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def dump(parallel: dict[str, Any]) -> str:
    return json.dumps(parallel, indent=2)
