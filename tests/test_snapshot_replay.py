"""Replay a recorded allocator snapshot through boomfx's caching-allocator model: same segments, same peak.

A snapshot is what ``torch.cuda.memory._snapshot()`` returns (and ``_dump_snapshot`` pickles): the
``segments`` held at dump time and, per device, ``device_traces``: a list of TraceEntry dicts whose
``action`` is ``segment_alloc`` / ``segment_free`` / ``segment_map`` / ``segment_unmap`` (cudaMalloc /
cudaFree / expandable-segment pages) or ``alloc`` / ``free_requested`` / ``free_completed`` (tensors).

``replay_snapshot`` feeds only the tensor events (alloc sizes as requested, frees by address) to
``CachingAllocator``; the allocator model must then decide the same segments the real allocator did.

Real snapshots: any ``tests/data/*.pickle`` (e.g. the one ``benchmarks/gpu_validation.py`` writes on a GPU)
is picked up and tested the same way. A snapshot must be recorded from an empty allocator
(``_record_memory_history`` before the first allocation); one that is not is skipped with the reason.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from boomfx.memory.config import AllocatorConfig, MiB
from boomfx.memory.allocator import CachingAllocator

DATA = Path(__file__).resolve().parent / "data"
_UNBOUNDED_BYTES = 1 << 50          # the recorded run did not run out of memory: neither may the replay
_RESERVE = {"segment_alloc": 1, "segment_free": -1, "segment_map": 1, "segment_unmap": -1}


# ---------------------------------------------------------------------------------------------------
# The helper
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recorded:
    """What the snapshot says the real allocator did."""

    segment_sizes: list[int]        # total_size of each segment held at dump time, sorted
    segment_allocs: list[int]       # sizes of the cudaMalloc calls, in order
    peak_reserved_bytes: int


@dataclass(frozen=True)
class Replayed:
    segment_sizes: list[int]
    segment_allocs: list[int]
    peak_reserved_bytes: int


def device_trace(snapshot: dict) -> tuple[int, list[dict]]:
    """(device index, trace) of the first device with a non-empty trace."""
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        if trace:
            return device, list(trace)
    return 0, []


def recorded(snapshot: dict) -> Recorded:
    device, trace = device_trace(snapshot)
    reserved = peak = 0
    for entry in trace:
        reserved += _RESERVE.get(entry["action"], 0) * entry["size"]
        peak = max(peak, reserved)
    sizes = sorted(s["total_size"] for s in snapshot["segments"] if s.get("device", 0) == device)
    allocs = [e["size"] for e in trace if e["action"] == "segment_alloc"]
    return Recorded(sizes, allocs, peak)


def config_of(snapshot: dict) -> AllocatorConfig:
    settings = snapshot.get("allocator_settings") or {}
    return AllocatorConfig.parse(settings.get("PYTORCH_CUDA_ALLOC_CONF") or "")


def complete_history_problem(snapshot: dict) -> str:
    """Why the trace cannot be replayed alone ('' when it can): it must start from an empty allocator."""
    device, trace = device_trace(snapshot)
    if not trace:
        return "the snapshot has no trace (record it with torch.cuda.memory._record_memory_history())"
    seen_segments = {e["addr"] for e in trace if e["action"] in ("segment_alloc", "segment_map")}
    live: set[int] = set()
    for e in trace:
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["action"] == "free_requested" and e["addr"] not in live:
            return f"free of {e['addr']:#x}, allocated before recording started"
    for seg in snapshot["segments"]:
        if seg.get("device", 0) == device and seg["address"] not in seen_segments and not seg.get("is_expandable"):
            return f"segment {seg['address']:#x} was allocated before recording started"
    return ""


def replay_snapshot(snapshot: dict) -> Replayed:
    """Run the snapshot's tensor allocs/frees through a fresh ``CachingAllocator``."""
    _, trace = device_trace(snapshot)
    alloc = CachingAllocator(config_of(snapshot), _UNBOUNDED_BYTES, record_trace=True)
    # the block returns to its pool at free_completed (later than free_requested with record_stream)
    free_action = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
    streams: dict[Any, int] = {}
    handles: dict[int, int] = {}
    for e in trace:
        if e["action"] == "alloc":
            stream = streams.setdefault(e.get("stream", 0), len(streams))
            handles[e["addr"]] = alloc.malloc(e["size"], stream)
        elif e["action"] == free_action:
            alloc.free(handles.pop(e["addr"]))
    allocs = [e["size"] for e in alloc.trace if e["action"] == "segment_alloc"]
    return Replayed(sorted(s.total_size for s in alloc.segments()), allocs, alloc.stats.peak("reserved_bytes"))


# ---------------------------------------------------------------------------------------------------
# A synthetic snapshot, written the way the real allocator behaves with default settings
# ---------------------------------------------------------------------------------------------------
class _TraceWriter:
    def __init__(self) -> None:
        self.trace: list[dict] = []

    def add(self, action: str, addr: int, size: int) -> None:
        self.trace.append({"action": action, "addr": addr, "size": size, "stream": 0,
                           "time_us": len(self.trace), "frames": []})

    def free(self, addr: int, size: int) -> None:
        self.add("free_requested", addr, size)
        self.add("free_completed", addr, size)


def synthetic_snapshot() -> dict:
    """Six tensors on default settings (CUDACachingAllocator rules, derivations in the comments)."""
    w = _TraceWriter()
    large, small, big = 0x7F00_0000_0000, 0x7F00_1000_0000, 0x7F00_2000_0000
    w.add("segment_alloc", large, 20 * MiB)   # 3 MiB: large pool, < 10 MiB -> a 20 MiB segment (kLargeBuffer)
    w.add("alloc", large, 3 * MiB)
    w.add("segment_alloc", small, 2 * MiB)    # 600 B: small pool (<= 1 MiB) -> a 2 MiB segment (kSmallBuffer)
    w.add("alloc", small, 600)
    # 18 MiB: the 17 MiB left in the 20 MiB segment is too small; >= 10 MiB -> a segment rounded to 2 MiB
    w.add("segment_alloc", big, 18 * MiB)
    w.add("alloc", big, 18 * MiB)
    w.add("alloc", large + 3 * MiB, 5 * MiB)  # 5 MiB: best fit in the 17 MiB left of the 20 MiB segment
    w.free(large, 3 * MiB)                    # a 3 MiB free block at the segment's start
    # 2 MiB: best fit is the 3 MiB free block; the 1 MiB rest is not > kSmallSize, so no split
    w.add("alloc", large, 2 * MiB)
    w.free(big, 18 * MiB)                     # the 18 MiB segment is cached, not returned
    # 17 MiB + 512 B: the 12 MiB tail is too small, the cached 18 MiB block fits (rest < 1 MiB: no split)
    w.add("alloc", big, 17 * MiB + 512)
    # reserved peaks at 20 + 2 + 18 = 40 MiB; three segments remain
    segments = [
        {"device": 0, "address": large, "total_size": 20 * MiB, "allocated_size": 8 * MiB,
         "active_size": 8 * MiB, "requested_size": 7 * MiB, "stream": 0, "segment_type": "large",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
         "blocks": [{"address": large, "size": 3 * MiB, "requested_size": 2 * MiB, "state": "active_allocated",
                     "frames": []},
                    {"address": large + 3 * MiB, "size": 5 * MiB, "requested_size": 5 * MiB,
                     "state": "active_allocated", "frames": []},
                    {"address": large + 8 * MiB, "size": 12 * MiB, "requested_size": 0, "state": "inactive",
                     "frames": []}]},
        {"device": 0, "address": small, "total_size": 2 * MiB, "allocated_size": 1024, "active_size": 1024,
         "requested_size": 600, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
         "is_expandable": False, "frames": [],
         "blocks": [{"address": small, "size": 1024, "requested_size": 600, "state": "active_allocated",
                     "frames": []},
                    {"address": small + 1024, "size": 2 * MiB - 1024, "requested_size": 0, "state": "inactive",
                     "frames": []}]},
        {"device": 0, "address": big, "total_size": 18 * MiB, "allocated_size": 18 * MiB,
         "active_size": 18 * MiB, "requested_size": 17 * MiB + 512, "stream": 0, "segment_type": "large",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
         "blocks": [{"address": big, "size": 18 * MiB, "requested_size": 17 * MiB + 512,
                     "state": "active_allocated", "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [w.trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}}


def _snapshots() -> list:
    params = [pytest.param("synthetic", id="synthetic")]
    for path in sorted(DATA.glob("*.pickle")) if DATA.exists() else []:
        params.append(pytest.param(path, id=path.name))
    return params


def _load(which: Any, tmp_path: Path) -> dict:
    if which == "synthetic":   # through pickle, as _dump_snapshot writes it
        path = tmp_path / "synthetic_snapshot.pickle"
        path.write_bytes(pickle.dumps(synthetic_snapshot()))
        which = path
    with open(which, "rb") as fh:
        return pickle.load(fh)


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------
def test_synthetic_snapshot_states_the_hand_derived_numbers() -> None:
    rec = recorded(synthetic_snapshot())
    assert rec.peak_reserved_bytes == 40 * MiB                # 20 + 2 + 18
    assert rec.segment_sizes == [2 * MiB, 18 * MiB, 20 * MiB]
    assert rec.segment_allocs == [20 * MiB, 2 * MiB, 18 * MiB]
    assert complete_history_problem(synthetic_snapshot()) == ""


@pytest.mark.parametrize("which", _snapshots())
def test_replay_gives_the_recorded_segments_and_peak(which: Any, tmp_path: Path) -> None:
    snapshot = _load(which, tmp_path)
    problem = complete_history_problem(snapshot)
    if problem:
        pytest.skip(f"{which}: {problem}")
    rec, rep = recorded(snapshot), replay_snapshot(snapshot)
    assert rep.segment_allocs == rec.segment_allocs           # the same cudaMalloc calls, in order
    assert rep.segment_sizes == rec.segment_sizes             # the same segments at the end
    assert rep.peak_reserved_bytes == rec.peak_reserved_bytes


def test_replay_notices_a_model_that_disagrees() -> None:
    """Contract: a trace whose segments the model would not make is reported as a difference."""
    snap = synthetic_snapshot()
    trace = snap["device_traces"][0]
    # pretend the real allocator split the 3 MiB block for the 2 MiB tensor and opened a 2 MiB segment
    trace.insert(0, {"action": "segment_alloc", "addr": 1, "size": 2 * MiB, "stream": 0, "time_us": 0, "frames": []})
    assert replay_snapshot(snap).segment_allocs != recorded(snap).segment_allocs


def test_history_started_late_is_detected() -> None:
    snap = synthetic_snapshot()
    snap["device_traces"][0] = snap["device_traces"][0][2:]   # the first segment and alloc were not recorded
    assert "before recording started" in complete_history_problem(snap)
