"""State of the caching-allocator model: counters, blocks, pools and the fake device.

Why a separate module: this is the *accounting* half of ``boomfx.memory.allocator`` (tinygrad's split between
accounting and caching policy). Nothing here decides where a request goes; the policy in
``CachingAllocator`` does. Names follow ``c10/cuda/CUDACachingAllocator.cpp`` (``Block``, ``BlockPool``,
``DeviceStats``, ``increase_stat``/``decrease_stat``, ``ExpandableSegment``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

Frames = tuple[tuple[str, int, str], ...]

# ----------------------------------------------------------------------------------------------------------
# Accounting: the counters of torch.cuda.memory_stats (increase_stat / decrease_stat)
# ----------------------------------------------------------------------------------------------------------
_ARRAYS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
           "active_bytes", "inactive_split_bytes", "requested_bytes")
_TYPES = ("all", "small_pool", "large_pool")


class Stat:
    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, n: int) -> None:
        self.current += n
        self.allocated += n
        if self.current > self.peak:
            self.peak = self.current

    def sub(self, n: int) -> None:
        self.current -= n
        self.freed += n


class AllocatorStats:
    """DeviceStats: per stat array an aggregate, small-pool and large-pool counter."""

    def __init__(self) -> None:
        self.arrays = {name: (Stat(), Stat(), Stat()) for name in _ARRAYS}
        self.oversize_allocations = Stat()
        self.oversize_segments = Stat()
        self.counters = dict(num_alloc_retries=0, num_ooms=0, num_sync_all_streams=0, num_device_alloc=0,
                             num_device_free=0)

    def add(self, name: str, small: bool, n: int) -> None:
        arr = self.arrays[name]
        arr[0].add(n)
        arr[2 - small].add(n)

    def sub(self, name: str, small: bool, n: int) -> None:
        arr = self.arrays[name]
        arr[0].sub(n)
        arr[2 - small].sub(n)

    def current(self, name: str) -> int:
        return self.arrays[name][0].current

    def peak(self, name: str) -> int:
        return self.arrays[name][0].peak

    def as_dict(self) -> dict[str, int]:
        """Flattened like torch.cuda.memory_stats(): "allocated_bytes.all.peak" and so on."""
        out: dict[str, int] = {}
        for name, arr in self.arrays.items():
            for tname, stat in zip(_TYPES, arr):
                for metric in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{tname}.{metric}"] = getattr(stat, metric)
        for name in ("oversize_allocations", "oversize_segments"):
            for metric in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{metric}"] = getattr(getattr(self, name), metric)
        out.update(self.counters)
        return out


# ----------------------------------------------------------------------------------------------------------
# Blocks, pools and the fake device
# ----------------------------------------------------------------------------------------------------------
class ExpandableSegment:
    __slots__ = ("base", "page_bytes", "size", "stream")

    def __init__(self, base: int, page_bytes: int, size: int, stream: int) -> None:
        self.base, self.page_bytes, self.size, self.stream = base, page_bytes, size, stream


class Block:
    __slots__ = ("addr", "size", "requested", "stream", "small", "allocated", "mapped", "prev", "next",
                 "seg", "gc_base", "label", "frames", "seg_label", "seg_frames")

    def __init__(self, addr: int, size: int, stream: int, small: bool, seg: Optional[ExpandableSegment]) -> None:
        self.addr, self.size, self.stream, self.small, self.seg = addr, size, stream, small, seg
        self.requested = 0
        self.allocated = False
        self.mapped = True
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None
        self.gc_base = 0
        self.label, self.frames = "", ()
        self.seg_label, self.seg_frames = "", ()

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class BlockPool:
    """BlockPool: free mapped blocks ordered by (stream, size, address), unmapped ones by (stream, address)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.by_key: dict[tuple[int, int, int], Block] = {}
        self.unmapped_keys: list[tuple[int, int]] = []
        self.unmapped: dict[tuple[int, int], Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, b: Block) -> None:  # insert_into_blocks: also stamps the gc age base
        key = (b.stream, b.size, b.addr)
        b.gc_base = self.gc_calls
        bisect.insort(self.keys, key)
        self.by_key[key] = b

    def remove(self, b: Block) -> None:
        key = (b.stream, b.size, b.addr)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.by_key[key]

    def insert_unmapped(self, b: Block) -> None:
        key = (b.stream, b.addr)
        bisect.insort(self.unmapped_keys, key)
        self.unmapped[key] = b

    def remove_unmapped(self, b: Block) -> None:
        key = (b.stream, b.addr)
        del self.unmapped_keys[bisect.bisect_left(self.unmapped_keys, key)]
        del self.unmapped[key]


class FakeDevice:
    """cudaMalloc / cuMemCreate against a fixed capacity; memory outside the allocator is ``outside_bytes``."""

    _ALIGN = 2 * 1024 * 1024

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.outside_bytes = 0
        self._next_addr = 0x7F0000000000

    def free_bytes(self) -> int:
        return self.capacity_bytes - self.outside_bytes - self.used_bytes

    def reserve_address(self, nbytes: int) -> int:
        addr = self._next_addr
        self._next_addr += -(-nbytes // self._ALIGN) * self._ALIGN
        return addr

    def commit(self, nbytes: int) -> bool:
        if nbytes > self.free_bytes():
            return False
        self.used_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used_bytes -= nbytes


@dataclass(frozen=True)
class BlockInfo:
    address: int
    size: int
    requested_size: int
    state: str  # "active_allocated" or "inactive" (torch snapshot vocabulary)
    label: str
    frames: Frames


@dataclass(frozen=True)
class SegmentInfo:
    address: int
    total_size: int
    stream: int
    segment_type: str  # "small" or "large"
    allocated_size: int
    requested_size: int
    is_expandable: bool
    label: str
    frames: Frames
    blocks: tuple[BlockInfo, ...]


def frames_to_dicts(label: str, frames: Frames) -> list[dict]:
    """Snapshot frames: the caller's (filename, line, name) frames, then one naming the fx node label."""
    out = [{"filename": f, "line": int(line), "name": n} for f, line, n in frames]
    if label:
        out.insert(0, {"filename": "<fx-node>", "line": 0, "name": label})
    return out
