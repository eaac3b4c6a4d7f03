"""Cross-GPU prediction: kernels measured on one GPU, transferred to another by the GPU kernel model."""
from __future__ import annotations

from pathlib import Path

import pytest

from boomfx.analysis.analysis import analyze
from boomfx.cli.main import main

PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu-kernel-measurements"
pytestmark = pytest.mark.skipif(not PUBLIC.exists(), reason="the public GPU measurements are not next to this checkout")


@pytest.fixture(scope="module")
def a100_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    db = tmp_path_factory.mktemp("db") / "a100.sqlite"
    assert main(["kernels", "import", str(PUBLIC), "--device", "a100-pcie-40gb", "--db", str(db)]) == 0
    return str(db)


def _gpt2ish(tmp_path: Path) -> str:
    import torch
    from torch.export import Dim

    from models import GPT
    with torch.device("meta"):
        model = GPT(vocab=4096, d=1024, layers=2, heads=16, max_seq=2048)
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    ep = torch.export.export(model, (idx,), dynamic_shapes={"idx": {0: Dim("batch", min=1, max=64),
                                                                     1: Dim("seq", min=2, max=2048)}})
    path = tmp_path / "gpt.pt2"
    torch.export.save(ep, str(path))
    return str(path)


def test_transfer_labels_and_differs_from_source(a100_db: str, tmp_path: Path) -> None:
    path = _gpt2ish(tmp_path)
    source = analyze(path, device="a100-pcie-40gb", db=a100_db, batch=8, seq=512)
    target = analyze(path, device="h100-sxm", from_db=a100_db, batch=8, seq=512)
    src = {k.node: k for k in source.kernels}
    transferred = [k for k in target.kernels if k.source == "transferred"]
    assert transferred, "matmuls measured on the A100 must be transferred to the H100"
    for k in transferred:
        assert src[k.node].source in ("measured", "interpolated")
        assert k.time_ns < src[k.node].time_ns          # an H100 runs an fp32 GEMM faster than an A100
    assert any(g.name == "transferred" for g in target.by_source)


def test_transfer_to_the_same_gpu_returns_the_measurement(a100_db: str, tmp_path: Path) -> None:
    path = _gpt2ish(tmp_path)
    direct = analyze(path, device="a100-pcie-40gb", db=a100_db, batch=4, seq=256)
    via = analyze(path, device="a100-pcie-40gb", from_db=a100_db, batch=4, seq=256)
    measured = {k.node: k.time_ns for k in direct.kernels if k.source in ("measured", "interpolated")}
    assert measured
    for k in via.kernels:
        if k.node in measured:
            assert k.source == "transferred" and k.time_ns == pytest.approx(measured[k.node], rel=1e-12)


def test_from_db_needs_a_gpu_target(a100_db: str, capsys, tmp_path: Path) -> None:
    assert main(["analyze", _gpt2ish(tmp_path), "--device", "cpu", "--from-db", a100_db, "--batch", "1",
                 "--seq", "8"]) == 2
    assert "needs a CUDA target" in capsys.readouterr().err
