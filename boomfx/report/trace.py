"""Chrome / Perfetto trace of a simulated step: a host lane, one lane per GPU stream, and a memory
counter track (allocated and reserved bytes) — events named by fx node and module path."""
from __future__ import annotations

import json
from typing import Any, Optional

from boomfx.memory.replay import AllocEvent
from boomfx.report.model import Report
from boomfx.simulate.timeline import Timeline

_PID = 1
_HOST_TID = 0


def trace_events(report: Report, timeline: Timeline, events: Optional[list[AllocEvent]] = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": f"boomfx: {report.device}"}},
        {"ph": "M", "pid": _PID, "tid": _HOST_TID, "name": "thread_name", "args": {"name": "host (issue)"}},
    ]
    streams = sorted({s.stream for s in timeline.spans})
    for s in streams:
        out.append({"ph": "M", "pid": _PID, "tid": 1 + s, "name": "thread_name", "args": {"name": f"stream {s}"}})
    kernels = {k.node: k for k in report.kernels}
    start_of: dict[str, float] = {}
    for span in timeline.spans:
        k = kernels.get(span.name)
        name = f"{span.name} ({k.op})" if k else span.name
        args = {"module": k.module, "phase": k.phase, "source": k.source, "flops": k.flops,
                "bytes": k.bytes_moved} if k else {}
        start_of[span.name] = span.start_ns
        if span.issue_end_ns > span.issue_start_ns:
            out.append({"ph": "X", "pid": _PID, "tid": _HOST_TID, "name": name, "ts": span.issue_start_ns / 1e3,
                        "dur": (span.issue_end_ns - span.issue_start_ns) / 1e3, "args": {"module": args.get("module")}})
        out.append({"ph": "X", "pid": _PID, "tid": 1 + span.stream, "name": name, "ts": span.start_ns / 1e3,
                    "dur": max(span.end_ns - span.start_ns, 0.0) / 1e3, "args": args})
    if events:
        live = 0
        sizes: dict[int, int] = {}
        t_us = 0.0
        for ev in events:
            node = ev.label.split(":")[0]
            t_us = max(t_us, start_of.get(node, 0.0) / 1e3)
            if ev.kind == "alloc":
                sizes[ev.tensor_id] = ev.nbytes
                live += ev.nbytes
            else:
                live -= sizes.pop(ev.tensor_id, 0)
            out.append({"ph": "C", "pid": _PID, "name": "memory", "ts": t_us, "args": {"live_bytes": live}})
    return out


def write_trace(path: str, report: Report, timeline: Timeline, events: Optional[list[AllocEvent]] = None) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(report, timeline, events), "displayTimeUnit": "ns"}, f)
