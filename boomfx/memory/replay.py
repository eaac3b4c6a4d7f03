"""Replay a sequence of tensor allocations and frees through the caching-allocator model.

Why: peak *reserved* memory, fragmentation and whether a step fits on a device follow from the order of
allocations and the allocator's rules, not from the sum of live bytes. ``replay`` is the one entry point;
it never raises on out-of-memory but reports where it happened.

Example:
    >>> from boomfx.memory.config import AllocatorConfig, MiB
    >>> ev = [AllocEvent("alloc", 1, 3 * MiB, label="mm"), AllocEvent("free", 1, 3 * MiB)]
    >>> r = replay(ev, AllocatorConfig(), capacity_bytes=80 * 1024 * MiB)
    >>> r.peak_reserved_bytes // MiB, r.peak_allocated_bytes // MiB
    (20, 3)

Known limitations:
    * One device; streams are modelled only as separate free lists (no cross-stream event waits).
    * Memory outside the allocator is a step function of the event index (``resident_bytes_events``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Optional, Sequence, Union

from boomfx.memory.config import AllocatorConfig
from boomfx.memory.allocator import CachingAllocator, SimulatedOutOfMemory

ResidentSpec = Union[Mapping[int, int], Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class AllocEvent:
    """One allocator call: ``alloc`` of ``nbytes`` for ``tensor_id`` or ``free`` of that tensor."""

    kind: Literal["alloc", "free"]
    tensor_id: int
    nbytes: int
    stream: int = 0
    label: str = ""
    frames: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class OomInfo:
    """Where a replay ran out of memory.

    ``margin_bytes`` is the device's free memory (after the allocator released its cache) minus the
    bytes the failed cudaMalloc asked for: negative, and its magnitude is the shortfall.
    """

    event_index: int
    label: str
    requested_bytes: int
    alloc_bytes: int
    margin_bytes: int
    reserved_bytes: int
    allocated_bytes: int


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of a replay; ``stats`` is flattened like ``torch.cuda.memory_stats()``."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    peak_requested_bytes: int
    peak_reserved_event_index: int
    fragmentation_at_peak_bytes: int       # reserved - allocated when reserved peaked
    largest_free_block_at_peak_bytes: int  # largest cached free block when reserved peaked
    num_segments_at_peak: int
    num_segments: int                      # segments held at the end of the replay
    stats: Mapping[str, int]
    oom: Optional[OomInfo]
    allocator: CachingAllocator = field(repr=False, compare=False)


def _resident_steps(spec: Optional[ResidentSpec]) -> dict[int, int]:
    if spec is None:
        return {}
    items = spec.items() if isinstance(spec, Mapping) else spec
    steps: dict[int, int] = {}
    for index, nbytes in items:
        if nbytes < 0:
            raise ValueError(f"resident bytes at event {index} must be non-negative, got {nbytes}.")
        steps[int(index)] = int(nbytes)
    return steps


def replay(events: Iterable[AllocEvent], config: AllocatorConfig, capacity_bytes: int,
           resident_bytes_events: Optional[ResidentSpec] = None, record_trace: bool = False) -> ReplayResult:
    """Run ``events`` through a fresh ``CachingAllocator`` on a device of ``capacity_bytes``.

    Args:
        events: alloc/free events in program order; a free names a tensor allocated earlier.
        config: allocator constants and options.
        capacity_bytes: total device memory.
        resident_bytes_events: memory held outside the allocator as a step function of the event index:
            ``{0: ctx_bytes, 120: ctx_bytes + nccl_bytes}`` means that amount is resident from that event on.
        record_trace: keep a TraceEntry log in ``result.allocator.trace`` for ``memory_snapshot``.

    Returns:
        A ReplayResult; on out-of-memory the replay stops at that event and ``oom`` says where.
    """
    events = list(events)
    alloc = CachingAllocator(config, capacity_bytes, record_trace=record_trace)
    steps = _resident_steps(resident_bytes_events)
    stats = alloc.stats
    reserved_arr, allocated_arr = stats.arrays["reserved_bytes"][0], stats.arrays["allocated_bytes"][0]
    segment_arr = stats.arrays["segment"][0]  # expandable segments are not counted there (see below)
    handles: dict[int, int] = {}
    best_reserved, best_index, frag, largest, nseg_peak = -1, -1, 0, 0, 0
    oom: Optional[OomInfo] = None
    for index, ev in enumerate(events):
        if steps and index in steps:
            alloc.set_outside_bytes(steps[index])
        if ev.kind == "alloc":
            if ev.tensor_id in handles:
                raise ValueError(f"event {index}: tensor {ev.tensor_id} is allocated twice without a free.")
            try:
                handles[ev.tensor_id] = alloc.malloc(ev.nbytes, ev.stream, ev.label, ev.frames)
            except SimulatedOutOfMemory as e:
                oom = OomInfo(index, ev.label, e.requested_bytes, e.alloc_bytes,
                              e.device_free_bytes - e.alloc_bytes, e.reserved_bytes, e.allocated_bytes)
                break
        elif ev.kind == "free":
            handle = handles.pop(ev.tensor_id, None)
            if handle is None:
                raise ValueError(f"event {index}: free of tensor {ev.tensor_id}, which is not allocated.")
            alloc.free(handle)
        else:
            raise ValueError(f"event {index}: kind must be 'alloc' or 'free', not {ev.kind!r}.")
        if reserved_arr.current > best_reserved:
            best_reserved, best_index = reserved_arr.current, index
            frag = reserved_arr.current - allocated_arr.current
            largest = alloc.largest_free_block()
            nseg_peak = segment_arr.current
    if config.expandable_segments and best_index >= 0:
        # alloc_block() does not count expandable segments in stats; count mapped ranges as the
        # snapshot does, with a second deterministic replay so the hot loop stays cheap.
        nseg_peak = _segments_at(events, best_index, config, capacity_bytes, steps)
    return ReplayResult(
        peak_allocated_bytes=stats.peak("allocated_bytes"), peak_reserved_bytes=stats.peak("reserved_bytes"),
        peak_active_bytes=stats.peak("active_bytes"), peak_requested_bytes=stats.peak("requested_bytes"),
        peak_reserved_event_index=best_index, fragmentation_at_peak_bytes=frag,
        largest_free_block_at_peak_bytes=largest, num_segments_at_peak=max(nseg_peak, 0),
        num_segments=len(alloc.segments()), stats=stats.as_dict(), oom=oom, allocator=alloc)


def _segments_at(events: Sequence[AllocEvent], stop: int, config: AllocatorConfig, capacity_bytes: int,
                 steps: dict[int, int]) -> int:
    """Segment count right after event ``stop``, by a second (deterministic) replay up to it."""
    alloc = CachingAllocator(config, capacity_bytes)
    handles: dict[int, int] = {}
    for index, ev in enumerate(events):
        if index in steps:
            alloc.set_outside_bytes(steps[index])
        if ev.kind == "alloc":
            handles[ev.tensor_id] = alloc.malloc(ev.nbytes, ev.stream, ev.label, ev.frames)
        else:
            alloc.free(handles.pop(ev.tensor_id))
        if index == stop:
            break
    return len(alloc.segments())


def fits(events: Iterable[AllocEvent], config: AllocatorConfig, capacity_bytes: int,
         resident_bytes_events: Optional[ResidentSpec] = None) -> bool:
    """True when the replay completes without a simulated out-of-memory."""
    return replay(events, config, capacity_bytes, resident_bytes_events).oom is None
