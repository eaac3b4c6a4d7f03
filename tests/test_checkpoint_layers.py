"""Selective activation checkpointing (``ProgramOptions.checkpoint_layers``, ``--checkpoint-layers``):
only the named layer instances are recomputed, predictions land between no and full checkpointing,
unknown names fail cleanly, and the depth-free trace agrees with the full one."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

import boomfx
from boomfx.training import truncate as fast_training
from boomfx.training import trace as training
from boomfx.analysis.analysis import Analysis
from boomfx.frontend.capture import capture, export_roles, program_from_traced, resolve_bindings, symbols_of
from boomfx.cli.main import main
from boomfx.core.devices import get_device
from boomfx.core.errors import OptionError
from boomfx.core.layers import layer_of, module_path
from boomfx.core.program import ProgramOptions

from models import GPT  # examples/ (conftest puts it on the path)

ROOT = Path(__file__).resolve().parents[1]
DIMS = {"idx": {0: Dim("batch", min=1, max=512), 1: Dim("seq", min=2, max=256)}}


def _export_gpt(layers: int) -> Any:
    with torch.device("meta"):
        model = GPT(vocab=128, d=32, layers=layers, heads=4, max_seq=256)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    return torch.export.export(model, (ids,), dynamic_shapes=DIMS)


@pytest.fixture(scope="module")
def gpt3() -> Any:
    return _export_gpt(3)


def _recomputed_layers(traced: Any) -> set[str]:
    return {layer_of(module_path(n)) for n in traced.gm.graph.nodes
            if traced.phases.get(n.name) == "recompute"}


def test_subset_recomputes_only_the_chosen_layers(gpt3: Any) -> None:
    traced = training.build_training_program(gpt3, checkpoint_layers=["h.0", "h.2"])
    assert _recomputed_layers(traced) == {"h.0", "h.2"}
    one = training.build_training_program(gpt3, checkpoint_layers=("h.1",), checkpoint=True)  # the list wins
    assert _recomputed_layers(one) == {"h.1"}


def test_predictions_are_monotone_in_the_selection(gpt3: Any) -> None:
    """Peak memory: none >= subset >= all; step time: none <= subset <= all."""
    device = get_device("h100-sxm")
    results = []
    for options in (ProgramOptions(train=True), ProgramOptions(train=True, checkpoint_layers=("h.0", "h.1")),
                    ProgramOptions(train=True, checkpoint=True)):
        program = capture(gpt3, options=options)
        report = Analysis(program, device).evaluate(resolve_bindings(program, {}, 16, 128)).report
        results.append((report.memory.allocator.peak_allocated_bytes, report.memory.peak_live_bytes,
                        report.time.total_ns))
    peaks, live, times = zip(*results)
    assert list(peaks) == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    assert list(live) == sorted(live, reverse=True) and live[0] > live[1] > live[2]
    assert list(times) == sorted(times) and times[0] < times[1] < times[2]


def test_options_are_hashable_and_normalised() -> None:
    a = ProgramOptions(train=True, checkpoint_layers=["h.0", "h.2"])      # type: ignore[arg-type]
    b = ProgramOptions(train=True, checkpoint_layers="h.0, h.2")          # type: ignore[arg-type]
    assert a == b and hash(a) == hash(b) and a.checkpoint_layers == ("h.0", "h.2")
    assert ProgramOptions().checkpoint_layers == ()


def test_unknown_layer_is_an_option_error(gpt3: Any) -> None:
    with pytest.raises(OptionError, match=r"h\.7.*available layers: h\.0, h\.1, h\.2"):
        capture(gpt3, options=ProgramOptions(train=True, checkpoint_layers=("h.0", "h.7")))
    with pytest.raises(OptionError, match="needs --train"):
        capture(gpt3, options=ProgramOptions(checkpoint_layers=("h.0",)))


def _cli_error(capsys: Any, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("boomfx: error:")
    return lines[0]


def test_cli_unknown_layer_exits_2_with_one_line(capsys: Any) -> None:
    pt2 = str(ROOT / "examples" / "gpt_tiny.pt2")
    line = _cli_error(capsys, "analyze", pt2, "--batch", "1", "--seq", "8", "--train",
                      "--checkpoint-layers", "h.0,h.9")
    assert "h.9" in line and "available layers: h.0, h.1" in line
    line = _cli_error(capsys, "analyze", pt2, "--batch", "1", "--seq", "8", "--checkpoint-layers", "h.0")
    assert "needs --train" in line


def test_cli_checkpoint_layers_runs(capsys: Any) -> None:
    pt2 = str(ROOT / "examples" / "gpt_tiny.pt2")
    assert main(["analyze", pt2, "--batch", "2", "--seq", "16", "--train", "--device", "cpu",
                 "--checkpoint-layers", "h.1", "--json"]) == 0
    assert '"recompute"' in capsys.readouterr().out     # the by_phase table has the recompute phase


def test_api_analyze_and_annotate_take_checkpoint_layers() -> None:
    model = GPT(vocab=64, d=16, layers=2, heads=2, max_seq=32)
    ids = torch.randint(0, 64, (2, 8))
    report = boomfx.analyze(model, ids, device="cpu", train=True, checkpoint_layers=["h.1"])
    assert "recompute" in {g.name for g in report.by_phase}
    result = boomfx.annotate(model, ids, device="cpu", train=True, checkpoint_layers=["h.0"])
    recomputed = {layer_of(e["module"]) for e in result.annotations.values() if e["phase"] == "recompute"}
    assert recomputed == {"h.0"}


@pytest.mark.parametrize("selection,fast_path", [
    (("h.0",), True),                                   # layer 0 is free: the synthesis is exact
    (tuple(f"h.{i}" for i in range(1, 7)), True),       # layers 1..N-1 all selected
    (("h.0", "h.3"), False),                            # a middle layer: the whole model is traced
])
def test_depth_free_trace_matches_the_full_trace(monkeypatch: pytest.MonkeyPatch, selection: tuple[str, ...],
                                                 fast_path: bool) -> None:
    ep = _export_gpt(7)
    traced_sizes: list[int] = []
    traces: list[Any] = []
    real = training.build_training_program

    def spy(e: Any, **kw: Any) -> Any:
        traced_sizes.append(len(list(e.graph.nodes)))
        traces.append(real(e, **kw))
        return traces[-1]

    options = ProgramOptions(train=True, checkpoint_layers=selection)
    monkeypatch.setattr(training, "build_training_program", spy)
    via_capture = capture(ep, options=options)          # the fast path when it applies, else the full trace
    monkeypatch.setattr(training, "build_training_program", real)
    assert len(traced_sizes) == 1
    assert (traced_sizes[0] < len(list(ep.graph.nodes))) == fast_path   # truncated program, or the whole one
    if not fast_path:   # the fallback is decided before any tracing
        assert fast_training.build_training_program_fast(ep, checkpoint_layers=selection) is None
    full = real(ep, checkpoint_layers=selection) if fast_path else traces[0]
    device = get_device("h100-sxm")

    def numbers(program: Any) -> tuple:
        report = Analysis(program, device).evaluate(resolve_bindings(program, {}, 3, 40)).report
        alloc = report.memory.allocator
        return (report.time.total_ns, report.time.flops, report.memory.peak_live_bytes,
                alloc.peak_allocated_bytes, alloc.peak_reserved_bytes, len(report.kernels),
                sorted((k.module, k.op, k.phase, k.time_ns) for k in report.kernels))

    symbols = symbols_of(ep, export_roles(ep))
    assert numbers(via_capture) == numbers(program_from_traced(full, symbols, options))
    recomputed = {layer_of(module_path(n)) for n in via_capture.gm.graph.nodes
                  if via_capture.phase_of(n) == "recompute"}
    assert recomputed == set(selection)


def _load_example() -> Any:
    path = ROOT / "examples" / "checkpoint_under_budget.py"
    spec = importlib.util.spec_from_file_location("checkpoint_under_budget_selective", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_example_checkpoints_fewer_than_all_layers_and_lowers_the_peak() -> None:
    example = _load_example()
    model, x = example.MLPStack(dim=32, depth=4), torch.randn(32, 64, 32)
    baseline = example.plan_checkpointing(model, x, budget_bytes=1 << 40)
    budget = int(baseline.peak_before_bytes * 0.8)
    plan = example.plan_checkpointing(model, x, budget_bytes=budget)
    assert 0 < len(plan.chosen_layers) < len(plan.activations_by_layer) == 4
    assert plan.peak_after_bytes < plan.peak_before_bytes and plan.fits
    # the plan's number is the prediction for exactly that selection, lower than checkpointing nothing
    again = boomfx.analyze(model, x, device="a100-80gb", train=True, optimizer="sgd",
                           checkpoint_layers=plan.chosen_layers)
    assert example.peak_bytes(again) == plan.peak_after_bytes
