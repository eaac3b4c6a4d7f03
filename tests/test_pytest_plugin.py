"""The ``boomfx_baseline`` fixture: create, pass, fail with a readable diff, update."""
from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

MODEL_TEST = """
import torch

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), torch.randn(4, 16)

def test_mlp(boomfx_baseline):
    model, x = make()
    boomfx_baseline(model, x, device="a100-80gb"{extra})
"""


@pytest.fixture(autouse=True, scope="module")
def _warm_imports():
    """Import everything an analysis imports lazily before the in-process runs: pytester drops
    modules first imported inside a run, and torch cannot register its op libraries twice."""
    import torch

    import boomfx
    boomfx.analyze(torch.nn.Linear(2, 2), torch.randn(1, 2), device="a100-80gb")


def _write_test(pytester: pytest.Pytester, extra: str = "") -> None:
    pytester.makepyfile(test_model=MODEL_TEST.format(extra=extra))


def _baseline(pytester: pytest.Pytester) -> dict:
    return json.loads((pytester.path / "boomfx_baselines" / "test_mlp.json").read_text())


def _scale_metric(pytester: pytest.Pytester, field: str, factor: float) -> None:
    path = pytester.path / "boomfx_baselines" / "test_mlp.json"
    data = json.loads(path.read_text())
    data["metrics"][field] *= factor
    path.write_text(json.dumps(data))


def test_missing_baseline_fails_and_says_how_to_create_it(pytester):
    _write_test(pytester)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*boomfx: no baseline at *test_mlp.json*", "*pytest --boomfx-update*"])


def test_update_writes_a_small_readable_baseline_then_passes(pytester):
    _write_test(pytester)
    pytester.runpytest("--boomfx-update").assert_outcomes(passed=1)
    data = _baseline(pytester)
    assert set(data) == {"boomfx_baseline", "schema_version", "test", "context", "metrics"}
    assert set(data["metrics"]) == {"time_ns", "peak_allocated_bytes", "peak_reserved_bytes", "flops"}
    assert data["context"]["device"] == "a100-80gb" and data["context"]["mode"] == "inference"
    # Linear(16,32): 2*4*16*32 + 4*32 = 4224; Linear(32,8): 2*4*32*8 + 4*8 = 2080; relu: 128 -> >= 6304
    assert data["metrics"]["flops"] >= 4224 + 2080
    text = (pytester.path / "boomfx_baselines" / "test_mlp.json").read_text()
    assert len(text) < 1000
    pytester.runpytest().assert_outcomes(passed=1)           # deterministic: the same numbers again


def test_change_inside_tolerance_passes(pytester):
    _write_test(pytester)
    pytester.runpytest("--boomfx-update").assert_outcomes(passed=1)
    _scale_metric(pytester, "time_ns", 1.03)                 # default time tolerance is 5%
    pytester.runpytest().assert_outcomes(passed=1)


def test_change_outside_tolerance_fails_with_a_diff_table(pytester):
    _write_test(pytester)
    pytester.runpytest("--boomfx-update").assert_outcomes(passed=1)
    _scale_metric(pytester, "time_ns", 1.25)
    _scale_metric(pytester, "peak_reserved_bytes", 2.0)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*boomfx: predicted time, peak_reserved outside tolerance of the baseline*",
        "*metric*baseline*current*change*tolerance*",
        "*time_ns*-20.00%*5.00%*FAIL*",
        "*peak_allocated_bytes*+0.00%*1.00%*ok*",
        "*peak_reserved_bytes*-50.00%*1.00%*FAIL*",
        "*flops*+0.00%*0.00%*ok*",
        "*--boomfx-update*",
    ])
    assert "Traceback" not in result.stdout.str()


def test_per_call_tolerance_overrides_the_default(pytester):
    _write_test(pytester, extra=', rtol={"time": 0.5}')
    pytester.runpytest("--boomfx-update").assert_outcomes(passed=1)
    _scale_metric(pytester, "time_ns", 1.25)
    pytester.runpytest().assert_outcomes(passed=1)


def test_update_rewrites_a_stale_baseline(pytester):
    _write_test(pytester)
    pytester.runpytest("--boomfx-update").assert_outcomes(passed=1)
    fresh = _baseline(pytester)
    _scale_metric(pytester, "flops", 3.0)
    pytester.runpytest().assert_outcomes(failed=1)
    result = pytester.runpytest("--boomfx-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*boomfx: wrote 1 baseline(s)*"])
    assert _baseline(pytester) == fresh
    pytester.runpytest().assert_outcomes(passed=1)


def test_changed_context_fails_instead_of_comparing(pytester):
    _write_test(pytester)
    pytester.runpytest("--boomfx-update").assert_outcomes(passed=1)
    _write_test(pytester, extra=', batch=None, dims={}, optimizer="sgd", train=True')
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*recorded for a different context*", "*mode: 'inference' -> 'train'*"])
