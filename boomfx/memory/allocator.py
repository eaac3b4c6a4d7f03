"""A faithful model of PyTorch's CUDA caching allocator (DeviceCachingAllocator), on a fake device.

Why: reserved memory, fragmentation and out-of-memory depend on the allocator's caching rules, not on the
sum of live tensors. This module replays those rules; all numbers come from ``AllocatorConfig``.

Layout (tinygrad-style split): ``allocator_state.AllocatorStats`` does the accounting (the counters of ``torch.cuda.memory_stats``),
``FakeDevice`` stands in for cudaMalloc/cuMemCreate, and the ``_``-prefixed methods of
``CachingAllocator`` hold the policy, each named after the C++ function it mirrors in
``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch @ 001074d25084fdb87a799823e395a50f5ec044d3;
``max_non_split_rounding`` and the expandable-segment skips in ``release_available_cached_blocks`` /
``garbage_collect_cached_blocks`` from the newer templated ``CachingDeviceAllocatorImpl`` in c10/core).

Example:
    >>> from boomfx.memory.config import AllocatorConfig, MiB
    >>> a = CachingAllocator(AllocatorConfig(), capacity_bytes=1024 * MiB)
    >>> h = a.malloc(3 * MiB)
    >>> a.memory_reserved() // MiB, a.memory_allocated() // MiB
    (20, 3)

Known limitations:
    * One device, no CUDA graphs / private pools, no record_stream (blocks never wait on events, so
      "active" equals "allocated"), no free-memory callbacks.
    * Addresses come from a bump pointer that never reuses freed ranges, so among equal-size free blocks
      the tie (broken by address) may differ from a real run.
    * Expandable-segment pages are charged to the device one call at a time (all or nothing), as
      ExpandableSegment::map releases the pages of a failed call.
"""
from __future__ import annotations

import bisect
from typing import Optional

from boomfx.memory.config import AllocatorConfig
from boomfx.memory.state import (AllocatorStats, Block, BlockInfo, BlockPool, ExpandableSegment, FakeDevice,
                                    Frames, SegmentInfo, frames_to_dicts)

__all__ = ["CachingAllocator", "SimulatedOutOfMemory", "BlockInfo", "SegmentInfo", "frames_to_dicts"]
_INF = float("inf")


class SimulatedOutOfMemory(RuntimeError):
    """Raised by ``malloc`` where PyTorch would raise torch.OutOfMemoryError."""

    def __init__(self, requested_bytes: int, alloc_bytes: int, reserved_bytes: int, allocated_bytes: int,
                 device_free_bytes: int, label: str) -> None:
        self.requested_bytes = requested_bytes
        self.alloc_bytes = alloc_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        self.device_free_bytes = device_free_bytes
        self.label = label
        super().__init__(f"Simulated CUDA out of memory: tried to allocate {alloc_bytes} bytes for {label!r} "
                         f"({requested_bytes} requested); {allocated_bytes} allocated, {reserved_bytes} reserved, "
                         f"{device_free_bytes} free on the device.")


# ----------------------------------------------------------------------------------------------------------
# The allocator: public API (validate, round, account) then policy
# ----------------------------------------------------------------------------------------------------------
class CachingAllocator:
    """One device's caching allocator. ``malloc`` returns a handle (the block address); ``free`` takes it."""

    def __init__(self, config: AllocatorConfig, capacity_bytes: int, record_trace: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}.")
        self.config = config
        self.device = FakeDevice(capacity_bytes)
        self.stats = AllocatorStats()
        self.small_pool, self.large_pool = BlockPool(True), BlockPool(False)
        self.active: dict[int, Block] = {}
        self.total_reserved_bytes = 0  # total_allocated_memory
        self.record_trace = record_trace
        self.trace: list[dict] = []
        self._streams: set[int] = set()
        self._fraction_limit = (int(config.memory_fraction * capacity_bytes)
                                if config.memory_fraction is not None else None)
        self._gc_on = self._fraction_limit is not None and config.garbage_collection_threshold > 0.0

    # ----- public API -----
    def malloc(self, nbytes: int, stream: int = 0, label: str = "", frames: Frames = ()) -> int:
        """DeviceCachingAllocator::malloc. Returns a handle; raises SimulatedOutOfMemory."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes) for {label!r}.")
        if nbytes == 0:
            return 0  # NativeCachingAllocator::allocate returns nullptr without calling malloc
        cfg = self.config
        size = cfg.round_size(nbytes)
        pool = self.small_pool if cfg.is_small(size) else self.large_pool
        alloc_bytes = cfg.allocation_size(size)
        self._streams.add(stream)
        block = self._get_free_block(pool, stream, size)
        if block is None:
            if self._gc_on:
                self._garbage_collect_cached_blocks()
            block = (self._alloc_block(pool, stream, size, alloc_bytes, False, label, frames)
                     or (self._release_available_cached_blocks(pool, stream, size)
                         and self._alloc_block(pool, stream, size, alloc_bytes, False, label, frames))
                     or (self._release_cached_blocks()
                         and self._alloc_block(pool, stream, size, alloc_bytes, True, label, frames)))
        if not block:
            free_bytes = self.device.free_bytes()
            self._record("oom", None, nbytes, stream, label, frames, device_free=free_bytes)
            self.stats.counters["num_ooms"] += 1
            raise SimulatedOutOfMemory(nbytes, alloc_bytes, self.stats.current("reserved_bytes"),
                                       self.stats.current("allocated_bytes"), free_bytes, label)
        return self._alloc_found_block(block, pool, size, nbytes, label, frames)

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free: return the block to its pool, merging free neighbours."""
        if handle == 0:
            return
        block = self.active.pop(handle, None)
        if block is None:
            raise ValueError(f"free of unknown or already freed handle {handle:#x}.")
        block.allocated = False
        self.stats.sub("allocation", block.small, 1)
        self.stats.sub("allocated_bytes", block.small, block.size)
        self._record("free_requested", block.addr, block.requested, block.stream, block.label, block.frames)
        if block.size >= self.config.max_split_size_bytes:
            self.stats.oversize_allocations.sub(1)
        self._free_block(block)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release every unsplit cached segment and unmap free pages."""
        self._release_cached_blocks()

    def memory_allocated(self) -> int:
        return self.stats.current("allocated_bytes")

    def memory_reserved(self) -> int:
        return self.stats.current("reserved_bytes")

    def memory_stats(self) -> dict[str, int]:
        return self.stats.as_dict()

    def set_outside_bytes(self, nbytes: int) -> None:
        """Memory held outside the allocator (CUDA context, NCCL...) that cudaMalloc cannot use."""
        self.device.outside_bytes = nbytes

    def largest_free_block(self) -> int:
        """cacheInfo: the largest cached free block over both pools and all streams."""
        best = 0
        for pool in (self.small_pool, self.large_pool):
            for s in self._streams:
                i = bisect.bisect_right(pool.keys, (s, _INF, _INF)) - 1
                if i >= 0 and pool.keys[i][0] == s:
                    best = max(best, pool.keys[i][1])
        return best

    def segments(self) -> list[SegmentInfo]:
        """DeviceCachingAllocator::snapshot: one entry per segment (per mapped range if expandable)."""
        blocks = list(self.active.values())
        for pool in (self.small_pool, self.large_pool):
            blocks.extend(pool.by_key.values())
        out = []
        for head in blocks:
            if head.prev is not None and head.prev.mapped:
                continue
            infos, b = [], head
            while b is not None and b.mapped:
                state = "active_allocated" if b.allocated else "inactive"
                infos.append(BlockInfo(b.addr, b.size, b.requested if b.allocated else 0, state,
                                       b.label if b.allocated else "", b.frames if b.allocated else ()))
                b = b.next
            out.append(SegmentInfo(
                address=head.addr, total_size=sum(i.size for i in infos), stream=head.stream,
                segment_type="small" if head.small else "large",
                allocated_size=sum(i.size for i in infos if i.state == "active_allocated"),
                requested_size=sum(i.requested_size for i in infos), is_expandable=head.seg is not None,
                label=head.seg_label, frames=head.seg_frames, blocks=tuple(infos)))
        return sorted(out, key=lambda s: s.address)

    # ----- policy -----
    def _get_free_block(self, pool: BlockPool, stream: int, size: int) -> Optional[Block]:
        """get_free_block: best fit on the same stream, with the oversize-block rules."""
        cfg = self.config
        if self._gc_on:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream, size, 0))
        if i == len(keys) or keys[i][0] != stream:
            return None
        b = pool.by_key[keys[i]]
        if b.seg is not None:
            if cfg.expandable_segments:
                # best fit counts the unmapped tail an expandable block could grow into
                while (b.seg is not None and i + 1 < len(keys) and keys[i + 1][0] == stream
                       and _expandable_size(pool.by_key[keys[i + 1]]) < _expandable_size(b)):
                    i += 1
                    b = pool.by_key[keys[i]]
            else:
                i += 1
                while i < len(keys) and keys[i][0] == stream and pool.by_key[keys[i]].seg is not None:
                    i += 1
                if i == len(keys) or keys[i][0] != stream:
                    return None
                b = pool.by_key[keys[i]]
        max_split = cfg.max_split_size_bytes
        if size < max_split and b.size >= max_split:
            return None  # do not hand an oversize block to a request that could split a smaller one
        if size >= max_split and b.size >= size + cfg.max_non_split_rounding_bytes:
            return None  # oversize blocks serve only requests within max_non_split_rounding of their size
        pool.remove(b)
        return b

    def _should_split(self, block: Block, size: int) -> bool:
        """should_split: remainder thresholds differ for small and large pools."""
        cfg = self.config
        remaining = block.size - size
        if block.small or cfg.expandable_segments:
            return remaining >= cfg.split_remainder_small_min_bytes
        return size < cfg.max_split_size_bytes and remaining > cfg.split_remainder_large_above_bytes

    def _alloc_found_block(self, block: Block, pool: BlockPool, size: int, orig: int, label: str,
                           frames: Frames) -> int:
        """alloc_found_block: split off the remainder if should_split, then account the allocation."""
        st = self.stats
        if self._should_split(block, size):
            already_split = block.is_split()
            rest = block
            block = Block(rest.addr, size, rest.stream, rest.small, rest.seg)
            block.prev, block.next = rest.prev, rest
            if rest.prev is not None:
                rest.prev.next = block
            else:
                block.seg_label, block.seg_frames = rest.seg_label, rest.seg_frames
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
            if rest.seg is None:
                if already_split:
                    st.sub("inactive_split_bytes", block.small, block.size)
                else:
                    st.add("inactive_split_bytes", block.small, rest.size)
                    st.add("inactive_split", block.small, 1)
        elif block.is_split() and block.seg is None:
            st.sub("inactive_split_bytes", block.small, block.size)
            st.sub("inactive_split", block.small, 1)
        block.allocated = True
        block.requested = orig
        block.label, block.frames = label, frames
        self._record("alloc", block.addr, orig, block.stream, label, frames)
        self.active[block.addr] = block
        for name, n in (("allocation", 1), ("allocated_bytes", block.size), ("active", 1),
                        ("active_bytes", block.size), ("requested_bytes", orig)):
            st.add(name, block.small, n)
        if block.size >= self.config.max_split_size_bytes:
            st.oversize_allocations.add(1)
        return block.addr

    def _free_block(self, block: Block) -> None:
        """free_block: merge with free neighbours of the same segment and cache the result."""
        st = self.stats
        pool = self.small_pool if block.small else self.large_pool
        self._record("free_completed", block.addr, block.requested, block.stream, block.label, block.frames)
        orig_size, requested = block.size, block.requested
        net_blocks = net_bytes = 0
        for cand in (block.prev, block.next):
            merged = self._try_merge_blocks(block, cand, pool)
            if merged:
                net_blocks -= 1
                net_bytes -= merged
        block.label, block.frames, block.requested = "", (), 0
        pool.insert(block)
        if block.is_split():
            net_blocks += 1
            net_bytes += block.size
        if block.seg is None:
            for name, n in (("inactive_split", net_blocks), ("inactive_split_bytes", net_bytes)):
                if n > 0:
                    st.add(name, block.small, n)
                elif n < 0:
                    st.sub(name, block.small, -n)
        st.sub("active", block.small, 1)
        st.sub("active_bytes", block.small, orig_size)
        st.sub("requested_bytes", block.small, requested)

    def _try_merge_blocks(self, dst: Block, src: Optional[Block], pool: BlockPool) -> int:
        """try_merge_blocks: absorb a free neighbour with the same mapped state; returns its size."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            dst.seg_label, dst.seg_frames = src.seg_label, src.seg_frames
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _alloc_block(self, pool: BlockPool, stream: int, size: int, alloc_bytes: int, is_retry: bool,
                     label: str, frames: Frames) -> Optional[Block]:
        """alloc_block: a new segment from the device (or pages of an expandable segment)."""
        if is_retry:
            self.stats.counters["num_alloc_retries"] += 1
        if self._fraction_limit is not None and self.total_reserved_bytes + alloc_bytes > self._fraction_limit:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size, label, frames)
        if not self.device.commit(alloc_bytes):
            return None
        self.total_reserved_bytes += alloc_bytes
        block = Block(self.device.reserve_address(alloc_bytes), alloc_bytes, stream, pool.small, None)
        block.seg_label, block.seg_frames = label, frames
        self.stats.add("segment", pool.small, 1)
        self.stats.add("reserved_bytes", pool.small, alloc_bytes)
        if alloc_bytes >= self.config.max_split_size_bytes:
            self.stats.oversize_segments.add(1)
        self.stats.counters["num_device_alloc"] += 1
        self._record("segment_alloc", block.addr, alloc_bytes, stream, label, frames)
        return block

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        """release_available_cached_blocks: free one fitting oversize block, else the largest ones."""
        cfg = self.config
        if cfg.max_split_is_unlimited:
            return False
        key_size = max(size, cfg.max_split_size_bytes)
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream, key_size, 0))
        if i < len(keys) and keys[i][0] == stream and _releasable(pool.by_key[keys[i]]):
            self._release_block(pool.by_key[keys[i]], pool)
            return True
        if i == 0:
            return False
        released = 0
        i -= 1
        while released < key_size and keys[i][1] >= cfg.max_split_size_bytes and keys[i][0] == stream:
            cur = pool.by_key[keys[i]]
            first = i == 0
            i -= 1
            if _releasable(cur):  # NB: the C++ skips expandable blocks; split ones are skipped here too
                released += cur.size
                self._release_block(cur, pool)
            if first:
                break
        return released >= key_size

    def _release_cached_blocks(self) -> bool:
        """release_cached_blocks: cudaFree every unsplit cached segment, unmap free expandable pages."""
        self.stats.counters["num_sync_all_streams"] += 1
        for pool in (self.large_pool, self.small_pool):
            to_unmap = []
            for key in list(pool.keys):
                b = pool.by_key[key]
                if b.seg is not None:
                    to_unmap.append(b)
                elif not b.is_split():
                    self._release_block(b, pool)
            for b in to_unmap:
                self._unmap_block(b, pool)
                if not b.mapped and not b.is_split():
                    pool.remove_unmapped(b)  # release_expandable_segment: the whole range is unmapped
        return True

    def _release_block(self, block: Block, pool: BlockPool) -> None:
        """release_block: cudaFree one whole cached segment."""
        self.stats.counters["num_device_free"] += 1
        self._record("segment_free", block.addr, block.size, block.stream, block.seg_label, block.seg_frames)
        self.device.release(block.size)
        self.total_reserved_bytes -= block.size
        self.stats.sub("segment", pool.small, 1)
        self.stats.sub("reserved_bytes", pool.small, block.size)
        if block.size >= self.config.max_split_size_bytes:
            self.stats.oversize_segments.sub(1)
        pool.remove(block)

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: free unsplit large cached blocks older than the mean age."""
        cfg = self.config
        assert self._fraction_limit is not None
        threshold = int(cfg.garbage_collection_threshold * self._fraction_limit)
        if self.total_reserved_bytes <= threshold:
            return
        target = self.total_reserved_bytes - threshold
        pool = self.large_pool
        freeable = [b for b in (pool.by_key[k] for k in pool.keys) if not b.is_split()]
        total_age = sum(pool.gc_calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in [pool.by_key[k] for k in pool.keys]:
                age = pool.gc_calls - b.gc_base
                if not b.is_split() and b.seg is None and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b, pool)

    # ----- expandable segments (Note [Expandable Segments]) -----
    def _try_allocate_expandable_block(self, pool: BlockPool, stream: int, size: int, label: str,
                                       frames: Frames) -> Optional[Block]:
        """try_allocate_expandable_block: map pages at the lowest address with room, merge, take."""
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), pool, label, frames):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - c.size, nxt.size), pool, label, frames):
                return None
            c = nxt  # map_block merged the free mapped prefix into it
        pool.remove(c)
        return c

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        """find_expandable_block: lowest unmapped range (with a free block before it) that fits."""
        i = bisect.bisect_left(pool.unmapped_keys, (stream, 0))
        while i < len(pool.unmapped_keys) and pool.unmapped_keys[i][0] == stream:
            c = pool.unmapped[pool.unmapped_keys[i]]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        cfg = self.config
        page = cfg.expandable_small_page_bytes if pool.small else cfg.expandable_large_page_bytes
        cap = self.device.capacity_bytes
        va_bytes = -(-(cap + cap // 8) // page) * page  # numSegments(totalGlobalMem * 9/8) pages
        seg = ExpandableSegment(self.device.reserve_address(va_bytes), page, va_bytes, stream)
        block = Block(seg.base, va_bytes, stream, pool.small, seg)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _map_block(self, to_map: Block, size: int, pool: BlockPool, label: str, frames: Frames) -> bool:
        """map_block: back the first `size` bytes (rounded to pages) of an unmapped block."""
        seg = to_map.seg
        assert seg is not None
        page = seg.page_bytes
        begin = (to_map.addr - seg.base) // page
        end = -(-(to_map.addr + size - seg.base) // page)
        mapped = (end - begin) * page
        if not self.device.commit(mapped):
            return False
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.addr + mapped, to_map.size - mapped, to_map.stream, to_map.small, seg)
            rest.mapped = False
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.total_reserved_bytes += mapped
        self.stats.add("reserved_bytes", pool.small, mapped)
        self.stats.counters["num_device_alloc"] += 1
        self._record("segment_map", to_map.addr, mapped, to_map.stream, label, frames)
        if to_map.prev is None and not to_map.seg_label:
            to_map.seg_label, to_map.seg_frames = label, frames
        return True

    def _unmap_block(self, block: Block, pool: BlockPool) -> None:
        """unmap_block: return the whole free pages inside a free expandable block to the device."""
        seg = block.seg
        assert seg is not None
        page = seg.page_bytes
        begin = -(-(block.addr - seg.base) // page)
        end = (block.addr + block.size - seg.base) // page
        if begin >= end:
            return
        pool.remove(block)
        start, nbytes = seg.base + begin * page, (end - begin) * page
        before, after = start - block.addr, block.addr + block.size - (start + nbytes)
        if before > 0:
            free_before = Block(block.addr, before, block.stream, block.small, seg)
            free_before.prev, free_before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = free_before
            block.prev = free_before
            pool.insert(free_before)
        if after > 0:
            free_after = Block(start + nbytes, after, block.stream, block.small, seg)
            free_after.prev, free_after.next = block, block.next
            if block.next is not None:
                block.next.prev = free_after
            block.next = free_after
            pool.insert(free_after)
        block.addr, block.size, block.mapped = start, nbytes, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self.device.release(nbytes)
        self.total_reserved_bytes -= nbytes
        self.stats.sub("reserved_bytes", pool.small, nbytes)
        self.stats.counters["num_device_free"] += 1
        self._record("segment_unmap", start, nbytes, block.stream, block.seg_label, block.seg_frames)

    # ----- trace (TraceEntry dicts in the torch.cuda.memory._snapshot format) -----
    def _record(self, action: str, addr: Optional[int], size: int, stream: int, label: str, frames: Frames,
                device_free: Optional[int] = None) -> None:
        if not self.record_trace:
            return
        entry: dict = {"action": action, "size": size, "stream": stream, "time_us": len(self.trace),
                       "frames": frames_to_dicts(label, frames)}
        if addr is not None:
            entry["addr"] = addr
        if device_free is not None:
            entry["device_free"] = device_free
        self.trace.append(entry)


def _expandable_size(b: Block) -> int:
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _releasable(b: Block) -> bool:
    return b.seg is None and not b.is_split()
