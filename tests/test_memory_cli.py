"""Memory answers from the CLI: out-of-memory verdicts, the exact largest batch, snapshots, traces."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from boomfx.analysis.analysis import Analysis
from boomfx.frontend.capture import capture
from boomfx.cli.main import main
from boomfx.core.devices import get_device


def test_max_batch_is_exact_at_the_boundary(capsys, examples_dir: Path) -> None:
    """The answer fits and one more does not, checked by evaluating both points independently."""
    path = str(examples_dir / "gpt2_small.pt2")
    assert main(["analyze", path, "--device", "t4", "--seq", "1024", "--max-batch", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["batch"]
    best, first_bad = found["largest_fitting"], found["first_failing"]
    assert first_bad == best + 1
    program = capture(path)
    analysis = Analysis(program, get_device("t4"))
    seq = program.symbol("seq").symbol
    batch = program.symbol("batch").symbol
    assert analysis.evaluate({seq: 1024, batch: best}).report.memory.fits
    over = analysis.evaluate({seq: 1024, batch: best + 1}).report.memory
    assert not over.fits and over.oom_node and over.margin_bytes < 0


def test_out_of_memory_names_the_op_and_module(capsys, examples_dir: Path) -> None:
    code = main(["analyze", str(examples_dir / "gpt2_small.pt2"), "--device", "t4", "--batch", "256",
                 "--seq", "1024", "--json"])
    assert code == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["fits"] is False and mem["margin_bytes"] < 0
    assert mem["oom_node"] and mem["oom_module"] is not None
    assert mem["total_device_bytes"] > mem["device_capacity_bytes"]


def test_expandable_segments_never_reserve_more(capsys, examples_dir: Path) -> None:
    args = ["analyze", str(examples_dir / "gpt_tiny.pt2"), "--device", "a10", "--batch", "16", "--seq", "200",
            "--train", "--json"]
    main(args)
    base = json.loads(capsys.readouterr().out)["memory"]["allocator"]
    main(args + ["--alloc-conf", "expandable_segments:True"])
    exp = json.loads(capsys.readouterr().out)["memory"]["allocator"]
    # expandable segments split blocks down to 512 B (should_split), so no block keeps an unsplit tail
    assert exp["peak_allocated_bytes"] <= base["peak_allocated_bytes"]
    assert exp["peak_reserved_bytes"] <= base["peak_reserved_bytes"]
    assert exp["fragmentation_bytes"] <= base["fragmentation_bytes"]
    assert exp["config"] == "expandable_segments:True"


def test_memory_snapshot_renders_with_torch_memory_viz(capsys, examples_dir: Path, tmp_path: Path) -> None:
    from torch.cuda import _memory_viz
    snap_path = tmp_path / "snap.pickle"
    assert main(["analyze", str(examples_dir / "gpt_tiny.pt2"), "--device", "a100-80gb", "--batch", "4",
                 "--seq", "32", "--memory-snapshot", str(snap_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    with open(snap_path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= actions
    assert any(frame["name"].startswith("linear") for e in snap["device_traces"][0] for frame in e["frames"])
    assert "segment" in _memory_viz.segsum(snap).lower()
    _memory_viz.trace(snap)
    html = _memory_viz.trace_plot(snap)
    assert "<html" in html.lower() or "script" in html.lower()
    # the reserved bytes of the snapshot's segments are what the report calls peak reserved
    assert sum(s["total_size"] for s in snap["segments"]) <= report["memory"]["allocator"]["peak_reserved_bytes"]


def test_memory_snapshot_needs_a_gpu_device(capsys, examples_dir: Path, tmp_path: Path) -> None:
    assert main(["analyze", str(examples_dir / "gpt_tiny.pt2"), "--device", "cpu", "--batch", "1", "--seq", "8",
                 "--memory-snapshot", str(tmp_path / "s.pickle")]) == 2
    assert "CUDA device" in capsys.readouterr().err


def test_chrome_trace_has_host_stream_and_memory_lanes(capsys, examples_dir: Path, tmp_path: Path) -> None:
    trace_path = tmp_path / "trace.json"
    assert main(["analyze", str(examples_dir / "gpt_tiny.pt2"), "--device", "h100", "--batch", "2", "--seq", "16",
                 "--trace", str(trace_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    events = json.loads(trace_path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"host (issue)", "stream 0"}
    stream = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(stream) == report["time"]["kernels"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in stream)
    assert any(e["args"]["module"] == "h.0.attn" for e in stream)
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and max(c["args"]["live_bytes"] for c in counters) > 0
    end_us = max(e["ts"] + e["dur"] for e in stream)
    assert end_us == pytest.approx(report["time"]["total_ns"] / 1e3)
