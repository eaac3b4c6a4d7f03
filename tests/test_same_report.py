"""Same inputs, same report: ``analyze --json`` in separate processes (different hash seeds, so set and dict
orders that depend on string hashes differ) gives identical JSON but for ``analysis_seconds``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_MAIN = "import sys; from boomfx.cli.main import main; sys.exit(main(sys.argv[1:]))"


def _reports(args: list[str]) -> list[dict]:
    procs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        procs.append(subprocess.Popen([sys.executable, "-c", _MAIN, "analyze", *args, "--json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True))
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        report = json.loads(out)
        assert report.pop("analysis_seconds") > 0
        reports.append(report)
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    [str(EXAMPLES / "gpt_tiny.pt2"), "--train", "--batch", "8", "--seq", "64"],
    [str(EXAMPLES / "gpt_tiny.pt2"), "--train", "--compile", "--batch", "8", "--seq", "64", "--device", "h100"],
    [str(EXAMPLES / "mlp.pt2"), "--device", "cpu", "--batch", "32", "--kernels"],
], ids=["gpt-train", "gpt-train-compile-h100", "mlp-cpu"])
def test_two_processes_write_the_same_report(args: list[str]) -> None:
    first, second = _reports(args + ["--db", "none"])
    assert first["time"]["total_ns"] > 0 and first["kernels"]
    assert first == second
