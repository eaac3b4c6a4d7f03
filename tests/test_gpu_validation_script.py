"""benchmarks/gpu_validation.py: its --dry-run path on CPU (tiny models, tiny budgets), the error table
arithmetic, and (with CUDA only) the snapshot stage feeding the replay test."""
from __future__ import annotations

import csv
import importlib.util
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _script():
    return _load("gpu_validation", ROOT / "benchmarks" / "gpu_validation.py")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    gv = _script()
    out = tmp_path_factory.mktemp("gpu_validation")
    rc = gv.main(["--dry-run", "--out", str(out), "--cases",
                  "gpt2-train-fp32,resnet-inference-fp32,gpt2-fwdbwd-pure-bf16"])
    return gv, out, rc


def test_dry_run_writes_every_artefact(dry_run) -> None:
    _, out, rc = dry_run
    assert rc == 0
    results = json.loads((out / "gpu_validation.json").read_text())
    assert results["dry_run"] is True and results["target"] == "cpu"
    stages = results["stages"]
    assert list(stages) == ["export", "capture", "snapshot", "measure", "collect", "predict", "blocks", "report"]
    assert {name: st["status"] for name, st in stages.items()} == {name: "ok" for name in stages}
    assert results["snapshot"] == "skipped: needs CUDA"
    assert set(results["cases"]) == {"gpt2-train-fp32", "resnet-inference-fp32", "gpt2-fwdbwd-pure-bf16"}
    for name, case in results["cases"].items():
        assert case["measured"]["time_ns"] > 0 and len(case["measured"]["samples_ns"]) >= 5, name
        assert case["predicted"]["time_ns"] > 0 and case["predicted_no_db"]["time_ns"] > 0, name
        assert case["predicted_blocks"]["time_ns"] > 0, name
    # both models have repeated blocks (GPT-2 layers, ResNet bottlenecks): measured whole on the CPU
    assert results["cases"]["gpt2-train-fp32"]["blocks"]["measured"] == ["transformer.h.*"]
    assert "block-measured" in results["cases"]["gpt2-train-fp32"]["predicted_blocks"]["by_source"]
    with open(out / "kernels.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == results["db_rows"] > 0
    assert {"block", "aten.addmm.default"} <= {r["op"] for r in rows}
    md = (out / "gpu_validation.md").read_text()
    assert "| gpt2-train-fp32 |" in md and "| resnet-inference-fp32 |" in md


def test_every_case_profiles_one_step_and_lists_predicted_ops(dry_run) -> None:
    gv, out, _ = dry_run
    results = json.loads((out / "gpu_validation.json").read_text())
    for name, case in results["cases"].items():
        ops = {r["name"] for r in case["measured"]["profile"]["aten_ops"]}
        assert "aten::addmm" in ops or "aten::convolution" in ops, name
        assert case["predicted"]["by_op_ns"], name
    # pure bf16 forward+backward: bf16 weights, no optimizer in the run nor in the prediction
    pure = results["cases"]["gpt2-fwdbwd-pure-bf16"]
    assert "aten::_foreach_add_" not in {r["name"] for r in pure["measured"]["profile"]["aten_ops"]}
    assert pure["predicted"]["optimizer_phase_ns"] > 0
    assert (out / "kernels_by_op.md").read_text().count("## ") == 3


def test_full_run_covers_precisions_modes_and_phases(dry_run) -> None:
    gv = dry_run[0]
    full = gv.cases(dry_run=False)
    assert len({c.name for c in full}) == len(full)
    kinds = {(c.precision, c.compiled, c.train, c.fwd_bwd_only) for c in full}
    for precision in ("fp32", "bf16", "pure-bf16"):
        assert any(k[0] == precision and k[2] for k in kinds), precision      # trained in every precision
    assert any(k[1] for k in kinds) and any(not k[1] for k in kinds)          # eager and compiled
    assert any(k[3] for k in kinds) and any(not k[2] for k in kinds)          # fwd+bwd only, inference


def test_op_rows_pair_profiler_and_prediction(dry_run) -> None:
    gv = dry_run[0]
    case = {"measured": {"profile": {"aten_ops": [{"name": "aten::mm", "time_ns": 2e6}]}},
            "predicted_no_db": {"by_op_ns": {"aten.mm.default": 1.5e6, "aten.add.Tensor": 1e5}}}
    rows = gv.op_rows(case)
    assert rows[0] == {"op": "aten::mm", "measured_ns": 2e6, "predicted_ns": 1.5e6, "error": pytest.approx(-0.25)}
    assert rows[1]["op"] == "aten::add" and rows[1]["measured_ns"] is None


def test_error_table_arithmetic(dry_run) -> None:
    gv = dry_run[0]
    results = {"cases": {"x": {
        "measured": {"time_ns": 2e6, "max_memory_allocated_bytes": 1000, "max_memory_reserved_bytes": 2000},
        "predicted": {"time_ns": 3e6, "peak_allocated_bytes": 900, "peak_reserved_bytes": 2000,
                      "by_source": {"measured": 0.75}},
        "predicted_no_db": {"time_ns": 1e6}}}}
    (row,) = gv.error_rows(results)
    assert row["time_error"] == pytest.approx(0.5)          # 3 ms / 2 ms - 1
    assert row["time_error_no_db"] == pytest.approx(-0.5)   # 1 ms / 2 ms - 1
    assert row["alloc_error"] == pytest.approx(-0.1)        # 900 / 1000 - 1
    assert row["reserved_error"] == 0.0
    assert row["time_error_blocks"] is None                 # not predicted: a dash in the table
    md = gv.markdown(results)
    assert "| x | 2.000 | 3.000 | +50.0% | -50.0% | - | -10.0% | +0.0% | 0.75 |" in md


def test_a_failing_stage_does_not_stop_the_others(dry_run, tmp_path: Path) -> None:
    gv = dry_run[0]
    run = gv.Run(tmp_path, True, torch.device("cpu"), None, float("inf"), [])
    assert run.stage("boom", lambda: 1 / 0) is None
    assert run.stage("fine", lambda: 42) == 42
    saved = json.loads((tmp_path / "gpu_validation.json").read_text())["stages"]
    assert saved["boom"]["status"] == "error" and "ZeroDivisionError" in saved["boom"]["error"]
    assert saved["fine"]["status"] == "ok"


def _replay_helpers():
    return _load("snapshot_replay", ROOT / "tests" / "test_snapshot_replay.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator snapshot needs a CUDA device")
def test_snapshot_stage_writes_a_replayable_snapshot(dry_run, tmp_path: Path) -> None:
    gv, helpers = dry_run[0], _replay_helpers()
    case = gv.Case("gpt2", True, None, 2, 16)
    run = gv.Run(tmp_path, True, torch.device("cuda"), None, float("inf"), [case])
    path = gv.stage_snapshot(run)
    with open(path, "rb") as fh:
        snapshot = pickle.load(fh)
    assert helpers.complete_history_problem(snapshot) == ""
    rec, rep = helpers.recorded(snapshot), helpers.replay_snapshot(snapshot)
    assert rep.segment_sizes == rec.segment_sizes
    assert rep.peak_reserved_bytes == rec.peak_reserved_bytes
