"""Chrome / Perfetto trace of a distributed step: one process per rank (or pipeline stage), with a host lane,
a compute lane and one lane per communication stream; collectives named by fx node."""
from __future__ import annotations

import json
from typing import Any

from boomfx.simulate.pipeline import PipelineTimeline
from boomfx.simulate.streams import COMPUTE, StreamTimeline, is_comm_stream

_HOST_TID, _COMPUTE_TID = 0, 1
NS_PER_US = 1e3


def _lane_ids(streams: list[str]) -> dict[str, int]:
    """Compute first, then the communication streams by name (stable across runs)."""
    comm = sorted(s for s in streams if is_comm_stream(s))
    other = sorted(s for s in streams if s != COMPUTE and not is_comm_stream(s))
    lanes = {COMPUTE: _COMPUTE_TID}
    for i, name in enumerate(other + comm):
        lanes[name] = _COMPUTE_TID + 1 + i
    return lanes


def stream_trace_events(timeline: StreamTimeline, label: str = "rank") -> list[dict[str, Any]]:
    """Trace events of ``timeline``: pid = rank + 1; tid 0 host issue, 1 compute, 2.. communication."""
    out: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in timeline.spans}):
        pid = rank + 1
        spans = [s for s in timeline.spans if s.rank == rank]
        lanes = _lane_ids(sorted({s.stream for s in spans}))
        out.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"{label} {rank}"}})
        out.append({"ph": "M", "pid": pid, "tid": _HOST_TID, "name": "thread_name", "args": {"name": "host (issue)"}})
        for stream, tid in lanes.items():
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": stream}})
        for s in spans:
            if s.issue_end_ns > s.issue_start_ns:
                out.append({"ph": "X", "pid": pid, "tid": _HOST_TID, "name": s.name, "ts": s.issue_start_ns / NS_PER_US,
                            "dur": (s.issue_end_ns - s.issue_start_ns) / NS_PER_US})
            if s.end_ns > s.start_ns:
                out.append({"ph": "X", "pid": pid, "tid": lanes[s.stream], "name": s.name,
                            "ts": s.start_ns / NS_PER_US, "dur": (s.end_ns - s.start_ns) / NS_PER_US,
                            "args": {"stream": s.stream}})
    return out


def pipeline_trace_events(timeline: PipelineTimeline) -> list[dict[str, Any]]:
    """One process per pipeline stage, its forward and backward passes named ``F3@v1`` (micro-batch 3,
    virtual stage 1) on its compute lane."""
    out: list[dict[str, Any]] = []
    for stage in range(len(timeline.busy_ns)):
        out.append({"ph": "M", "pid": stage + 1, "name": "process_name", "args": {"name": f"stage {stage}"}})
        out.append({"ph": "M", "pid": stage + 1, "tid": _COMPUTE_TID, "name": "thread_name",
                    "args": {"name": COMPUTE}})
    for placed in timeline.passes:
        step = placed.step
        out.append({"ph": "X", "pid": placed.stage + 1, "tid": _COMPUTE_TID,
                    "name": f"{step.kind}{step.microbatch}@v{step.virtual_stage}", "ts": placed.start_ns / NS_PER_US,
                    "dur": (placed.end_ns - placed.start_ns) / NS_PER_US})
    return out


def write_stream_trace(path: str, events: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
