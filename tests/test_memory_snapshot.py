"""The written snapshot loads with torch.cuda._memory_viz on CPU and shows the model's totals."""
from __future__ import annotations

import pickle

import pytest
from torch.cuda import _memory_viz

from boomfx.memory.config import AllocatorConfig, MiB
from boomfx.memory.allocator import CachingAllocator
from boomfx.memory.replay import AllocEvent, replay
from boomfx.report.snapshot import snapshot, write_snapshot


@pytest.fixture
def written(tmp_path):
    a = CachingAllocator(AllocatorConfig(), 1024 * MiB, record_trace=True)
    frames = (("model.py", 12, "Block.forward"),)
    x = a.malloc(3 * MiB, label="linear_1", frames=frames)
    a.malloc(600, label="add_2", frames=frames)
    a.malloc(5 * MiB, label="gelu", frames=frames)
    a.free(x)
    path = tmp_path / "snap.pickle"
    write_snapshot(path, a)
    with open(path, "rb") as f:
        return pickle.load(f), a


def test_snapshot_keys_match_torch_typeddicts(written):
    data, _ = written
    assert set(data) >= {"segments", "device_traces"}
    seg = data["segments"][0]
    assert set(seg) >= {"address", "total_size", "stream", "segment_type", "allocated_size", "active_size",
                        "blocks"}
    assert set(seg["blocks"][0]) == {"size", "requested_size", "address", "state", "frames"}
    actions = [e["action"] for e in data["device_traces"][0]]
    assert actions[:3] == ["segment_alloc", "alloc", "segment_alloc"]
    assert {"free_requested", "free_completed"} <= set(actions)
    alloc = next(e for e in data["device_traces"][0] if e["action"] == "alloc")
    assert alloc["frames"][0] == {"filename": "<fx-node>", "line": 0, "name": "linear_1"}
    assert alloc["frames"][1] == {"filename": "model.py", "line": 12, "name": "Block.forward"}


def test_segsum_shows_totals(written):
    data, a = written
    text = _memory_viz.segsum(data)  # asserts internally that every byte is accounted for
    assert "segments: 2" in text
    assert "total_reserved: 22.0MiB" in text     # 20 MiB large + 2 MiB small
    assert a.memory_reserved() == 22 * MiB


def test_trace_and_flamegraph_text_render(written):
    data, _ = written
    text = _memory_viz.trace(data)
    assert "cudaMalloc(" in text and "del " in text
    lines = _memory_viz.segments(data, format_flamegraph=lambda s: s)
    assert "active_allocated" in lines and "gelu" in lines
    mem = _memory_viz.memory(data, format_flamegraph=lambda s: s)
    # 5 MiB gelu + 1 KiB add (rounded) are live; requested sizes are what the flamegraph counts
    assert f" {5 * MiB}\n" in mem and " 600\n" in mem


def test_html_plots_render(written):
    data, _ = written
    assert "snapshot.pickle" in _memory_viz.trace_plot(data)
    assert "snapshot.pickle" in _memory_viz.segment_plot(data)


def test_oom_and_expandable_trace_render():
    ev = [AllocEvent("alloc", 1, 30 * MiB, label="a"), AllocEvent("alloc", 2, 200 * MiB, label="too_big")]
    r = replay(ev, AllocatorConfig.parse("expandable_segments:True"), 128 * MiB, record_trace=True)
    assert r.oom is not None
    data = snapshot(r.allocator)
    assert data["device_traces"][0][-1]["action"] == "oom"
    text = _memory_viz.trace(data)
    assert "raise OutOfMemoryError" in text
    assert "total_reserved: 40.0MiB" in _memory_viz.segsum(data)
