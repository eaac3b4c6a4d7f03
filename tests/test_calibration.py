"""``validate --calibrate``: in-situ factors measured on one model change another model's prediction
only through the op classes the two share, each shared kernel by exactly its class's factor."""
from __future__ import annotations

import pytest
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.core.devices import cpu_spec
from boomfx.kernels_db.calibration import op_class_of, read_calibration, write_calibration
from boomfx.core.program import ProgramOptions
from boomfx.validate import validate
from boomfx.validate.calibration import calibration_factors

from conftest import make_model


def _gpt_kernels(db: str) -> list:
    model, inputs, dynamic = make_model("gpt")
    ep = torch.export.export(model, inputs, dynamic_shapes=dynamic)
    program = capture(ep, options=ProgramOptions(target_kind="cpu"))
    bindings = resolve_bindings(program, {}, 4, 32)
    return Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db=db)).evaluate(bindings).report.kernels


def test_calibration_on_mlp_moves_gpt_only_through_shared_op_classes(tmp_path) -> None:
    db = tmp_path / "cpu.db"
    write_calibration(db, {}, "empty", 1)            # a database file with no kernel rows: roofline prices
    r = validate("examples/mlp.pt2", batch=64, db=str(db), threads=1, repeats=5, calibrate=True)
    factors = r.calibration["factors"]
    stored = read_calibration(db)
    assert set(stored) == set(factors) and "linear" in factors     # the MLP's matmuls are linear in its export
    assert all(stored[k].factor == pytest.approx(v) for k, v in factors.items())
    assert all(c.measured_on.startswith("examples/mlp.pt2") for c in stored.values())
    base, calibrated = _gpt_kernels("none"), _gpt_kernels(str(db))
    assert [k.node for k in base] == [k.node for k in calibrated]
    shared = unshared = 0
    for b, c in zip(base, calibrated):
        cls = op_class_of(b.op)
        if cls in factors:
            shared += 1
            assert c.time_ns == pytest.approx(b.time_ns * factors[cls], rel=1e-9), (b.node, cls)
        else:
            unshared += 1
            assert c.time_ns == b.time_ns, (b.node, cls)
    assert shared and unshared       # GPT shares linear with the MLP, not layer_norm or attention


def test_factor_is_in_situ_over_predicted_and_compounds() -> None:
    """factor = (profiled op time x median / profiled step) / predicted, times any earlier factor."""
    from boomfx.validate.result import OpComparison, ValidationResult
    ops = (OpComparison("addmm", 100.0, 400.0, 1, 1), OpComparison("relu", 50.0, 0.5, 1, 1),
           OpComparison("gelu", 0.0, 80.0, 0, 1))
    r = ValidationResult("m", "cpu", "inference", {}, {}, False, 1, 150.0, 300.0, (300.0,), 0, 0, 0, 0, None,
                         "profiler", ops, 600.0, 0.0, 0.0, None, {}, (0.0, 0.0, 0.0))
    # addmm: 400 ns in a 600 ns profiled step whose unprofiled median is 300 ns -> 200 ns in situ; / 100
    # relu: 0.25 ns in situ < 1% of 300 ns: skipped; gelu: not predicted: skipped
    assert calibration_factors(r, {}) == {"addmm": pytest.approx(2.0)}
    assert calibration_factors(r, {"addmm": 1.5}) == {"addmm": pytest.approx(3.0)}


def test_calibrate_needs_a_database(capsys) -> None:
    from boomfx.cli.main import main
    assert main(["validate", "examples/mlp.pt2", "--db", "none", "--calibrate", "--batch", "4"]) == 2
    assert "--calibrate" in capsys.readouterr().err
