"""A point's memory: the liveness intervals turned into allocator events in execution order, replayed
through the caching-allocator model (CUDA targets), and summarised as the Report's MemoryReport.

Order of events: resident storages first (parameters, buffers, optimizer state), then allocations that
go through the allocator but live outside the graph (the cuBLAS workspace, boomfx/memory/outside.py),
then per step the node's outputs, its kernel workspace once (allocated and freed at once), and the frees of
storages whose last use it was (``step_calls``, the one order both allocator models replay: the caching
allocator's for CUDA, glibc's heap for a CPU step's page faults).
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, NamedTuple, Optional

from boomfx.core.devices import DeviceSpec
from boomfx.memory.config import AllocatorConfig
from boomfx.memory.glibc_heap import MMAP_THRESHOLD_MAX, HeapEvent, steady_step_faults
from boomfx.memory.outside import OutsideMemory
from boomfx.memory.replay import AllocEvent, ReplayResult, replay
from boomfx.passes.compiled import CUDAGRAPH_POOL_STREAM  # --cudagraphs: the graph's private pool
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.liveness import LivenessInfo
from boomfx.report.model import AllocatorReport, MemoryReport

_UNBOUNDED_BYTES = 1 << 62   # a device too large to run out: what the step would need


def step_calls(liveness: LivenessInfo, workspace_at: Mapping[int, int]) -> Iterator[tuple[int, str, Any]]:
    """A step's allocator calls in execution order, for every allocator model: per step
    ``(step, "alloc", interval)`` for the node's outputs, ``(step, "scratch", bytes)`` for its kernel
    workspace, once (allocated and freed at once), then ``(step, "free", interval)`` for the storages whose
    last use it was. Resident storages are not included."""
    by_step: dict[int, list] = {}
    for step, kind, iv in liveness.events():
        by_step.setdefault(step, []).append((kind, iv))
    for step in range(len(liveness.order)):
        calls = by_step.get(step, ())
        yield from ((step, kind, iv) for kind, iv in calls if kind == "alloc")
        if workspace_at.get(step, 0):
            yield step, "scratch", workspace_at[step]
        yield from ((step, kind, iv) for kind, iv in calls if kind == "free")


def alloc_events(liveness: LivenessInfo, ev: Evaluator, workspace_at: Mapping[int, int], outside: OutsideMemory,
                 node_module: Mapping[str, str], cudagraphs: bool) -> list[AllocEvent]:
    """The allocator events of one step at ``ev``'s sizes (see module doc for their order)."""
    events: list[AllocEvent] = []
    for iv in liveness.intervals:
        if iv.resident:
            events.append(AllocEvent("alloc", iv.storage_id, ev(iv.nbytes), 0, iv.node,
                                     ((node_module.get(iv.node, ""), 0, iv.node),)))
    next_id = 1 + max((iv.storage_id for iv in liveness.intervals), default=-1)   # ids need not be dense
    for label, size in outside.allocator_sizes():
        events.append(AllocEvent("alloc", next_id, size, 0, label, (("", 0, label),)))
        next_id += 1
    pool = CUDAGRAPH_POOL_STREAM if cudagraphs else 0   # --cudagraphs: private pool
    for step, kind, call in step_calls(liveness, workspace_at):
        if kind == "scratch":
            node = liveness.order[step]
            frames = ((node_module.get(node, ""), 0, node),)
            events.append(AllocEvent("alloc", next_id, call, 0, node + ":workspace", frames))
            events.append(AllocEvent("free", next_id, call, 0, node + ":workspace", frames))
            next_id += 1
        else:
            frames = ((node_module.get(call.node, ""), 0, call.node),)
            events.append(AllocEvent(kind, call.storage_id, ev(call.nbytes), pool, call.node, frames))
    return events


class HeapFaults(NamedTuple):
    """One step's page faults in glibc's heap. ``mapped``: allocations no free heap memory could hold,
    mapped afresh (as many whatever else the process allocates); ``always_mapped``: of those, the ones
    glibc maps at any threshold (a kernel measured alone with fresh outputs paid them too); ``regrown``:
    heap pages a trim had returned. Trims need the top of the heap free; the runtime's own small
    allocations (tensor metadata, autograd nodes, Python objects) often sit there, so real steps refaulted
    0-1.3x ``regrown``, median 0.6x (25 steps, ``benchmarks/results/cpu_page_faults.md``): an estimate, not
    charged."""

    mapped: int
    always_mapped: int
    regrown: int


_NO_FAULTS = HeapFaults(0, 0, 0)


def heap_fault_pages(liveness: LivenessInfo, ev: Evaluator, workspace_at: Mapping[int, int],
                     warmup_steps: int = 2) -> dict[int, HeapFaults]:
    """Page faults of an eager CPU step in glibc's heap (``boomfx/memory/glibc_heap.py``) at steady state,
    per step index, without the runtime's own small allocations (see ``HeapFaults``).

    Events as PyTorch's CPU allocator makes them: resident storages first, then ``step_calls`` (a oneDNN
    convolution's scratch, its blocked copies, is allocated after its output and freed before it returns)."""
    resident = [ev(iv.nbytes) for iv in liveness.intervals if iv.resident]
    events: list[HeapEvent] = []
    owner: list[int] = []
    sizes: dict[int, int] = {}
    for step, kind, call in step_calls(liveness, workspace_at):
        if kind == "scratch":
            sizes[-1 - step] = call
            events += [HeapEvent("alloc", -1 - step, call), HeapEvent("free", -1 - step)]
            owner += [step, step]
        elif kind == "alloc":
            sizes[call.storage_id] = ev(call.nbytes)
            events.append(HeapEvent("alloc", call.storage_id, sizes[call.storage_id]))
            owner.append(step)
        else:
            events.append(HeapEvent("free", call.storage_id))
            owner.append(step)
    pages: dict[int, HeapFaults] = {}
    for event, step, faults in zip(events, owner, steady_step_faults(resident, events, warmup_steps)):
        if not faults.pages:
            continue
        mapped, always, regrown = pages.get(step, _NO_FAULTS)
        if faults.mapped:
            mapped += faults.pages
            always += faults.pages if sizes[event.alloc_id] >= MMAP_THRESHOLD_MAX else 0
        else:
            regrown += faults.pages
        pages[step] = HeapFaults(mapped, always, regrown)
    return pages


def memory_report(liveness: LivenessInfo, ev: Evaluator, workspace_at: Mapping[int, int], device: DeviceSpec,
                  outside: OutsideMemory, alloc_config: AllocatorConfig, alloc_conf: str,
                  node_module: Mapping[str, str], cudagraphs: bool, record_trace: bool = False,
                  exact_total: bool = True, replay_allocator: bool = True
                  ) -> tuple[MemoryReport, Optional[ReplayResult], list[AllocEvent]]:
    """The step's memory: the ideal live-bytes peak, and on CUDA the allocator replay (allocated, reserved,
    fragmentation, out-of-memory with the node that caused it). ``replay_allocator=False`` on CUDA: the
    live-bytes peak plus the memory outside the allocator, a lower bound of the replay's total."""
    timeline = liveness.timeline(ev)
    combined = [live + workspace_at.get(i, 0) for i, live in enumerate(timeline)]
    peak_step = max(range(len(combined)), key=combined.__getitem__) if combined else 0
    point = liveness.peak(ev, timeline)
    capacity = device.memory_bytes
    outside_bytes = {item.name: item.nbytes for item in outside.items()} if device.kind == "cuda" else {}
    rep: Optional[ReplayResult] = None
    events: list[AllocEvent] = []
    oom_node = oom_module = None
    allocator = None
    if device.kind == "cuda" and not replay_allocator:
        total = (combined[peak_step] if combined else 0) + outside.total_bytes
    elif device.kind == "cuda":
        events = alloc_events(liveness, ev, workspace_at, outside, node_module, cudagraphs)
        # memory outside the allocator (CUDA context, NCCL's buffers) can leave it nothing: then the step does
        # not fit whatever it allocates, and the replay on an unbounded device says what it would need
        room = capacity - outside.total_bytes
        rep = replay(events, alloc_config, room if room > 0 else _UNBOUNDED_BYTES, record_trace=record_trace)
        allocator = AllocatorReport(
            rep.peak_allocated_bytes, rep.peak_reserved_bytes, rep.peak_active_bytes,
            rep.fragmentation_at_peak_bytes, rep.largest_free_block_at_peak_bytes, rep.num_segments_at_peak,
            int(rep.stats.get("num_alloc_retries", 0)), int(rep.stats.get("num_ooms", 0)),
            alloc_conf or "(defaults)")
        if rep.oom is not None:
            label = rep.oom.label.split(":")[0]
            oom_node, oom_module = label, node_module.get(label, "")
        total = rep.peak_reserved_bytes + outside.total_bytes
        if rep.oom is not None and exact_total:
            # what the step would need: the same replay on a device too large to run out
            unbounded = replay(events, alloc_config, _UNBOUNDED_BYTES)
            total = unbounded.peak_reserved_bytes + outside.total_bytes
    else:
        total = combined[peak_step] if combined else 0
    fits = (rep.oom is None and total <= capacity) if rep is not None else total <= capacity
    memory = MemoryReport(
        peak_live_bytes=combined[peak_step] if combined else 0,
        peak_step_node=liveness.order[peak_step] if combined else "",
        by_category_bytes={c.value: b for c, b in sorted(point.by_category.items(), key=lambda kv: -kv[1])},
        resident_bytes=liveness.resident_bytes(ev), workspace_bytes=workspace_at.get(peak_step, 0),
        allocator=allocator, outside_allocator_bytes=outside_bytes, device_capacity_bytes=capacity,
        total_device_bytes=total, fits=fits, margin_bytes=capacity - total,
        oom_node=oom_node, oom_module=oom_module)
    return memory, rep, events
