"""The command line end to end, including every kind of bad input (one line on stderr, exit 2)."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from boomfx.cli.main import main


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_prints_summary(capsys, examples_dir: Path) -> None:
    code, out, err = run(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "4", "--seq", "32",
                         "--device", "a100-80gb")
    assert code == 0, err
    assert "Predicted step time" in out and "FITS" in out
    assert "peak reserved" in out and "Time by op" in out


def test_json_holds_everything_the_summary_shows(capsys, examples_dir: Path) -> None:
    code, out, _ = run(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "4", "--seq", "32",
                       "--device", "h100", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema_version"].startswith("1.")
    assert data["device"] == "h100-sxm"
    assert {s["role"]: s["value"] for s in data["symbols"]} == {"batch": 4, "seq": 32}
    for key in ("total_ns", "device_busy_ns", "host_busy_ns", "kernels", "flops", "bytes_moved"):
        assert key in data["time"]
    mem = data["memory"]
    for key in ("peak_live_bytes", "by_category_bytes", "allocator", "fits", "margin_bytes",
                "outside_allocator_bytes", "device_capacity_bytes"):
        assert key in mem
    assert mem["allocator"]["peak_reserved_bytes"] >= mem["allocator"]["peak_allocated_bytes"]
    assert data["by_module"] and data["by_op"] and data["by_source"]
    assert abs(sum(g["share"] for g in data["by_source"]) - 1.0) < 1e-9
    assert len(data["kernels"]) == data["time"]["kernels"]


def test_static_export_needs_no_dims(capsys, tmp_path: Path) -> None:
    import torch
    model = torch.nn.Linear(8, 4)
    ep = torch.export.export(model, (torch.randn(3, 8),))
    path = tmp_path / "static.pt2"
    torch.export.save(ep, str(path))
    code, out, err = run(capsys, "analyze", str(path), "--device", "t4")
    assert code == 0, err
    assert "dims: static" in out


def test_devices_lists_required_gpus(capsys) -> None:
    code, out, _ = run(capsys, "devices")
    assert code == 0
    for name in ("v100-32gb", "t4", "a10", "l4", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200",
                 "rtx-3090", "rtx-4090", "cpu"):
        assert name in out


def test_sweep_table(capsys, examples_dir: Path) -> None:
    code, out, err = run(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--sweep", "batch=1,2,4",
                         "--sweep", "seq=16,64", "--device", "a10", "--json")
    assert code == 0, err
    points = json.loads(out)["points"]
    assert len(points) == 6
    by_key = {(p["batch"], p["seq"]): p for p in points}
    assert by_key[(4, 64)]["peak_allocated_bytes"] > by_key[(1, 16)]["peak_allocated_bytes"]
    assert by_key[(4, 64)]["time_ns"] > by_key[(1, 16)]["time_ns"]


# ----------------------------------------------------------------------------------------------------
# bad input: one clear line on stderr, exit status 2, no traceback
# ----------------------------------------------------------------------------------------------------

def _bad(capsys, *argv: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("boomfx: error:")
    return lines[0]


def test_missing_file(capsys, tmp_path: Path) -> None:
    assert "does not exist" in _bad(capsys, "analyze", str(tmp_path / "nope.pt2"), "--batch", "1")


def test_not_a_pt2(capsys, tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    assert "not a .pt2 file" in _bad(capsys, "analyze", str(path))


def test_corrupt_archive(capsys, tmp_path: Path, examples_dir: Path) -> None:
    data = (examples_dir / "gpt_tiny.pt2").read_bytes()
    path = tmp_path / "truncated.pt2"
    path.write_bytes(data[: len(data) // 2])
    _bad(capsys, "analyze", str(path), "--batch", "1", "--seq", "8")


def test_archive_without_model_json(capsys, tmp_path: Path) -> None:
    path = tmp_path / "empty.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/version", "1")
    _bad(capsys, "analyze", str(path))


def test_unknown_device(capsys, examples_dir: Path) -> None:
    line = _bad(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "1", "--seq", "8", "--device", "tpu9")
    assert "unknown device 'tpu9'" in line


def test_unbound_symbol(capsys, examples_dir: Path) -> None:
    line = _bad(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "2")
    assert "unbound" in line and "seq" in line


def test_value_outside_exported_range(capsys, examples_dir: Path) -> None:
    line = _bad(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "2", "--seq", "100000")
    assert "outside the exported range" in line


def test_unknown_dimension_name(capsys, examples_dir: Path) -> None:
    line = _bad(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--dim", "width=3", "--batch", "1", "--seq", "8")
    assert "unknown dimension 'width'" in line


@pytest.mark.parametrize("option", [["--amp", "fp8"], ["--optimizer", "lion", "--train"], ["--checkpoint"],
                                    ["--alloc-conf", "max_split_size_mb:abc"], ["--dim", "s0"]])
def test_unknown_option_values(capsys, examples_dir: Path, option: list[str]) -> None:
    _bad(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "1", "--seq", "8", *option)


def test_unknown_flag(capsys, examples_dir: Path) -> None:
    _bad(capsys, "analyze", str(examples_dir / "gpt_tiny.pt2"), "--frobnicate")


def test_console_script_entry_point(examples_dir: Path, tmp_path: Path) -> None:
    """The installed `boomfx` script runs (a separate process, as a user would)."""
    exe = Path(sys.executable).with_name("boomfx")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "boomfx.cli.main"]
    proc = subprocess.run(cmd + ["analyze", str(tmp_path / "missing.pt2")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


# a bug in a deep stage (here: the point evaluation raising as an inconsistent graph would): one line that
# says it is boomfx's, exit status 70; BOOMFX_TRACEBACK=1 lets it escape with its traceback
def test_an_internal_error_is_one_line_and_exit_70(capsys, monkeypatch, examples_dir: Path) -> None:
    from boomfx.analysis.analysis import Analysis
    from boomfx.cli.main import EXIT_INTERNAL, TRACEBACK_ENV

    def broken(self, *args, **kwargs):
        raise RuntimeError("mismatch in length of strides and shape\nsecond line")

    monkeypatch.setattr(Analysis, "evaluate", broken)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    code, out, err = run(capsys, "analyze", str(examples_dir / "mlp.pt2"), "--batch", "2")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_INTERNAL == 70 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("boomfx: internal error: RuntimeError: mismatch in length of strides and shape (")
    assert TRACEBACK_ENV in lines[0] and "second line" not in err
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(RuntimeError, match="mismatch in length"):
        main(["analyze", str(examples_dir / "mlp.pt2"), "--batch", "2"])
