"""Liveness peak vs the peak of live tensor storages in a real CPU run of the same graph."""
from __future__ import annotations

import pytest
import torch
from torch.export.graph_signature import InputKind

from boomfx.capture import capture, resolve_bindings
from boomfx.live_bytes import measure_live_bytes
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.liveness import Category, liveness_pass


def flat_args(ep: torch.export.ExportedProgram, user_inputs: tuple) -> list:
    args, users = [], iter(user_inputs)
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            args.append(ep.state_dict[spec.target])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            args.append(ep.constants[spec.target])
        else:
            args.append(next(users))
    return args


def user_inputs_for(name: str, batch: int, seq: int) -> tuple:
    if name == "mlp":
        return (torch.randn(batch, 64),)
    if name == "cnn":
        return (torch.randn(batch, 3, 16, 16),)
    return (torch.randint(0, 128, (batch, seq)),)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "llama"])
@pytest.mark.parametrize("batch,seq", [(2, 8), (5, 37), (3, 128)])
def test_inference_peak_matches_real_run(exported, name: str, batch: int, seq: int) -> None:
    ep, _ = exported(name, "cpu")
    program = capture(ep)
    info = liveness_pass(program)
    bindings = resolve_bindings(program, {}, batch=batch, seq=seq if name in ("gpt", "llama") else None)
    predicted = info.peak(Evaluator(bindings)).live_bytes
    with torch.no_grad():
        measured = measure_live_bytes(ep.graph_module, *flat_args(ep, user_inputs_for(name, batch, seq)))
    assert predicted == pytest.approx(measured.peak_bytes, rel=0.01)


def test_views_and_splits_share_storage(exported) -> None:
    """The qkv projection is split and viewed three ways; its storage is counted once."""
    ep, _ = exported("gpt", "meta")
    info = liveness_pass(capture(ep))
    creators = [iv.node for iv in info.intervals]
    assert not any(name.startswith(("split", "getitem", "view", "transpose")) for name in creators)
    assert len(creators) == len(set(creators))


def test_resident_inputs_and_categories(exported) -> None:
    ep, _ = exported("mlp", "meta")
    program = capture(ep)
    info = liveness_pass(program)
    ev = Evaluator(resolve_bindings(program, {}, batch=10))
    params = [iv for iv in info.intervals if iv.category is Category.PARAM]
    # fc1 64x256+256, fc2 256x256+256, out 256x10+10 fp32 parameters
    assert sum(ev(iv.nbytes) for iv in params) == 4 * (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10)
    assert all(iv.resident for iv in params)
    inputs = [iv for iv in info.intervals if iv.category is Category.INPUT]
    assert [ev(iv.nbytes) for iv in inputs] == [10 * 64 * 4]
