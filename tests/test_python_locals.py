"""Eager inference memory as the nn.Module runs it: Python locals and arguments (passes/python_locals.py).

Truth: the profiler's peak of the real module (``model(x)`` under ``no_grad``), and hand sums for
small modules whose locals are known. With ``python_locals=False`` the prediction is the exported
graph's (``ep.module()``), whose generated code frees each value at its last use.
"""
from __future__ import annotations

import pytest
import torch

import boomfx
from boomfx.cli.main import main
from boomfx.core.devices import cpu_spec
from boomfx.core.program import ProgramOptions
from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.memory.live_bytes import profiler_peak_bytes
from conftest import make_model

N = 1 << 16          # elements of each [N] fp32 value: 256 KiB


class _Bound(torch.nn.Module):
    """Three values bound to three names: all alive until forward returns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        b = a + 1
        c = b.relu()
        return c.sum(dim=0, keepdim=True)


class _Rebound(torch.nn.Module):
    """One name rebound: each old value dies once the new one is made (the graph's frees)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y = y + 1
        y = y.relu()
        return y.sum(dim=0, keepdim=True)


class _Inner(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h * 3          # rebinding the parameter: the caller still holds the argument
        return h + 1


class _Caller(torch.nn.Module):
    """An argument lives until the call returns: the caller's temporary ``x * 2`` outlives ``h * 3``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * 2).sum(dim=0, keepdim=True)


def _peaks(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, int, int, int]:
    """(predicted with locals, predicted as the graph, real module, real graph) peaks above the start."""
    ep = torch.export.export(module, (x,), strict=False)
    predicted = []
    for python_locals in (True, False):
        program = capture(ep, options=ProgramOptions(target_kind="cpu", python_locals=python_locals))
        memory = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none")).evaluate({}).report.memory
        predicted.append(memory.peak_live_bytes - memory.resident_bytes)
    graph = ep.module()
    real = []
    for run in (module, graph):
        def step(run=run) -> None:
            with torch.no_grad():
                run(x)
        step()
        real.append(profiler_peak_bytes(step))
    return predicted[0], predicted[1], real[0], real[1]


VALUE = 4 * N
SUM = 4                        # the [1] fp32 sum
SMALL = 16                     # the profiler's own small allocations around one step


@pytest.mark.parametrize("module,with_locals,as_graph", [
    (_Bound(), 3 * VALUE + SUM, 2 * VALUE),     # a, b, c and the sum; the graph freed a and b in time
    (_Rebound(), 2 * VALUE, 2 * VALUE),         # never more than the old and the new value
    (_Caller(), 3 * VALUE, 2 * VALUE),          # x * 2 (held by the call), h * 3, h + 1
], ids=["bound", "rebound", "argument"])
def test_small_modules_by_hand(module: torch.nn.Module, with_locals: int, as_graph: int) -> None:
    predicted, predicted_graph, real_module, real_graph = _peaks(module, torch.randn(N))
    assert (predicted, predicted_graph) == (with_locals, as_graph)
    assert 0 <= real_module - predicted <= SMALL and 0 <= real_graph - predicted_graph <= SMALL, (
        predicted, predicted_graph, real_module, real_graph)


@pytest.mark.parametrize("name", ["hf_bert", "hf_gpt2"])
def test_transformers_module_peak_matches_the_profiler(name: str) -> None:
    model, inputs, dynamic_shapes = make_model(name)
    model.eval()
    ep = torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    x = inputs[0]
    predicted = {}
    for python_locals in (True, False):
        program = capture(ep, options=ProgramOptions(target_kind="cpu", python_locals=python_locals))
        bindings = resolve_bindings(program, {}, x.shape[0], x.shape[1])
        memory = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none")).evaluate(bindings).report.memory
        predicted[python_locals] = memory.peak_live_bytes - memory.resident_bytes

    def step() -> None:
        with torch.no_grad():
            model(*inputs)
    step()
    real = profiler_peak_bytes(step)
    assert abs(predicted[True] - real) <= 0.01 * real, (predicted, real)
    assert predicted[False] < predicted[True]          # the graph frees earlier than the module's Python


def test_training_and_compiled_programs_keep_the_graph_frees(exported) -> None:
    ep, _ = exported("gpt", "cpu")
    for options in ({"train": True}, {"compile": True}):
        reports = [boomfx.analyze(ep, device="cpu", db="none", batch=2, seq=8, python_locals=flag, **options)
                   for flag in (True, False)]
        assert reports[0].memory.peak_live_bytes == reports[1].memory.peak_live_bytes
        assert reports[0].options["python_locals"] is False


def test_cli_flag(capsys, exported) -> None:
    _, path = exported("hf_bert", "cpu")
    common = ["analyze", path, "--device", "cpu", "--db", "none", "--batch", "2", "--seq", "16", "--json"]
    import json
    assert main(common) == 0
    module = json.loads(capsys.readouterr().out)
    assert main(common + ["--no-python-locals"]) == 0
    graph = json.loads(capsys.readouterr().out)
    assert module["options"]["python_locals"] is True and graph["options"]["python_locals"] is False
    assert module["memory"]["peak_live_bytes"] > graph["memory"]["peak_live_bytes"]


def test_serving_plans_with_the_graphs_frees(examples_dir) -> None:
    """The engine runs its own compiled model code: its profiling peak is the graph's, whatever the
    program's python_locals says (serving.setup turns it off)."""
    from boomfx.core.devices import get_device
    from boomfx.serving.serve import setup
    path = str(examples_dir / "llama_tiny.pt2")
    setups = [setup(capture(path, options=ProgramOptions(target_kind="cuda", python_locals=flag)),
                    get_device("h100-80gb"), db="none", max_model_len=4096) for flag in (True, False)]
    assert not setups[0].analysis.program.options.runs_eager_module
    assert setups[0].plan.activation_peak_bytes == setups[1].plan.activation_peak_bytes > 0
