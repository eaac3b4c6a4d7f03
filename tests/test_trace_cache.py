"""A re-traced step is reused for the same archive content and trace options (boomfx/frontend/trace_cache.py),
and its reuse predicts exactly what a fresh trace predicts."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import boomfx
from boomfx.core.program import EAGER_PROGRAM, ProgramOptions
from boomfx.frontend import trace_cache
from boomfx.frontend.capture import capture

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPT = str(EXAMPLES / "gpt_tiny.pt2")
MLP = str(EXAMPLES / "mlp.pt2")
TRAIN = ProgramOptions(train=True)


@pytest.fixture(autouse=True)
def empty_cache():
    trace_cache.clear_traces()
    yield
    trace_cache.clear_traces()


def _summary(report) -> tuple:
    return (report.time.total_ns, report.time.flops, report.memory.peak_live_bytes,
            report.memory.total_device_bytes, [(k.node, k.op, k.time_ns, k.bytes_moved) for k in report.kernels])


def test_a_second_capture_of_the_same_file_reuses_the_trace() -> None:
    first = capture(GPT, options=TRAIN)
    messages: list[str] = []
    second = capture(GPT, options=TRAIN, log=messages.append)
    assert second.gm is first.gm and second is not first
    assert any("reused the step traced earlier" in m for m in messages)
    assert second.derived == {} and second.source == GPT


def test_other_trace_options_trace_again() -> None:
    fp32 = capture(GPT, options=TRAIN)
    for options in (ProgramOptions(train=True, amp="bf16"), ProgramOptions(train=True, optimizer="sgd"),
                    ProgramOptions(train=True, target_kind="cpu"), ProgramOptions(train=True, checkpoint=True)):
        assert capture(GPT, options=options).gm is not fp32.gm, options


def test_reuse_predicts_what_a_fresh_trace_predicts() -> None:
    """Analyses under other bindings and devices, then --compile, on the kept trace equal fresh ones."""
    runs = [dict(device="h100-sxm", batch=2, seq=16), dict(device="a100-80gb", batch=4, seq=32),
            dict(device="h100-sxm", batch=2, seq=16, compile=True)]
    reused = [_summary(boomfx.analyze(GPT, train=True, **run)) for run in runs]
    fresh = []
    for run in runs:
        trace_cache.clear_traces()
        fresh.append(_summary(boomfx.analyze(GPT, train=True, **run)))
    assert reused == fresh


def test_compile_starts_from_the_kept_eager_trace() -> None:
    eager = capture(GPT, options=TRAIN)
    compiled = capture(GPT, options=ProgramOptions(train=True, compile=True))
    kept = compiled.derived[EAGER_PROGRAM]
    assert kept.gm is eager.gm and compiled.gm is not eager.gm
    assert kept.options.compile and not eager.options.compile   # each Program keeps the options it was asked for


def test_the_same_path_with_other_bytes_is_traced_again(tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    shutil.copy(MLP, path)
    mlp = capture(str(path), options=TRAIN)
    shutil.copy(GPT, path)
    gpt = capture(str(path), options=TRAIN)
    assert gpt.gm is not mlp.gm
    assert len(gpt.graph.nodes) == len(capture(GPT, options=TRAIN).graph.nodes)


def test_in_memory_exports_are_not_kept() -> None:
    ep = torch.export.load(MLP)
    assert capture(ep, options=TRAIN).gm is not capture(ep, options=TRAIN).gm


def _kept_optimizers() -> list[tuple[str, object]]:
    return [(key[1].optimizer, key[1].amp) for key in trace_cache._TRACES]


def test_at_most_max_traces_are_kept() -> None:
    """Least recently used out: a hit counts as a use."""
    optimizers = ("adamw", "adam", "sgd", "none")
    assert len(optimizers) == trace_cache.MAX_TRACES
    first = capture(MLP, options=ProgramOptions(train=True, optimizer=optimizers[0]))
    for optimizer in optimizers[1:]:
        capture(MLP, options=ProgramOptions(train=True, optimizer=optimizer))
    assert capture(MLP, options=ProgramOptions(train=True)).gm is first.gm   # a hit: adamw is now the newest
    capture(MLP, options=ProgramOptions(train=True, amp="bf16"))             # a fifth: adam, the oldest, goes
    assert _kept_optimizers() == [("sgd", None), ("none", None), ("adamw", None), ("adamw", "bf16")]
