"""Hand-written allocator sequences; each expected number follows from a rule in CUDACachingAllocator.cpp."""
from __future__ import annotations

import random

import pytest

from boomfx.memory.config import AllocatorConfig, MiB
from boomfx.memory.allocator import CachingAllocator, SimulatedOutOfMemory
from boomfx.memory.replay import AllocEvent, fits, replay

GiB = 1024 * MiB


def make(conf: str = "", capacity_bytes: int = 8 * GiB, **overrides) -> CachingAllocator:
    return CachingAllocator(AllocatorConfig.parse(conf, **overrides), capacity_bytes)


def test_3mib_request_reserves_20mib_segment():
    """get_allocation_size: kSmallSize < size < kMinLargeAlloc -> kLargeBuffer (20 MiB)."""
    a = make()
    a.malloc(3 * MiB)
    assert a.memory_reserved() == 20 * MiB
    assert a.memory_allocated() == 3 * MiB  # split: remainder 17 MiB > kSmallSize


def test_600_bytes_reserve_a_2mib_small_segment():
    """get_pool: size <= kSmallSize -> small pool; get_allocation_size -> kSmallBuffer (2 MiB)."""
    a = make()
    a.malloc(600)
    assert a.memory_reserved() == 2 * MiB
    assert a.memory_allocated() == 1024  # round_size: ceil(600 / 512) * 512
    assert a.segments()[0].segment_type == "small"


@pytest.mark.parametrize("nbytes,rounded", [(1, 512), (511, 512), (512, 512), (513, 1024), (1536, 1536)])
def test_round_size_to_512(nbytes, rounded):
    """round_size: size < kMinBlockSize -> 512, else the next multiple of 512."""
    a = make()
    a.malloc(nbytes)
    assert a.memory_allocated() == rounded


def test_small_large_pool_boundary():
    """get_pool: exactly kSmallSize (1 MiB) is small; 1 MiB + 1 B rounds to 1 MiB + 512 and is large."""
    a = make()
    a.malloc(1 * MiB)
    assert a.memory_reserved() == 2 * MiB
    a.malloc(1 * MiB + 1)
    assert a.memory_reserved() == 2 * MiB + 20 * MiB


def test_min_large_alloc_boundary():
    """get_allocation_size: size < 10 MiB -> 20 MiB; size >= 10 MiB -> rounded up to 2 MiB (kRoundLarge)."""
    a = make()
    a.malloc(10 * MiB - 512)
    assert a.memory_reserved() == 20 * MiB
    b = make()
    b.malloc(10 * MiB)  # own segment of exactly 10 MiB
    assert b.memory_reserved() == 10 * MiB
    c = make()
    c.malloc(11 * MiB + 1)
    assert c.memory_reserved() == 12 * MiB  # ceil((11 MiB + 512) / 2 MiB) * 2 MiB


def test_large_split_threshold_is_strictly_above_1mib():
    """should_split (large pool): split only when remaining > kSmallSize; 1 MiB exactly stays attached."""
    a = make()
    a.malloc(19 * MiB)  # remainder 20 - 19 = 1 MiB, not > 1 MiB: whole block handed out
    assert a.memory_allocated() == 20 * MiB
    b = make()
    b.malloc(19 * MiB - 512)  # remainder 1 MiB + 512 > 1 MiB: split
    assert b.memory_allocated() == 19 * MiB - 512
    assert len(b.segments()[0].blocks) == 2


def test_small_split_threshold_at_512_bytes():
    """should_split (small pool): remaining >= kMinBlockSize splits, so a 512 B tail is reused."""
    a = make()
    a.malloc(1 * MiB)            # 2 MiB segment, remainder 1 MiB
    a.malloc(1 * MiB - 512)      # remainder exactly 512 B >= 512: split
    a.malloc(512)                # served by that 512 B block
    assert a.memory_reserved() == 2 * MiB
    assert a.memory_allocated() == 2 * MiB
    assert [b.size for b in a.segments()[0].blocks] == [1 * MiB, 1 * MiB - 512, 512]


def test_best_fit_prefers_smallest_block_on_same_stream():
    """get_free_block: lower_bound on (stream, size, address) picks the smallest fitting block."""
    a = make()
    big, small = a.malloc(40 * MiB), a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    h = a.malloc(11 * MiB)
    assert h == small  # the 12 MiB segment, not the 40 MiB one
    assert a.memory_reserved() == 52 * MiB


def test_blocks_are_not_shared_across_streams():
    """get_free_block: the search key includes the stream, so a free block on stream 1 is not reused."""
    a = make()
    a.free(a.malloc(3 * MiB, stream=1))
    a.malloc(3 * MiB, stream=0)
    assert a.memory_reserved() == 40 * MiB


def test_free_merges_neighbours_into_one_block():
    """free_block / try_merge_blocks: freed blocks merge with free neighbours of the same segment."""
    a = make()
    x, y, z = a.malloc(3 * MiB), a.malloc(3 * MiB), a.malloc(3 * MiB)
    a.free(x)
    a.free(z)
    assert [b.state for b in a.segments()[0].blocks] == ["inactive", "active_allocated", "inactive"]
    assert a.memory_stats()["inactive_split.all.current"] == 2
    a.free(y)
    seg = a.segments()[0]
    assert [(b.size, b.state) for b in seg.blocks] == [(20 * MiB, "inactive")]
    assert a.memory_stats()["inactive_split_bytes.all.current"] == 0


def test_max_split_size_oversize_block_not_split_and_window():
    """get_free_block with max_split_size_mb:20: an oversize block (>= max_split) is not given to small
    requests, and serves a large request only if block < request + max_non_split_rounding (20 MiB)."""
    a = make("max_split_size_mb:20")
    a.free(a.malloc(60 * MiB))
    a.malloc(40 * MiB)          # 60 >= 40 + 20: refused, new 40 MiB segment
    assert a.memory_reserved() == 100 * MiB
    b = make("max_split_size_mb:20")
    b.free(b.malloc(60 * MiB))
    b.malloc(40 * MiB + 512)    # rounded 40 MiB + 512; 60 < 60 MiB + 512: reused whole (never split)
    assert b.memory_reserved() == 60 * MiB
    assert b.memory_allocated() == 60 * MiB
    c = make("max_split_size_mb:20")
    c.free(c.malloc(30 * MiB))
    c.malloc(5 * MiB)           # request < max_split, block >= max_split: refused
    assert c.memory_reserved() == 50 * MiB
    # both the 30 MiB and the new 20 MiB (kLargeBuffer) segment are >= max_split_size: oversize
    assert c.memory_stats()["oversize_segments.current"] == 2


def test_roundup_power2_divisions_rounds_to_division():
    """round_size with roundup_power2_divisions:4: 5 MiB + 1 B lies in [4, 8) MiB with 1 MiB steps -> 6 MiB."""
    a = make("roundup_power2_divisions:4")
    a.malloc(5 * MiB + 1)
    assert a.memory_allocated() == 6 * MiB
    b = make("roundup_power2_divisions:4")
    b.malloc(1200)  # 1200 <= kMinBlockSize * 4: plain 512 B rounding -> 1536
    assert b.memory_allocated() == 1536


def test_expandable_segments_grow_in_20mib_pages():
    """Expandable segments: one segment per stream grows by mapping 20 MiB pages (large pool);
    3 x 30 MiB maps ceil(30/20)=2, then 1 (10 MiB tail reused + 20), then 2 pages = 100 MiB."""
    a = make("expandable_segments:True")
    hs = [a.malloc(30 * MiB) for _ in range(3)]
    assert a.memory_reserved() == 100 * MiB
    assert len(a.segments()) == 1 and a.segments()[0].is_expandable
    for h in hs:
        a.free(h)
    a.empty_cache()  # release_blocks -> unmap_block: every free page goes back
    assert a.memory_reserved() == 0 and a.segments() == []


def test_expandable_small_pool_pages_are_2mib():
    """Expandable segments use 2 MiB pages for the small pool (kSmallBuffer)."""
    a = make("expandable_segments:True")
    a.malloc(600)
    assert a.memory_reserved() == 2 * MiB


def test_oom_retry_frees_cached_segments_then_succeeds():
    """malloc: alloc_block fails -> release_cached_blocks (all unsplit cached segments) -> alloc_block
    with isRetry, which counts num_alloc_retries."""
    a = make(capacity_bytes=100 * MiB)
    a.free(a.malloc(60 * MiB, stream=1))
    a.malloc(50 * MiB, stream=0)  # 60 + 50 > 100: the stream-1 cache is released, retry succeeds
    stats = a.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 0
    assert a.memory_reserved() == 50 * MiB


def test_oom_path_releases_one_oversize_block_first():
    """release_available_cached_blocks runs before release_cached_blocks: with max_split_size set it
    frees one cached oversize block that fits and retries without counting a retry."""
    a = make("max_split_size_mb:20", capacity_bytes=80 * MiB)
    a.free(a.malloc(60 * MiB))
    a.malloc(30 * MiB)  # 60 >= 30 + 20: not reusable; cudaMalloc(30) fails; the 60 MiB block is freed
    stats = a.memory_stats()
    assert stats["num_alloc_retries"] == 0
    assert a.memory_reserved() == 30 * MiB


def test_real_oom_is_counted_and_reported():
    """malloc: when the last retry fails, num_ooms += 1 and OutOfMemoryError carries the sizes."""
    a = make(capacity_bytes=50 * MiB)
    a.malloc(40 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as info:
        a.malloc(20 * MiB, label="mm_7")
    e = info.value
    assert (e.requested_bytes, e.alloc_bytes, e.label) == (20 * MiB, 20 * MiB, "mm_7")
    assert (e.reserved_bytes, e.allocated_bytes, e.device_free_bytes) == (40 * MiB, 40 * MiB, 10 * MiB)
    stats = a.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1


def test_memory_fraction_limits_reserved():
    """alloc_block: with a per-process fraction, total + alloc_size > allowed fails before cudaMalloc."""
    a = make(capacity_bytes=100 * MiB, memory_fraction=0.5)
    with pytest.raises(SimulatedOutOfMemory):
        a.malloc(60 * MiB)


def test_garbage_collection_frees_oldest_unsplit_blocks():
    """garbage_collect_cached_blocks: above threshold * allowed, free unsplit large blocks whose age
    (get_free_block calls since cached) >= the mean age. Ages 2 and 1, mean 1.5: only the older goes."""
    a = make("garbage_collection_threshold:0.5", capacity_bytes=100 * MiB, memory_fraction=1.0)
    a.free(a.malloc(30 * MiB, stream=0))
    a.free(a.malloc(30 * MiB, stream=1))
    a.malloc(12 * MiB, stream=2)  # 60 MiB > 50 MiB threshold: GC releases the stream-0 block
    assert a.memory_reserved() == 30 * MiB + 12 * MiB
    assert {s.stream for s in a.segments()} == {1, 2}


def test_largest_free_block_and_stats_peaks():
    """cacheInfo returns the largest cached block; peaks follow increase_stat."""
    a = make()
    h = a.malloc(3 * MiB)
    assert a.largest_free_block() == 17 * MiB
    a.free(h)
    assert a.largest_free_block() == 20 * MiB
    stats = a.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 3 * MiB and stats["allocated_bytes.all.current"] == 0
    assert stats["reserved_bytes.large_pool.current"] == 20 * MiB and stats["segment.all.current"] == 1


def test_bad_calls_raise():
    a = make()
    with pytest.raises(ValueError):
        a.malloc(-1)
    with pytest.raises(ValueError):
        a.free(12345)
    assert a.malloc(0) == 0
    a.free(0)


def test_replay_reports_peaks_fragmentation_and_oom():
    """replay: peak reserved 40 MiB after two 3 MiB allocations on two streams; the OOM is reported."""
    ev = [AllocEvent("alloc", 1, 3 * MiB, label="a"), AllocEvent("alloc", 2, 3 * MiB, stream=1, label="b"),
          AllocEvent("free", 1, 3 * MiB), AllocEvent("alloc", 3, 1 * GiB, label="huge")]
    r = replay(ev, AllocatorConfig(), capacity_bytes=512 * MiB, resident_bytes_events={0: 100 * MiB})
    assert r.peak_reserved_bytes == 40 * MiB and r.peak_allocated_bytes == 6 * MiB
    assert r.peak_reserved_event_index == 1
    assert r.fragmentation_at_peak_bytes == 34 * MiB and r.largest_free_block_at_peak_bytes == 17 * MiB
    assert r.num_segments_at_peak == 2
    assert r.oom is not None and r.oom.event_index == 3 and r.oom.label == "huge"
    # after releasing the free stream-0 segment, 512 - 100 - 20 = 392 MiB are free for a 1 GiB request
    assert r.oom.margin_bytes == 392 * MiB - 1 * GiB
    assert not fits(ev, AllocatorConfig(), 512 * MiB)


def test_replay_expandable_counts_mapped_ranges():
    ev = [AllocEvent("alloc", i, 30 * MiB) for i in range(3)]
    r = replay(ev, AllocatorConfig.parse("expandable_segments:True"), capacity_bytes=8 * GiB)
    assert r.peak_reserved_bytes == 100 * MiB and r.num_segments_at_peak == 1


def test_replay_100k_random_events_accounts_every_byte():
    """A long random alloc/free sequence replays without OOM and ends with allocated == live bytes.
    (Its speed is measured by benchmarks/micro_speed.py, not asserted here.)"""
    rng = random.Random(0)
    events, live, next_id = [], [], 0
    while len(events) < 100_000:
        if live and (len(live) > 200 or rng.random() < 0.45):
            tid = live.pop(rng.randrange(len(live)))
            events.append(AllocEvent("free", tid, 0))
        else:
            size = rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 64 << 20)])
            events.append(AllocEvent("alloc", next_id, size))
            live.append(next_id)
            next_id += 1
    r = replay(events, AllocatorConfig(), capacity_bytes=80 * GiB)
    assert r.oom is None
    requested = {e.tensor_id: e.nbytes for e in events if e.kind == "alloc"}
    rounded = {t: AllocatorConfig().round_size(n) for t, n in requested.items()}
    # requested bytes are exact; allocated counts whole blocks (an unsplit remainder stays with its block)
    assert r.stats["requested_bytes.all.current"] == sum(requested[t] for t in live)
    assert r.allocator.memory_allocated() >= sum(rounded[t] for t in live)
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes
