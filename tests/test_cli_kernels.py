"""`boomfx kernels collect|import|export|info` and analysis priced from a collected database."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from boomfx.cli import main

PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu-kernel-measurements"


def test_collect_for_model_then_nothing_left(capsys, exported, tmp_path: Path) -> None:
    _, path = exported("mlp")
    db = tmp_path / "cpu.sqlite"
    assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "16", "--db", str(db),
                 "--quiet"]) == 0
    first = capsys.readouterr().out
    assert "measured 4," in first and "failed 0" in first       # 3 linear + 2 relu: relu shapes repeat? see below
    assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "16", "--db", str(db),
                 "--quiet"]) == 0
    second = capsys.readouterr().out
    assert "measured 0," in second and "already present 4" in second
    assert main(["analyze", path, "--batch", "16", "--device", "cpu", "--db", str(db), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k["source"] for k in report["kernels"]} == {"measured"}
    assert report["by_source"][0]["name"] == "measured" and report["by_source"][0]["share"] == 1.0


def test_export_import_round_trip(capsys, exported, tmp_path: Path) -> None:
    _, path = exported("mlp")
    db, csv, db2 = tmp_path / "a.sqlite", tmp_path / "a.csv", tmp_path / "b.sqlite"
    main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "3", "--db", str(db), "--quiet"])
    assert main(["kernels", "export", str(csv), "--db", str(db)]) == 0
    assert main(["kernels", "import", str(csv), "--db", str(db2)]) == 0
    capsys.readouterr()
    main(["kernels", "info", "--db", str(db2)])
    info = capsys.readouterr().out
    assert "aten.linear.default: 3" in info


@pytest.mark.skipif(not PUBLIC.exists(), reason="the public GPU measurements are not next to this checkout")
def test_import_public_measurements_per_device(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["kernels", "import", str(PUBLIC), "--device", "p4"]) == 0
    out = capsys.readouterr().out
    assert "p4: 1760 new rows of 1760" in out
    assert main(["kernels", "import", str(PUBLIC), "--device", "p4"]) == 0      # idempotent
    assert "p4: 0 new rows of 1760" in capsys.readouterr().out
    assert (tmp_path / "boomfx" / "kernels-p4.sqlite").exists()


def test_bad_kernels_input(capsys, tmp_path: Path) -> None:
    assert main(["kernels", "export", str(tmp_path / "x.csv"), "--db", str(tmp_path / "missing.sqlite")]) == 2
    assert main(["kernels", "collect", "--device", "tpu"]) == 2
    assert main(["kernels", "collect", "--budget", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.count("boomfx: error:") == 3 and "Traceback" not in err
