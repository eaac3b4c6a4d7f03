"""Pipeline schedules: the textbook bubble, sends on the critical path, in-flight micro-batches, bad input."""
from __future__ import annotations

import pytest

from boomfx.core.errors import BoomfxError
from boomfx.simulate.pipeline import PipelineError, StageCosts, simulate_pipeline, stage_orders


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (4, 3), (4, 8), (8, 16), (3, 7)])
def test_equal_stages_have_the_textbook_bubble(schedule, p, m):
    t = simulate_pipeline(schedule, [StageCosts(1.0, 2.0)] * p, m)
    # (m + p - 1) slots of f + b = 3 ns; every stage busy m * 3 ns -> bubble (p - 1) / (m + p - 1)
    assert t.total_ns == pytest.approx((m + p - 1) * 3.0)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 4, 2), (2, 4, 3), (4, 8, 4)])
def test_interleaving_divides_the_bubble_by_the_chunks(p, m, v):
    t = simulate_pipeline("interleaved", [StageCosts(1.0 / v, 2.0 / v)] * (p * v), m, chunks=v)
    # Megatron-LM (Narayanan et al. 2021): bubble time (p - 1) (f + b) / v over m (f + b) of work
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert t.total_ns == pytest.approx(m * 3.0 + (p - 1) * 3.0 / v)


def test_sends_sit_on_the_critical_path():
    t = simulate_pipeline("1f1b", [StageCosts(1.0, 2.0, send_ns=0.5)] * 2, 1)
    # F0 0-1, send 0.5, F1 1.5-2.5, B1 2.5-4.5, send 0.5, B0 5.0-7.0
    assert [(x.stage, x.step.kind, x.start_ns, x.end_ns) for x in t.passes] == [
        (0, "F", 0.0, 1.0), (1, "F", 1.5, 2.5), (1, "B", 2.5, 4.5), (0, "B", 5.0, 7.0)]
    assert t.total_ns == 7.0


def test_one_stage_is_the_sum_of_its_passes():
    t = simulate_pipeline("gpipe", [StageCosts(1.5, 2.5)], 5)
    assert t.total_ns == 5 * 4.0 and t.bubble_fraction == 0.0


def test_a_slow_stage_sets_the_pace():
    # 1F1B, stage 1 twice as slow: in steady state every stage waits for it, total >= m * (2 + 4) of stage 1
    stages = [StageCosts(1.0, 2.0), StageCosts(2.0, 4.0), StageCosts(1.0, 2.0)]
    t = simulate_pipeline("1f1b", stages, 6)
    assert t.busy_ns == (18.0, 36.0, 18.0)
    # stage 1 cannot start before F0 of stage 0 ends (1) and ends after the last B reaches stage 0 (+2)
    assert t.total_ns >= 1.0 + 36.0 + 2.0


def test_activations_in_flight():
    gpipe = simulate_pipeline("gpipe", [StageCosts(1.0, 1.0)] * 4, 8)
    ofob = simulate_pipeline("1f1b", [StageCosts(1.0, 1.0)] * 4, 8)
    assert gpipe.peak_in_flight == (8, 8, 8, 8)       # every forward before any backward
    assert ofob.peak_in_flight == (4, 3, 2, 1)        # p - s on stage s


def test_orders_hold_every_pass_once():
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        orders = stage_orders(schedule, 4, 8, chunks)
        for s, order in enumerate(orders):
            assert len(order) == len(set(order)) == 2 * 8 * chunks
            assert all(step.virtual_stage % 4 == s for step in order)


@pytest.mark.parametrize("call", [
    lambda: simulate_pipeline("zero-bubble", [StageCosts(1, 1)] * 2, 4),
    lambda: simulate_pipeline("interleaved", [StageCosts(1, 1)] * 8, 6, chunks=2),   # 6 micro-batches, 4 stages
    lambda: simulate_pipeline("gpipe", [StageCosts(1, 1)] * 4, 4, chunks=2),
    lambda: simulate_pipeline("1f1b", [StageCosts(1, 1)] * 2, 0),
])
def test_bad_pipelines_raise_the_project_error(call):
    with pytest.raises(PipelineError) as info:
        call()
    assert isinstance(info.value, BoomfxError)


def test_gradients_return_over_the_link_their_activation_took():
    stages = [StageCosts(1.0, 2.0, send_ns=1.0), StageCosts(1.0, 2.0, send_ns=2.0), StageCosts(1.0, 2.0)]
    t = simulate_pipeline("gpipe", stages, 1)
    # F 0-1, +1 -> F 2-3, +2 -> F 5-6, B 6-8, back over stage 1's link +2 -> B 10-12, over stage 0's +1 -> B 13-15
    assert [(x.stage, x.step.kind, x.start_ns, x.end_ns) for x in t.passes] == [
        (0, "F", 0.0, 1.0), (1, "F", 2.0, 3.0), (2, "F", 5.0, 6.0), (2, "B", 6.0, 8.0), (1, "B", 10.0, 12.0),
        (0, "B", 13.0, 15.0)]
