"""Shared fixtures: small models exported once per session (on meta for analysis, on CPU for real runs)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from models import GPT, MLP, Llama, SmallCNN  # noqa: E402

TOKEN_DIMS = {"idx": {0: Dim("batch", min=1, max=512), 1: Dim("seq", min=2, max=256)}}


def make_model(name: str, device: str = "cpu") -> tuple[torch.nn.Module, tuple, dict]:
    """(model, example inputs, dynamic shapes) for one of the test models."""
    torch.manual_seed(0)
    with torch.device(device):
        if name == "mlp":
            return MLP(), (torch.randn(4, 64),), {"x": {0: Dim("batch", min=1, max=4096)}}
        if name == "cnn":
            return SmallCNN(), (torch.randn(2, 3, 16, 16),), {"x": {0: Dim("batch", min=1, max=512)}}
        if name == "gpt":
            return GPT(vocab=128, d=32, layers=2, heads=4, max_seq=256), (torch.randint(0, 128, (2, 8)),), TOKEN_DIMS
        if name == "llama":
            return Llama(vocab=128, d=32, layers=2, heads=4, kv_heads=2, hidden=64), \
                (torch.randint(0, 128, (2, 8)),), TOKEN_DIMS
    raise KeyError(name)


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """Factory: exported(name, device="meta") -> (ExportedProgram, path of the saved .pt2)."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("exports")

    def get(name: str, device: str = "meta"):
        key = (name, device)
        if key not in cache:
            model, inputs, dynamic = make_model(name, device)
            if name == "cnn":
                model.eval()
            ep = torch.export.export(model, inputs, dynamic_shapes=dynamic)
            path = root / f"{name}-{device}.pt2"
            torch.export.save(ep, str(path))
            cache[key] = (ep, str(path))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return ROOT / "examples"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("BOOMFX_NO_PROGRESS", "1")
