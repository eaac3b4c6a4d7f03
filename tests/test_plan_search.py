"""--search (boomfx/distributed/search.py): only valid plans, the memory bound prunes soundly, the answer is
the fastest plan that fits."""
from __future__ import annotations

import itertools

import pytest

from boomfx.core.errors import OptionError
from boomfx.distributed.search import (Plan, PlanResult, ReusingEvaluator, SearchSpace, enumerate_plans, plan_rows,
                                       search, state_lower_bound_bytes)
from boomfx.report.plan_table import render_plan_table

GIB = 1 << 30
SPACES = [
    SearchSpace(nodes=2, gpus_per_node=8, global_batch=32, layers=32, heads=32, kv_heads=8),
    SearchSpace(nodes=8, gpus_per_node=8, global_batch=512, layers=80, heads=64, kv_heads=8),
    SearchSpace(nodes=1, gpus_per_node=6, global_batch=12, layers=3, heads=12, tp_within_node=False),
    SearchSpace(nodes=3, gpus_per_node=4, global_batch=24, layers=8, heads=6, checkpoint=(False,)),
]


def _valid(space: SearchSpace, plan: Plan) -> bool:
    """The rules of the module docstring, written out independently."""
    if plan.world != space.world or plan.pp > space.layers:
        return False
    if space.heads % plan.tp or (space.kv_heads and space.kv_heads % plan.tp):
        return False
    if space.tp_within_node and space.gpus_per_node % plan.tp:
        return False
    if space.global_batch % plan.dp:
        return False
    local = space.global_batch // plan.dp
    if space.max_microbatches is not None and plan.microbatches > space.max_microbatches:
        return False
    # without pipelining the micro-batches are gradient accumulation: any split of the rank's batch
    return local % plan.microbatches == 0 and plan.microbatches >= plan.pp


@pytest.mark.parametrize("space", SPACES)
def test_exactly_the_valid_plans_are_enumerated(space):
    plans = enumerate_plans(space)
    assert len(plans) == len(set(plans))
    assert all(_valid(space, p) for p in plans)
    w = space.world
    brute = {Plan(r, s, t, p, m, c) for r, s, t, p in itertools.product(range(1, w + 1), repeat=4)
             if r * s * t * p == w for m in range(1, space.global_batch + 1) for c in space.checkpoint}
    assert set(plans) == {p for p in brute if _valid(space, p)}


def test_an_80_layer_model_on_64_gpus_has_hundreds_of_plans():
    plans = enumerate_plans(SPACES[1])
    assert len(plans) > 200
    assert not any(p.tp == 16 for p in plans)           # 16 GPUs do not fit in an 8-GPU node


STATE_BYTES = 70e9 * 16          # a 70B model's parameters + gradients + AdamW state (fp32 master, bf16 params)


def _toy_evaluator(calls: list):
    """A made-up cost model with the right shape: state shards, activations shrink with TP and checkpointing,
    a bubble with pipelining, communication growing with TP and DP."""
    def evaluate(plan: Plan) -> PlanResult:
        calls.append(plan)
        act = 40 * GIB / plan.tp / (4 if plan.checkpoint else 1) * (plan.pp / plan.microbatches if plan.pp > 1 else 1)
        peak = int(state_lower_bound_bytes(plan, STATE_BYTES) * 1.05 + act)
        compute = 1e9 / plan.world * (1.33 if plan.checkpoint else 1.0)
        bubble = (plan.pp - 1) / (plan.microbatches + plan.pp - 1)
        comm = 2e6 * plan.tp + 1e6 * plan.dp_shard + 3e5 * plan.dp_replicate
        time_ns = compute / (1 - bubble) + comm
        return PlanResult(time_ns, peak, peak <= 80 * GIB, 0.4 * 1e9 / plan.world / time_ns)
    return evaluate


def test_search_returns_the_fastest_plan_that_fits():
    calls: list[Plan] = []
    plans = enumerate_plans(SPACES[1])
    result = search(plans, _toy_evaluator(calls), 80 * GIB, STATE_BYTES, top=5)
    assert result.best is not None and result.best[1].fits
    assert len(result.ranked) == 5
    times = [r.time_ns for _, r in result.ranked]
    assert times == sorted(times)
    everything = {p: _toy_evaluator([])(p) for p in calls}
    assert all(result.best[1].time_ns <= r.time_ns for r in everything.values() if r.fits)
    assert result.evaluated == len(calls) == len(plans) - len(result.pruned)


def test_pruned_plans_are_never_evaluated_and_could_not_fit():
    calls: list[Plan] = []
    plans = enumerate_plans(SPACES[1])
    result = search(plans, _toy_evaluator(calls), 80 * GIB, STATE_BYTES)
    assert result.pruned and not set(result.pruned) & set(calls)
    # the bound is a lower bound of the evaluated peak: nothing it pruned would have fitted
    assert not any(_toy_evaluator([])(p).fits for p in result.pruned)
    # e.g. pure DDP keeps a full copy of the state: 1.12 TB on every GPU
    assert Plan(64, 1, 1, 1) in result.pruned


def test_evaluations_reuse_one_build_per_program():
    built: list = []

    def build(key):
        built.append(key)
        return key

    evaluator = ReusingEvaluator(build, lambda key, plan: _toy_evaluator([])(plan))
    plans = enumerate_plans(SPACES[0])
    result = search(plans, evaluator, 80 * GIB, 8e9 * 16)
    # micro-batch counts share their program: one build per (degrees, checkpointing) of the plans not pruned
    kept = [p for p in plans if p not in result.pruned]
    assert evaluator.builds == len(built) == len({p.program_key() for p in kept})
    assert len(built) < len(plans)


def test_table_and_bad_input():
    plans = enumerate_plans(SPACES[0])
    result = search(plans, _toy_evaluator([]), 80 * GIB, 8e9 * 16, top=3)
    text = render_plan_table(plan_rows(result), result.evaluated, len(result.pruned), result.not_fitting)
    assert text.splitlines()[1].split()[1] == result.best[0].describe().split()[0]
    assert f"{result.evaluated} plans evaluated" in text
    with pytest.raises(OptionError):
        search(plans, _toy_evaluator([]), 80 * GIB, 1, top=0)
    with pytest.raises(OptionError):
        enumerate_plans(SearchSpace(nodes=0, gpus_per_node=8, global_batch=8, layers=2, heads=2))
