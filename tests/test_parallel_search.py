"""``--search`` end to end (boomfx/distributed/plan_search.py): the plans it lists fit and are the fastest of
every plan a brute-force full evaluation finds; the memory bound that discards plans before any per-rank
program is built is a floor of the full evaluation (allocator replay included), so a plan it prunes really
does not fit; bad command lines are one line and exit 2.

The model is a GPT of the examples (d=256, 2 layers, 2 heads: 1.7 M parameters, ~27 MB of AdamW training
state) on 4 H100s whose memory is cut so that the plans differ: full replicas of the state do not fit, shards do, and
checkpointing decides some of them.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from models import GPT  # noqa: E402

from boomfx.analysis.analysis import AnalyzeOptions  # noqa: E402
from boomfx.cli.main import main  # noqa: E402
from boomfx.core.devices import get_device  # noqa: E402
from boomfx.core.program import ProgramOptions  # noqa: E402
from boomfx.distributed.analysis import DistributedAnalysis  # noqa: E402
from boomfx.distributed.plan import ParallelConfig  # noqa: E402
from boomfx.distributed.plan_search import ParallelSearch, SearchRequest, program_maker  # noqa: E402
from boomfx.core.errors import OptionError  # noqa: E402
from boomfx.distributed.model_shape import model_shape  # noqa: E402
from boomfx.distributed.search import Plan, SearchSpace, enumerate_plans  # noqa: E402
from boomfx.frontend.capture import resolve_bindings  # noqa: E402

MIB = 1 << 20
HEADS = 2          # tp 1 or 2: few tensor-parallel programs to build (each re-traces the step)
NODES, GPUS, GLOBAL_BATCH, SEQ = 1, 4, 16, 64
H100 = get_device("h100-sxm")


@pytest.fixture(scope="module")
def gpt_pt2(tmp_path_factory) -> str:
    with torch.device("meta"):
        model = GPT(vocab=128, d=256, layers=2, heads=HEADS, max_seq=256)
    ep = torch.export.export(model, (torch.randint(0, 128, (2, 8), device="meta"),),
                             dynamic_shapes={"idx": {0: Dim("batch", min=1, max=512), 1: Dim("seq", min=2, max=256)}})
    path = tmp_path_factory.mktemp("search") / "gpt256.pt2"
    torch.export.save(ep, str(path))
    return str(path)


@pytest.fixture(scope="module")
def programs(gpt_pt2):
    make = program_maker(gpt_pt2, options=ProgramOptions(train=True, target_kind="cuda"))
    return {ckpt: make(ckpt) for ckpt in (False, True)}


def _full(programs, device, plan: Plan, nodes: int = NODES, gpus: int = GPUS, network: str = "ib-ndr",
          reshard_after_forward: Optional[bool] = None, **options) -> Optional[dict]:
    """An independent full evaluation of ``plan``: the ``--parallel`` analysis of it at its per-rank batch
    (None: a plan whose per-rank programs are not built yet); ``options``: other ParallelConfig fields."""
    cfg = ParallelConfig(plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp, nodes=nodes, gpus_per_node=gpus,
                         microbatches=plan.microbatches, network=network, reshard_after_forward=reshard_after_forward,
                         **options)
    program = programs[plan.checkpoint]
    try:
        dist = DistributedAnalysis(program, cfg, device, AnalyzeOptions(device.name))
    except OptionError:
        return None
    bindings = resolve_bindings(program, {}, GLOBAL_BATCH // plan.dp, SEQ)
    classes = dist.evaluate(bindings).report.parallel["classes"]
    return {"fits": all(c["fits"] for c in classes), "step_ns": max(c["step_time_ns"] for c in classes),
            "total_bytes": max(c["total_device_bytes"] for c in classes)}


@pytest.fixture(scope="module")
def truth(programs) -> dict:
    """Every modelled plan's full evaluation on the full-size H100 (memory then decided per test): the data-
    parallel ones always, tensor and pipeline ones once their rewrites are built."""
    shape = model_shape(programs[False])
    space = SearchSpace(NODES, GPUS, GLOBAL_BATCH, shape.layers, shape.heads, shape.kv_heads)
    found = {plan: _full(programs, H100, plan) for plan in enumerate_plans(space)}
    out = {plan: t for plan, t in found.items() if t is not None}
    assert {p for p in out if p.tp == p.pp == 1} == set(_data_parallel_plans())
    return out


def _data_parallel_plans() -> list[Plan]:
    world = NODES * GPUS
    # 4 sequences per rank: also as 2 or 4 accumulated micro-batches
    return [Plan(world // shard, shard, 1, 1, m, ckpt) for shard in (1, 2, 4) for m in (1, 2, 4)
            for ckpt in (False, True)]


def _device_between(truth: dict) -> "get_device":
    """An H100 with memory between the plans' needs: the median plan's total, so some fit and some do not."""
    totals = sorted({t["total_bytes"] for t in truth.values()})
    assert len(totals) >= 3, totals           # the plans must differ for the test to mean anything
    return replace(H100, memory_bytes=totals[len(totals) // 2])


def _search(programs, device, top: int):
    request = SearchRequest(NODES, GPUS, GLOBAL_BATCH, SEQ, top=top)
    return ParallelSearch(lambda ckpt: programs[ckpt], device, request, AnalyzeOptions(device.name)).run()


@pytest.mark.slow      # a search over every plan of the world (~5-15 s)
def test_search_lists_the_fastest_plans_that_fit(programs, truth) -> None:
    device = _device_between(truth)
    outcome = _search(programs, device, top=3)
    fitting = sorted(((t["step_ns"], p.describe()), p) for p, t in truth.items()
                     if t["total_bytes"] <= device.memory_bytes)
    assert len(fitting) >= 3 and len(fitting) < len(truth), [(t["total_bytes"], p) for p, t in truth.items()]
    listed = [r.plan for r in outcome.ranked]
    # exactly the 3 fastest of the brute force that fit, fastest first, with the brute force's numbers
    assert listed == [p for _, p in fitting[:3]]
    for row in outcome.ranked:
        assert row.step_ns == pytest.approx(truth[row.plan]["step_ns"], rel=1e-9)
        assert row.peak_bytes == truth[row.plan]["total_bytes"] <= device.memory_bytes
    best = outcome.best
    assert all(best.step_ns <= r.step_ns for r in outcome.ranked)
    assert all(best.step_ns <= t["step_ns"] for t in truth.values() if t["total_bytes"] <= device.memory_bytes)
    # every plan the brute force could not evaluate is counted "not modelled" (or set aside before it)
    assert sum(outcome.not_modelled.values()) <= outcome.plans - len(truth)
    accounted = (len(outcome.ranked) + outcome.pruned_by_bound + outcome.pruned_by_liveness + outcome.over_memory
                 + outcome.not_checked + outcome.skipped_by_time_bound + sum(outcome.not_modelled.values()))
    assert accounted == outcome.plans


@pytest.mark.slow      # a search over every plan of the world (~5-15 s)
def test_metrics_of_a_listed_plan(programs, truth) -> None:
    row = _search(programs, H100, top=1).best
    tokens = GLOBAL_BATCH * SEQ
    assert row.tokens_per_s_per_gpu == pytest.approx(tokens / (row.step_ns / 1e9) / (NODES * GPUS))
    # torchtitan's 6 N + 12 L H Q T per token: N the non-embedding parameters of a d=256 GPT layer pair
    d, layers, vocab = 256, 2, 128
    non_embedding = sum(p.numel() for name, p in GPT(vocab=vocab, d=d, layers=layers, heads=HEADS, max_seq=256,
                                                    ).named_parameters() if "emb" not in name and "wte" not in name
                        and "wpe" not in name)
    flops = (6 * non_embedding + 12 * layers * HEADS * (d // HEADS) * SEQ) * tokens
    assert row.mfu == pytest.approx(flops / (row.step_ns / 1e9) / (NODES * GPUS) / H100.peak_for(torch.float32),
                                    rel=1e-6)


def test_the_memory_bound_is_a_floor_of_the_full_evaluation(programs, truth) -> None:
    search = ParallelSearch(lambda ckpt: programs[ckpt], H100, SearchRequest(NODES, GPUS, GLOBAL_BATCH, SEQ),
                            AnalyzeOptions(H100.name))
    tighter = 0
    for plan, t in truth.items():
        footprint = search.footprint(plan.checkpoint)
        micro_batch = GLOBAL_BATCH // plan.dp // plan.microbatches  # the bounds take one micro-batch (pp)
        bound = search.memory_footprint(plan).lower_bound_bytes(plan, micro_batch)   # TP: the TP rank's program
        assert bound <= t["total_bytes"], plan
        assert footprint.lower_bound_bytes(plan, micro_batch) <= t["total_bytes"], plan
        assert footprint.step_lower_bound_ns(plan, micro_batch) <= t["step_ns"], plan
        tighter += plan.tp > 1 and bound > footprint.lower_bound_bytes(plan, micro_batch)
    # the TP rank's own program counts what TP leaves whole (norms, the residual stream): a tighter floor
    assert tighter > 0
    # and it is not vacuous: a full replica's bound counts its whole training state
    resident, grads = search.footprint(False).state_bytes()
    assert resident + grads > 20 * MIB


def test_the_step_floor_with_collectives_is_a_floor_of_the_full_evaluation(programs, truth) -> None:
    search = ParallelSearch(lambda ckpt: programs[ckpt], H100, SearchRequest(NODES, GPUS, GLOBAL_BATCH, SEQ),
                            AnalyzeOptions(H100.name))
    tighter = 0
    for plan, t in truth.items():
        micro_batch = GLOBAL_BATCH // plan.dp // plan.microbatches
        compute = search.footprint(plan.checkpoint).step_lower_bound_ns(
            plan, micro_batch, search._tp_layer_comm_ns(plan, micro_batch))
        comm = search._dp_comm(plan).busiest_ns
        floor = search._step_floor(plan)
        assert max(compute, comm) <= floor <= search._tight_step_floor(plan) <= t["step_ns"], plan
        assert (comm > 0) == (plan.dp > 1), plan
        tighter += search._tight_step_floor(plan) > floor
    # the TP rank's own kernels (norms and residual stream whole) tighten the TP plans' floors
    assert tighter > 0
    # a pipeline's floor counts the head and loss on the last stage, the embedding on the first, and every
    # micro-batch after the first adding its gradients into .grad: above the layers-only textbook bound
    pipelines = [p for p in truth if p.pp > 1 and p.tp == 1 and p.microbatches > 1]
    assert pipelines
    for plan in pipelines:
        footprint = search.footprint(plan.checkpoint)
        micro_batch = GLOBAL_BATCH // plan.dp // plan.microbatches
        footprint.compute_ns(micro_batch)
        per_layer = footprint._layer_compute[micro_batch]
        half = len(per_layer) // 2
        stages = [sum(per_layer[:half]), sum(per_layer[half:])]
        textbook = max(plan.microbatches * stages[0], stages[0] + plan.microbatches * stages[1])
        assert footprint.pipeline_step_floor_ns(plan, micro_batch) > textbook, plan


def test_the_floors_hold_for_pipelines_that_reshard_after_forward(programs, truth) -> None:
    """``--reshard-after-forward true`` with pp: each FSDP layer is all-gathered at least twice a step (its
    first forward and first backward, pp_fsdp.py), not once; the memory bound and the step floor stay under
    the full evaluation of those plans, which take longer than the same plans without resharding."""
    request = SearchRequest(NODES, GPUS, GLOBAL_BATCH, SEQ, config_options={"reshard_after_forward": True})
    search = ParallelSearch(lambda ckpt: programs[ckpt], H100, request, AnalyzeOptions(H100.name))
    plans = [p for p in truth if p.pp > 1 and p.dp_shard > 1]
    assert plans
    for plan in plans:
        full = _full(programs, H100, plan, reshard_after_forward=True)
        micro_batch = GLOBAL_BATCH // plan.dp // plan.microbatches
        assert search.memory_footprint(plan).lower_bound_bytes(plan, micro_batch) <= full["total_bytes"], plan
        assert search._dp_comm(plan).busiest_ns > 0
        assert search._step_floor(plan) <= search._tight_step_floor(plan) <= full["step_ns"], plan
        assert full["step_ns"] > truth[plan]["step_ns"], plan


def test_a_pipeline_stage_is_floored_after_its_first_backward(programs, truth) -> None:
    """After a stage's first backward its gradients accumulate and, with FSDP, its layers stay gathered
    (pp_fsdp.py) while 1F1B refills the micro-batches in flight: the memory floor counts that by hand
    formula, it is above the floor at the first backward for some plan (so it prunes more), and it stays
    under the full evaluation, also under FSDP's mixed precision (bf16 gathers, fp32 accumulators)."""
    search = ParallelSearch(lambda ckpt: programs[ckpt], H100, SearchRequest(NODES, GPUS, GLOBAL_BATCH, SEQ),
                            AnalyzeOptions(H100.name))
    plans = [p for p in truth if p.pp > 1 and p.tp == 1]
    assert any(p.dp_shard > 1 for p in plans) and any(p.dp_shard == 1 for p in plans)
    above_first_backward = 0
    for plan in plans:
        footprint = search.footprint(plan.checkpoint)
        micro_batch = GLOBAL_BATCH // plan.dp // plan.microbatches
        state, elems = footprint.layer_state_bytes(), footprint.layer_param_elems()
        saved = footprint.layer_saved_bytes(micro_batch)
        ranges = footprint._stage_ranges(plan)
        inflight = [footprint._inflight(plan, s) for s in range(plan.pp)]
        held = [f if plan.microbatches > f else f - 1 for f in inflight]
        # fp32 gradients (4 bytes per element) and, with FSDP, fp32 parameters gathered, with DDP its buckets
        per_elem = 4 + (4 if plan.dp_shard > 1 or plan.dp_replicate > 1 else 0)
        after = max(sum(state[lo:hi]) / plan.dp_shard + per_elem * sum(elems[lo:hi]) + held[s] * sum(saved[lo:hi])
                    for s, (lo, hi) in enumerate(ranges))
        first = max(sum(state[lo:hi]) / plan.dp_shard + inflight[s] * sum(saved[lo:hi])
                    for s, (lo, hi) in enumerate(ranges))
        assert footprint.pipeline_bound_bytes(plan, micro_batch) == int(max(after, first)), plan
        assert after <= truth[plan]["total_bytes"], plan
        above_first_backward += after > first
    assert above_first_backward > 0
    plans = [p for p in plans if p.dp_shard > 1]
    mixed = {"fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "fp32"}
    request = SearchRequest(NODES, GPUS, GLOBAL_BATCH, SEQ, config_options=mixed)
    search = ParallelSearch(lambda ckpt: programs[ckpt], H100, request, AnalyzeOptions(H100.name))
    plan = next(p for p in plans if not p.checkpoint)
    footprint = search.footprint(False)
    assert footprint._bytes_per_elem_after_backward(plan) == 2 + 2     # the narrowest the policy allows: bf16 both
    full = _full(programs, H100, plan, **mixed)
    assert search.memory_footprint(plan).lower_bound_bytes(plan, GLOBAL_BATCH // plan.dp // plan.microbatches) \
        <= full["total_bytes"]


@pytest.mark.slow      # three data-parallel plans fully evaluated on two nodes (~10 s)
def test_collectives_decide_the_floor_over_a_slow_network(programs) -> None:
    # 2 nodes x 2 GPUs over 25 GbE: the gradients' and parameters' collectives outlast the compute, and
    # their floor (boomfx/distributed/comm_floor.py) stays under the full evaluation, HSDP included
    request = SearchRequest(2, 2, GLOBAL_BATCH, SEQ, network="eth-25")
    search = ParallelSearch(lambda ckpt: programs[ckpt], H100, request, AnalyzeOptions(H100.name))
    for plan in [Plan(4 // shard, shard, 1, 1, 1, False) for shard in (1, 2, 4)]:   # DDP, HSDP, FSDP
        t = _full(programs, H100, plan, nodes=2, gpus=2, network="eth-25")
        compute = search.footprint(plan.checkpoint).step_lower_bound_ns(plan, GLOBAL_BATCH // plan.dp)
        comm = search._dp_comm(plan).busiest_ns
        assert compute < comm <= search._step_floor(plan) <= t["step_ns"], plan
        assert comm > 0.6 * t["step_ns"], plan      # and close to it: the collectives are most of the step
    # the network reaches the full evaluation (ParallelConfig.network), not only the floor
    fast = _full(programs, H100, plan, nodes=2, gpus=2, network="ib-ndr")
    assert fast["step_ns"] < 0.5 * t["step_ns"]


def test_parallel_takes_the_network(capsys, examples_dir: Path) -> None:
    steps = {}
    for network in ("ib-ndr", "eth-25"):
        code = main(["analyze", str(examples_dir / "gpt_tiny.pt2"), "--train", "--parallel", "dp_shard=4", "--nodes",
                     "2", "--gpus-per-node", "2", "--batch", "2", "--seq", "32", "--device", "h100-sxm",
                     "--network", network, "--json"])
        out, _ = capsys.readouterr()
        assert code == 0
        parallel = json.loads(out)["parallel"]
        assert parallel["config"]["network"] == network
        steps[network] = max(c["step_time_ns"] for c in parallel["classes"])
    assert steps["eth-25"] > steps["ib-ndr"]


@pytest.mark.slow      # a search over every plan of the world (~5-15 s)
def test_a_plan_the_bound_prunes_does_not_fit(programs, truth) -> None:
    # memory just under the bound of the full-replica plans: the bound prunes them, FSDP's shards pass it
    search = ParallelSearch(lambda ckpt: programs[ckpt], H100, SearchRequest(NODES, GPUS, GLOBAL_BATCH, SEQ),
                            AnalyzeOptions(H100.name))
    ddp = Plan(NODES * GPUS, 1, 1, 1, 1, True)
    capacity = search.footprint(True).lower_bound_bytes(ddp, GLOBAL_BATCH // ddp.dp) - 1
    device = replace(H100, memory_bytes=capacity)
    outcome = _search(programs, device, top=2)
    # the search's bound takes one micro-batch (ParallelSearch._micro_batch)
    pruned = [p for p in truth
              if search.footprint(p.checkpoint).lower_bound_bytes(p, GLOBAL_BATCH // p.dp // p.microbatches) > capacity]
    assert ddp in pruned and outcome.pruned_by_bound >= len(pruned)
    for plan in pruned:
        assert truth[plan]["total_bytes"] > capacity, plan     # the full evaluation agrees: it does not fit
        assert plan not in [r.plan for r in outcome.ranked]


def _bad(capsys, *argv: str) -> str:
    code = main(list(argv))
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("boomfx: error:")
    return lines[0]


@pytest.mark.parametrize("extra, message", [
    (["--parallel", "tp=3"], "the fixed degrees multiply to 3 ranks, which does not divide the world of 2 node(s) x 4"),
    (["--parallel", "dp_shard=8", "--global-batch", "12"], "--global-batch 12 does not split over the fixed"),
    (["--global-batch", "0"], "--global-batch must be at least 1"),
    (["--network", "ib-nope"], "--network: unknown network 'ib-nope'"),
    (["--batch", "4"], "--batch cannot be combined with --search"),
])
def test_bad_search_input_is_one_line_and_exit_2(capsys, examples_dir: Path, extra, message) -> None:
    argv = ["analyze", str(examples_dir / "gpt_tiny.pt2"), "--train", "--search", "--nodes", "2",
            "--gpus-per-node", "4", "--seq", "32", "--device", "h100-sxm"]
    if "--global-batch" not in extra:
        argv += ["--global-batch", "16"]
    assert message in _bad(capsys, *argv, *extra)


def test_search_needs_the_world(capsys, examples_dir: Path) -> None:
    line = _bad(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--train", "--search", "--nodes", "2",
                "--global-batch", "16")
    assert "--gpus-per-node" in line


def test_cli_prints_the_table(capsys, examples_dir: Path) -> None:
    code = main(["analyze", str(examples_dir / "gpt_tiny.pt2"), "--train", "--search", "--nodes", "1",
                 "--gpus-per-node", "2", "--global-batch", "4", "--seq", "32", "--device", "h100-sxm", "--top", "2"])
    out, _ = capsys.readouterr()
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["#", "plan"] and lines[2].split()[0] == "1"
    assert "not modelled" in out and "plans:" in out
