"""Scheduler contract: one behaviour per test, answers worked out by hand."""
from __future__ import annotations

from boomfx.simulate.timeline import ScheduledKernel, simulate


def k(name: str, host: float, device: float, **kw) -> ScheduledKernel:
    return ScheduledKernel(name, host, device, **kw)


def test_device_bound_equals_first_issue_plus_sum_of_kernels() -> None:
    """Kernels far longer than issue cost queue up: total = first issue + sum of device times."""
    tl = simulate([k("a", 5, 100), k("b", 5, 100), k("c", 5, 100)])
    assert tl.total_ns == 5 + 300
    assert [s.start_ns for s in tl.spans] == [5, 105, 205]


def test_host_bound_equals_sum_of_issue_plus_last_kernel() -> None:
    """Tiny kernels: the GPU waits for the host; total = sum of issue + the last kernel."""
    tl = simulate([k("a", 10, 2), k("b", 10, 2), k("c", 10, 2)])
    assert tl.total_ns == 30 + 2
    assert [s.start_ns for s in tl.spans] == [10, 20, 30]
    assert tl.host_bound_fraction > 0.8


def test_mixed_regime() -> None:
    """a: issue 10, runs 10-60; b: issue 20, waits for a, runs 60-65; c: issue 30, runs 65-70;
    d: issue 130 (host cost 100), runs 130-140."""
    tl = simulate([k("a", 10, 50), k("b", 10, 5), k("c", 10, 5), k("d", 100, 10)])
    assert [(s.start_ns, s.end_ns) for s in tl.spans] == [(10, 60), (60, 65), (65, 70), (130, 140)]
    assert tl.total_ns == 140


def test_single_stream_zero_host_overhead_is_sum_of_kernels() -> None:
    tl = simulate([k(str(i), 0, 7.5) for i in range(10)])
    assert tl.total_ns == 75


def test_host_sync_waits_for_the_stream() -> None:
    """After a sync op (.item()) the host resumes only when the stream has drained."""
    tl = simulate([k("a", 1, 100), k("item", 1, 1, host_sync=True), k("b", 1, 1)])
    # a: 1-101, item: 101-102, host waits until 102, issues b at 103
    assert tl.spans[2].start_ns == 103
    assert tl.total_ns == 104


def test_synchronous_cpu_mode_sums_op_times() -> None:
    tl = simulate([k("a", 50, 100), k("b", 50, 30)], synchronous=True)
    assert tl.total_ns == 130
    assert tl.spans[1].start_ns == 100


def test_deterministic() -> None:
    ks = [k(str(i), (i * 7) % 5, (i * 13) % 11) for i in range(50)]
    assert simulate(ks) == simulate(ks)


def test_empty_schedule() -> None:
    tl = simulate([])
    assert tl.total_ns == 0 and tl.spans == ()
