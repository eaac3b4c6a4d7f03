"""Multi-stream scheduler (boomfx/simulate/streams.py): one behaviour per test, numbers by hand."""
from __future__ import annotations

import pytest

from boomfx.simulate.streams import (COMPUTE, DEFAULT_GPU_SLOWDOWN, NO_SLOWDOWN, OverlapSlowdown, StreamError,
                                     StreamOp, simulate_streams)
from boomfx.simulate.timeline import ScheduledKernel, simulate

# A forward/backward-like mix: host-bound small kernels, device-bound large ones, and a host sync.
_KERNELS = [("k0", 5.0, 2.0), ("k1", 5.0, 40.0), ("k2", 3.0, 1.0), ("k3", 4.0, 30.0), ("k4", 6.0, 6.0),
            ("k5", 2.0, 50.0), ("k6", 7.0, 0.5)]


def _with_collectives(comm_ns: float, comm_host_ns: float = 1.5) -> list[StreamOp]:
    """The kernels above with an all-reduce after k1 (waited before k4) and one after k5 (waited at the end)."""
    ops: list[StreamOp] = []
    for name, host, dev in _KERNELS:
        ops.append(StreamOp(name, COMPUTE, dev, host))
        if name == "k1":
            ops.append(StreamOp("ar0", "comm:dp", comm_ns, comm_host_ns, deps=("k1",)))
        if name == "k3":
            ops.append(StreamOp("wait0", COMPUTE, 0.0, 0.0, deps=("ar0",)))
        if name == "k5":
            ops.append(StreamOp("ar1", "comm:dp", comm_ns, comm_host_ns, deps=("k5",)))
    ops.append(StreamOp("wait1", COMPUTE, 0.0, 0.0, deps=("ar1",)))
    return ops


def _single_stream(ops: list[StreamOp]) -> list[ScheduledKernel]:
    return [ScheduledKernel(op.name, op.host_ns, op.device_ns, 0, op.host_sync) for op in ops]


@pytest.mark.parametrize("slowdown", [NO_SLOWDOWN, DEFAULT_GPU_SLOWDOWN])
def test_free_communication_gives_the_single_device_schedule(slowdown):
    ops = _with_collectives(comm_ns=0.0)
    t = simulate_streams(ops, slowdown)
    # the same ops on one stream, collectives taking no device time: timeline.simulate's rule
    assert t.total_ns == pytest.approx(simulate(_single_stream(ops)).total_ns)
    assert t.exposed_comm_ns == 0.0 and t.hidden_comm_ns == 0.0


def test_free_communication_on_a_cpu_is_the_sum_of_the_ops():
    ops = _with_collectives(comm_ns=0.0, comm_host_ns=0.0)
    t = simulate_streams(ops, synchronous=True)
    assert t.total_ns == pytest.approx(simulate(_single_stream(ops), synchronous=True).total_ns)
    assert t.total_ns == pytest.approx(sum(d for _, _, d in _KERNELS))   # 129.5


def test_free_compute_is_the_sum_of_exposed_collectives():
    ops = [StreamOp(op.name, op.stream, 0.0 if op.stream == COMPUTE else op.device_ns, 0.0, op.deps)
           for op in _with_collectives(comm_ns=25.0)]
    t = simulate_streams(ops, DEFAULT_GPU_SLOWDOWN)
    # two all-reduces of 25 ns back to back on one group's stream, nothing to hide behind
    assert t.total_ns == pytest.approx(50.0)
    assert t.exposed_comm_ns == pytest.approx(50.0) and t.hidden_comm_ns == 0.0


def test_a_collective_waits_for_its_input_and_wait_holds_later_compute():
    t = simulate_streams(_with_collectives(comm_ns=100.0))
    span = {s.name: s for s in t.spans}
    assert span["ar0"].start_ns == span["k1"].end_ns
    assert span["wait0"].start_ns == span["ar0"].end_ns
    assert span["k4"].start_ns >= span["ar0"].end_ns
    assert span["k2"].start_ns == span["k1"].end_ns          # compute after the issue does not wait
    assert span["ar1"].start_ns >= max(span["ar0"].end_ns, span["k5"].end_ns)   # one stream per group


def test_overlap_hand_numbers():
    ops = [StreamOp("mm", COMPUTE, 10.0), StreamOp("ar", "comm:tp", 4.0, deps=("mm",)),
           StreamOp("relu", COMPUTE, 3.0), StreamOp("wait", COMPUTE, 0.0, deps=("ar",)), StreamOp("add", COMPUTE, 2.0)]
    off = simulate_streams(ops, NO_SLOWDOWN)
    # ar 10-14 hides behind relu 10-13; 1 ns exposed; add 14-16
    assert (off.total_ns, off.exposed_comm_ns, off.hidden_comm_ns) == (16.0, 1.0, 3.0)
    slow = simulate_streams(ops, OverlapSlowdown(2.0, "test"))
    # relu at half speed while ar runs: 2 ns of work by 14, the last 1 at full speed -> 15; add 15-17
    assert {s.name: s.end_ns for s in slow.spans}["relu"] == 15.0
    assert (slow.total_ns, slow.exposed_comm_ns, slow.hidden_comm_ns) == (17.0, 0.0, 4.0)


def test_no_slowdown_without_overlap():
    ops = [StreamOp("a", COMPUTE, 10.0), StreamOp("ar", "comm:dp", 5.0, deps=("a",)),
           StreamOp("w", COMPUTE, 0.0, deps=("ar",)), StreamOp("b", COMPUTE, 10.0)]
    t = simulate_streams(ops, OverlapSlowdown(1.9, "test"))
    assert t.total_ns == 25.0 and t.exposed_comm_ns == 5.0


def test_concurrent_groups_and_deterministic_ties():
    ops = [StreamOp("a", COMPUTE, 4.0), StreamOp("ag", "comm:dp_shard", 6.0, deps=("a",)),
           StreamOp("ar", "comm:tp", 6.0, deps=("a",)), StreamOp("w1", COMPUTE, 0.0, deps=("ag",)),
           StreamOp("w2", COMPUTE, 0.0, deps=("ar",))]
    first = simulate_streams(ops)
    assert first == simulate_streams(ops)
    span = {s.name: s for s in first.spans}
    assert span["ag"].start_ns == span["ar"].start_ns == 4.0      # different groups run at once
    assert first.total_ns == 10.0 and first.exposed_comm_ns == 6.0


def test_rendezvous_starts_together():
    ops = [StreamOp("a", COMPUTE, 3.0, rank=0), StreamOp("ar", "comm:dp", 2.0, deps=("a",), rank=0, rendezvous="ar"),
           StreamOp("a", COMPUTE, 7.0, rank=1), StreamOp("ar", "comm:dp", 2.0, deps=("a",), rank=1, rendezvous="ar")]
    t = simulate_streams(ops)
    # rank 0 launches at 3 and spins until rank 1 launches at 7 (NCCL's kernel waits for its peers), both end at 9
    assert [(s.rank, s.start_ns, s.end_ns) for s in t.spans if s.name == "ar"] == [(0, 3.0, 9.0), (1, 7.0, 9.0)]
    # rank 0: 4 ns waiting for rank 1 and 2 ns of transfer, all exposed
    assert t.rank(0).exposed_comm_ns == 6.0 and t.rank(1).exposed_comm_ns == 2.0


def test_cpu_collectives_run_beside_the_host_until_waited():
    ops = [StreamOp("a", COMPUTE, 10.0), StreamOp("ar", "comm:dp", 15.0, deps=("a",)),
           StreamOp("b", COMPUTE, 10.0), StreamOp("w", COMPUTE, 0.0, deps=("ar",), host_sync=True),
           StreamOp("c", COMPUTE, 1.0)]
    t = simulate_streams(ops, synchronous=True)
    # a 0-10; ar 10-25 on gloo's thread while b 10-20; the wait blocks until 25; c 25-26
    assert t.total_ns == 26.0 and t.exposed_comm_ns == 5.0 and t.hidden_comm_ns == 10.0


def test_bad_input():
    with pytest.raises(StreamError, match="not an earlier op"):
        simulate_streams([StreamOp("w", COMPUTE, 0.0, deps=("ar",)), StreamOp("ar", "comm:dp", 1.0)])
    with pytest.raises(StreamError, match="two ops named"):
        simulate_streams([StreamOp("a", COMPUTE, 1.0), StreamOp("a", COMPUTE, 1.0)])
    with pytest.raises(StreamError, match="below 1"):
        simulate_streams([StreamOp("a", COMPUTE, 1.0)], OverlapSlowdown(0.5, "x"))


# -- properties over random programs ----------------------------------------------------------------
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def _programs(draw, groups=("comm:dp", "comm:tp")):
    """Compute kernels in program order, collectives reading an earlier kernel, waits some ops later."""
    ops: list[StreamOp] = []
    kernels: list[str] = []
    unwaited: list[str] = []
    for i in range(draw(st.integers(1, 25))):
        ops.append(StreamOp(f"k{i}", COMPUTE, draw(st.sampled_from([0.0, 1.0, 7.5, 50.0])), draw(st.floats(0, 10, allow_subnormal=False))))
        kernels.append(f"k{i}")
        if draw(st.booleans()):
            dep = draw(st.sampled_from(kernels))
            name = f"c{i}"
            ops.append(StreamOp(name, draw(st.sampled_from(groups)), draw(st.floats(0, 80, allow_subnormal=False)), draw(st.floats(0, 5, allow_subnormal=False)),
                                deps=(dep,)))
            unwaited.append(name)
        if unwaited and draw(st.booleans()):
            ops.append(StreamOp(f"w{i}", COMPUTE, 0.0, 0.0, deps=(unwaited.pop(0),)))
    ops += [StreamOp(f"w_end{j}", COMPUTE, 0.0, 0.0, deps=(c,)) for j, c in enumerate(unwaited)]
    return ops


@settings(max_examples=80, deadline=None)
@given(_programs(), st.sampled_from([1.0, 1.189, 1.9]), st.booleans())
def test_property_dependencies_streams_and_accounting(ops, factor, synchronous):
    if synchronous:       # a CPU: waits block the host thread
        ops = [StreamOp(o.name, o.stream, o.device_ns, o.host_ns, o.deps, host_sync=o.name.startswith("w"))
               for o in ops]
    t = simulate_streams(ops, OverlapSlowdown(factor, "test"), synchronous)
    assert t == simulate_streams(ops, OverlapSlowdown(factor, "test"), synchronous)          # deterministic
    span = {s.name: s for s in t.spans}
    last_end: dict[str, float] = {}
    for op in ops:
        s = span[op.name]
        assert s.start_ns >= s.issue_end_ns - 1e-9
        assert all(s.start_ns >= span[d].end_ns - 1e-9 for d in op.deps)
        assert s.start_ns >= last_end.get(op.stream, 0.0) - 1e-9
        assert s.end_ns - s.start_ns >= op.device_ns - 1e-6                    # never faster than alone
        last_end[op.stream] = s.end_ns
    rank = t.ranks[0]
    assert rank.exposed_comm_ns + rank.hidden_comm_ns == pytest.approx(rank.comm_busy_ns)
    assert rank.hidden_comm_ns <= rank.compute_busy_ns + 1e-6


@settings(max_examples=60, deadline=None)
@given(_programs())
def test_property_free_communication_is_the_single_stream_schedule(ops):
    free = [StreamOp(o.name, o.stream, 0.0 if o.stream != COMPUTE else o.device_ns, o.host_ns, o.deps) for o in ops]
    t = simulate_streams(free, DEFAULT_GPU_SLOWDOWN)
    assert t.total_ns == pytest.approx(simulate(_single_stream(free)).total_ns)


@settings(max_examples=60, deadline=None)
@given(_programs(groups=("comm:dp",)))
def test_property_free_compute_is_the_exposed_communication(ops):
    free = [StreamOp(o.name, o.stream, 0.0 if o.stream == COMPUTE else o.device_ns, 0.0, o.deps) for o in ops]
    t = simulate_streams(free, DEFAULT_GPU_SLOWDOWN)
    comm = sum(o.device_ns for o in free if o.stream != COMPUTE)
    assert t.total_ns == pytest.approx(comm) and t.exposed_comm_ns == pytest.approx(comm)


def test_zero_length_ops_in_a_row_on_a_cpu():
    # two empty ops back to back after a real one: each is issued (and blocks the host) before it runs
    ops = [StreamOp("a", COMPUTE, 5.0), StreamOp("z1", COMPUTE, 0.0), StreamOp("z2", COMPUTE, 0.0),
           StreamOp("w", COMPUTE, 0.0, host_sync=True), StreamOp("b", COMPUTE, 1.0)]
    assert simulate_streams(ops, synchronous=True).total_ns == 6.0


def test_cpu_core_sharing():
    from boomfx.simulate.streams import cpu_core_sharing
    # 2 ranks x (compute + gloo thread) = 4 busy threads on 2 cores: compute at half speed; on 16 cores: none
    # 2 one-thread ranks and gloo threads busy 0.7 of a core: 3.4 cores' worth of work on 2 cores
    assert cpu_core_sharing(2, 2).factor == pytest.approx(1.7) and cpu_core_sharing(2, 16).factor == 1.0
    assert cpu_core_sharing(2, 2).comm_factor == cpu_core_sharing(2, 2).factor   # the collective shares too
    assert cpu_core_sharing(2, 2, comm_cpu_share=1.0).factor == 2.0
    # 2 ranks x (2 compute + 1) = 6 threads where the kernels were priced on 4 threads' worth of cores
    assert cpu_core_sharing(2, 2, threads_per_rank=2, comm_cpu_share=1.0).factor == 1.5
    assert cpu_core_sharing(4, 8).factor == 1.0 and cpu_core_sharing(8, 8, comm_cpu_share=0.5).factor == 1.5
    ops = [StreamOp("a", COMPUTE, 10.0), StreamOp("ar", "comm:dp", 4.0, deps=("a",)), StreamOp("b", COMPUTE, 10.0),
           StreamOp("w", COMPUTE, 0.0, deps=("ar",), host_sync=True)]
    # share 1: a 0-10; from 10 ar and b share: both at half speed, ar's 4 done at 18 (b has done 4 of its
    # 10), then b's last 6 alone: 24 = 10 + 10 + 4, the cores' work conserved
    timeline = simulate_streams(ops, cpu_core_sharing(2, 2, comm_cpu_share=1.0), synchronous=True)
    assert timeline.total_ns == 24.0
    assert {s.name: (s.start_ns, s.end_ns) for s in timeline.spans}["ar"] == (10.0, 18.0)
    # share 0.7: ar takes 4 x 1.7 = 6.8 (10-16.8), b does 4 of its 10 meanwhile, 6 more alone: 22.8
    assert simulate_streams(ops, cpu_core_sharing(2, 2), synchronous=True).total_ns == pytest.approx(22.8)
    for bad in ((0, 2), (2, 2, 1, 1.5)):
        with pytest.raises(StreamError):
            cpu_core_sharing(*bad)


def test_more_compute_threads_than_cores_slow_every_op():
    """4 one-thread ranks on 2 cores: each compute thread has half a core, collective or not (processor
    sharing; ``base``), and the overlap factor comes on top. Measured on this machine's 4-rank gloo steps:
    DDP and FSDP2 predictions -34..-36% without it, -10..-13% with it (docs/design.md)."""
    from boomfx.simulate.streams import OverlapSlowdown, cpu_core_sharing
    assert cpu_core_sharing(2, 2).base == 1.0 and cpu_core_sharing(4, 8).base == 1.0
    assert cpu_core_sharing(4, 2).base == 2.0 and cpu_core_sharing(4, 2, threads_per_rank=2).base == 4.0
    # the overlap factor stays relative to the shared-out cores: 4 x 1.7 busy threads over 4 threads' worth
    assert cpu_core_sharing(4, 2).factor == pytest.approx(1.7)
    ops = [StreamOp("a", COMPUTE, 10.0), StreamOp("ar", "comm:dp", 4.0, deps=("a",)), StreamOp("b", COMPUTE, 10.0),
           StreamOp("w", COMPUTE, 0.0, deps=("ar",), host_sync=True)]
    # base 2, overlap 2: a 0-20; from 20 ar and b each at 1/4 speed: ar's 4 done at 36 (b did 4 of 10),
    # b's last 6 at half speed: 48, twice the 24 of two ranks on two cores
    timeline = simulate_streams(ops, OverlapSlowdown(2.0, "test", comm_factor=2.0, base=2.0), synchronous=True)
    assert timeline.total_ns == 48.0
    assert {s.name: (s.start_ns, s.end_ns) for s in timeline.spans}["ar"] == (20.0, 36.0)
    with pytest.raises(StreamError):
        simulate_streams(ops, OverlapSlowdown(1.0, "test", base=0.5))


def test_a_gloo_collective_waiting_for_its_peer_leaves_compute_its_core():
    from boomfx.simulate.streams import cpu_core_sharing
    # rank 1 launches its all-reduce at 2, rank 0 at 10: rank 1's gloo thread sleeps until 10, so its
    # compute b (2-12) runs at full speed until the transfer starts at 10, then both share the cores
    ops = [StreamOp("a", COMPUTE, 10.0, rank=0), StreamOp("ar", "comm:dp", 4.0, deps=("a",), rank=0, rendezvous="x"),
           StreamOp("w", COMPUTE, 0.0, deps=("ar",), host_sync=True, rank=0),
           StreamOp("a", COMPUTE, 2.0, rank=1), StreamOp("ar", "comm:dp", 4.0, deps=("a",), rank=1, rendezvous="x"),
           StreamOp("b", COMPUTE, 10.0, rank=1), StreamOp("w", COMPUTE, 0.0, deps=("ar",), host_sync=True, rank=1)]
    timeline = simulate_streams(ops, cpu_core_sharing(2, 2, comm_cpu_share=1.0), synchronous=True)
    spans = {(s.rank, s.name): (s.start_ns, s.end_ns) for s in timeline.spans}
    # rank 1: b did 8 of 10 by 10; then ar and b at half speed: b's last 2 done at 14, ar's 4: 2 by 14, 2 more: 16
    assert spans[(1, "b")] == (2.0, 14.0) and spans[(1, "ar")][1] == 16.0
    # rank 0: nothing runs beside its collective: 10-14
    assert spans[(0, "ar")][1] == 14.0
