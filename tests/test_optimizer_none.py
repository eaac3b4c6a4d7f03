"""``--train --optimizer none``: forward and backward only, the step of a gradient-accumulation
micro-batch (``loss.backward()`` with no ``opt.step()``; the gradients are held by ``.grad`` to the end of
the step).

Truth: a real eager fwd+bwd step of the same exported graph on this CPU. Memory: the profiler peak
above the step's start (gradients included, freed after the step) equals the prediction within 1%
with every kernel's scratch measured (as tests/test_cpu_memory_accuracy.py). Kernels: the forward and
backward of the AdamW program, nothing else, each priced the same.
"""
from __future__ import annotations

import pytest
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.cli.main import main
from boomfx.core.devices import cpu_spec
from boomfx.memory.live_bytes import profiler_peak_bytes
from boomfx.core.program import ProgramOptions

from conftest import make_model
from test_cpu_memory_accuracy import LANGUAGE_MODELS, predicted_peak, step_loss

TOLERANCE = 0.01


def _fwd_bwd_peak(ep: torch.export.ExportedProgram, inputs: tuple, resident_grads: bool, loss: str) -> int:
    gm = ep.module()
    params = list(gm.parameters())
    reduce = step_loss(loss)

    def step() -> None:
        reduce(gm(*inputs)).backward()
        if not resident_grads:
            for p in params:
                p.grad = None
    step()
    step()
    return profiler_peak_bytes(step)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "hf_bert"])
@pytest.mark.parametrize("resident", [False, True], ids=["fresh-grads", "resident-grads"])
def test_fwd_bwd_peak_matches_profiler(name: str, resident: bool, tmp_path) -> None:
    model, inputs, dynamic = make_model(name)
    model.train(True)
    ep = torch.export.export(model, inputs, dynamic_shapes=dynamic, strict=False)
    options = ProgramOptions(True, "none", target_kind="cpu", resident_grads=resident)
    predicted, workspace = predicted_peak(ep, inputs, options, str(tmp_path / "cpu.db"))
    real = _fwd_bwd_peak(ep, inputs, resident, "cross_entropy" if name in LANGUAGE_MODELS else "mean")
    assert real > 0
    assert abs(predicted - real) <= TOLERANCE * real, (name, predicted, workspace, real)


def test_none_is_adamw_without_its_optimizer_phase() -> None:
    model, inputs, dynamic = make_model("gpt")
    ep = torch.export.export(model, inputs, dynamic_shapes=dynamic)
    spec = cpu_spec()
    reports = {}
    for opt in ("adamw", "none"):
        program = capture(ep, options=ProgramOptions(True, opt, target_kind="cpu"))
        bindings = resolve_bindings(program, {}, 4, 32)
        # db=None: the pure pricer (this host's probe would price the forward's kernels at the cache level
        # of each step's footprint, which AdamW's state enlarges)
        reports[opt] = Analysis(program, spec, AnalyzeOptions("cpu", db=None)).evaluate(bindings).report
    none, adamw = reports["none"], reports["adamw"]
    assert {k.phase for k in none.kernels} == {"forward", "backward"}
    fwd_bwd = [k for k in adamw.kernels if k.phase in ("forward", "backward")]
    assert sorted((k.op, k.time_ns) for k in none.kernels) == sorted((k.op, k.time_ns) for k in fwd_bwd)
    # AdamW state (2 moments + step per parameter) is resident only with an optimizer
    n_params = sum(p.numel() for p in model.parameters())
    assert adamw.memory.resident_bytes - none.memory.resident_bytes >= 2 * 4 * n_params


def test_cli_optimizer_none(capsys, exported) -> None:
    _, path = exported("mlp")
    assert main(["analyze", path, "--device", "cpu", "--db", "none", "--train", "--optimizer", "none",
                 "--batch", "8"]) == 0
    assert "step" in capsys.readouterr().out
    assert main(["analyze", path, "--device", "cpu", "--db", "none", "--train", "--optimizer", "lion",
                 "--batch", "8"]) == 2
    assert "unknown optimizer" in capsys.readouterr().err


def test_validate_optimizer_none_measures_the_fwd_bwd_step(tmp_path) -> None:
    """validate's real step is the fwd+bwd micro-batch: its peak is the independent one's, and no
    optimizer op runs in it or is predicted."""
    from boomfx.validate import validate
    model, inputs, dynamic = make_model("gpt")
    model.train(True)
    ep = torch.export.export(model, inputs, dynamic_shapes=dynamic)
    path = tmp_path / "gpt.pt2"
    torch.export.save(ep, str(path))
    r = validate(str(path), train=True, optimizer="none", batch=4, seq=32, db="none", threads=1, repeats=5)
    real = _fwd_bwd_peak(ep, (torch.randint(0, 128, (4, 32)),), False, "cross_entropy")
    assert abs(r.measured_peak_above_start_bytes - real) <= TOLERANCE * real, (r.measured_peak_above_start_bytes, real)
    assert not any(o.op.startswith("_foreach") for o in r.ops if o.measured_calls or o.predicted_calls)
    assert r.options["optimizer"] == "none"
