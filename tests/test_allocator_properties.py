"""Property tests: invariants of the allocator model over random alloc/free sequences (hypothesis)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from boomfx.memory.config import AllocatorConfig, MiB
from boomfx.memory.allocator import CachingAllocator, SimulatedOutOfMemory

CONFIGS = ["", "max_split_size_mb:24", "roundup_power2_divisions:4", "expandable_segments:True",
           "max_split_size_mb:40,roundup_power2_divisions:[1:2,64:8,>:1]"]

sizes = st.one_of(st.integers(0, 4096), st.integers(4096, 1 * MiB + 4096), st.integers(1 * MiB, 64 * MiB))
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1), st.integers(0, 10_000)),
               min_size=1, max_size=80)


def check_invariants(a: CachingAllocator, live: dict[int, int]) -> None:
    segs = a.segments()
    reserved = allocated = 0
    prev_end = -1
    for seg in segs:
        assert seg.address >= prev_end, "segments overlap"
        prev_end = seg.address + seg.total_size
        cursor = seg.address
        for b in seg.blocks:
            assert b.address == cursor, "blocks of a segment must tile it without gaps or overlaps"
            assert b.size > 0
            cursor += b.size
            if b.state == "active_allocated":
                allocated += b.size
                assert b.requested_size <= b.size
        assert cursor == seg.address + seg.total_size, "sum of blocks == segment size"
        reserved += seg.total_size
    assert reserved == a.memory_reserved() == a.device.used_bytes
    assert allocated == a.memory_allocated() <= a.memory_reserved()
    active = {b.address for s in segs for b in s.blocks if b.state == "active_allocated"}
    assert active == {h for h in live.values() if h}


@settings(max_examples=150, deadline=None)
@given(conf=st.sampled_from(CONFIGS), ops=ops, capacity_mib=st.integers(64, 1024))
def test_random_sequences_keep_accounting_exact(conf, ops, capacity_mib):
    a = CachingAllocator(AllocatorConfig.parse(conf), capacity_mib * MiB)
    live: dict[int, int] = {}
    next_id = 0
    for is_alloc, nbytes, stream, pick in ops:
        if is_alloc or not live:
            try:
                live[next_id] = a.malloc(nbytes, stream=stream)
            except SimulatedOutOfMemory:
                pass
            next_id += 1
        else:
            tid = sorted(live)[pick % len(live)]
            a.free(live.pop(tid))
        check_invariants(a, live)
    for tid in list(live):
        a.free(live.pop(tid))
    check_invariants(a, live)
    for seg in a.segments():  # everything free: each segment (or mapped range) is one merged free block
        assert [b.state for b in seg.blocks] == ["inactive"]
    stats = a.memory_stats()
    assert stats["allocated_bytes.all.current"] == stats["active_bytes.all.current"] == 0
    assert stats["requested_bytes.all.current"] == 0
    a.empty_cache()
    assert a.memory_reserved() == 0 and a.segments() == [] and a.device.used_bytes == 0
    assert a.memory_stats()["inactive_split_bytes.all.current"] == 0
