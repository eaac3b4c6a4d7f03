"""torch.optim's foreach step or its per-parameter loop (``ProgramOptions.foreach``, ``--no-foreach``).

On CPU tensors torch.optim's default is its per-parameter loop (``_default_to_fused_or_foreach`` gives
foreach only to CUDA-like devices); on CUDA foreach: all parameters' temporaries at once. boomfx traces
foreach unless told otherwise (core/program.py says why). The peak of each is checked against the
profiler in tests/test_cpu_memory_accuracy.py; here: the default, the traced ops, the loop's
temporaries by hand, the CLI flag, and the per-rank rewrites, which start from the foreach step.
"""
from __future__ import annotations

import json

import torch

from boomfx.cli.main import main
from boomfx.core.program import PHASE_OPTIMIZER, ProgramOptions
from boomfx.distributed.ranks import FOREACH_STEP, foreach_step
from boomfx.frontend.capture import capture
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.liveness import Category, step_liveness_pass

aten = torch.ops.aten
SMALL, LARGE = (16, 64), (64, 32)      # 4 KiB and 8 KiB of fp32, stepped in this order


class _TwoWeights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Linear(SMALL[1], SMALL[0], bias=False)
        self.large = torch.nn.Linear(LARGE[1], LARGE[0], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(self.small(x).repeat(1, 2))


def _export() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(_TwoWeights(), (torch.randn(4, 64),), strict=False)


def _optimizer_nodes(program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if program.phases.get(n.name) == PHASE_OPTIMIZER]


def test_default_is_torchs_loop_on_cpu_and_foreach_on_cuda() -> None:
    from torch.optim.optimizer import _default_to_fused_or_foreach
    assert _default_to_fused_or_foreach([torch.nn.Parameter(torch.ones(2))], False, False) == (False, False)
    assert ProgramOptions(True, target_kind="cpu").uses_foreach is False       # torch.optim's default for CPU tensors
    assert ProgramOptions(True, target_kind="cuda").uses_foreach is True
    assert ProgramOptions(True, target_kind="cpu", foreach=False).uses_foreach is False
    assert ProgramOptions(True, target_kind="cpu", foreach=True).uses_foreach is True
    assert ProgramOptions(True, target_kind="cuda", foreach=False).uses_foreach is False


def test_loop_steps_each_parameter_with_its_own_ops() -> None:
    ep = _export()
    loop = _optimizer_nodes(capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", foreach=False)))
    both = _optimizer_nodes(capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", foreach=True)))
    assert not any("_foreach_" in str(n.target) for n in loop)
    assert [n.target for n in loop].count(aten.addcdiv_.default) == 2          # one update per parameter
    assert [n.meta["val"].shape for n in loop if n.target is aten.sqrt.default] == [SMALL, LARGE]
    assert any(n.target is aten._foreach_sqrt.default for n in both)


def _optimizer_temporary_peak(program) -> int:
    """Largest sum of temporaries alive at one optimizer step (gradients and state left out)."""
    info = step_liveness_pass(program)
    ev = Evaluator({}, data_dependent_value=1)
    steps = [i for i, name in enumerate(info.order) if program.phases.get(name) == PHASE_OPTIMIZER]
    temps = [iv for iv in info.intervals if iv.category == Category.TEMP and not iv.resident]
    return max(sum(ev(iv.nbytes) for iv in temps if iv.start_step <= s <= iv.end_step) for s in steps)


def test_loop_denominator_lives_until_the_next_parameter_rebinds_it() -> None:
    """By hand: ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` is a local of the loop. While the large
    weight's ``sqrt`` and quotient exist (8 KiB each), the small weight's ``denom`` (4 KiB) is still
    bound: 20 KiB. Foreach: one ``sqrt`` of every ``exp_avg_sq`` (4 + 8 KiB), divided in place."""
    ep = _export()
    small, large = 4 * SMALL[0] * SMALL[1], 4 * LARGE[0] * LARGE[1]
    loop = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", foreach=False))
    assert _optimizer_temporary_peak(loop) == small + 2 * large
    both = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", foreach=True))
    assert _optimizer_temporary_peak(both) == small + large


def test_rank_rewrites_start_from_the_foreach_step() -> None:
    ep = _export()
    loop = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", foreach=False))
    start = foreach_step(loop)
    assert start is not loop and start.options.foreach is True and loop.derived[FOREACH_STEP] is start
    assert foreach_step(loop) is start                                       # traced once per program
    assert any(n.target is aten._foreach_sqrt.default for n in _optimizer_nodes(start))
    both = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", foreach=True))
    assert foreach_step(both) is both


def test_cli_foreach_flag(capsys, exported) -> None:
    _, path = exported("mlp")
    common = ["analyze", path, "--device", "cpu", "--db", "none", "--batch", "8", "--json"]
    assert main(common + ["--train", "--no-foreach"]) == 0
    loop = capsys.readouterr().out
    assert main(common + ["--train", "--foreach"]) == 0
    both = capsys.readouterr().out
    assert main(common + ["--train"]) == 0                  # a CPU's default: torch.optim's loop
    default = capsys.readouterr().out
    assert '"_foreach_sqrt' not in loop and "_foreach_sqrt" in both
    assert json.loads(default)["options"]["foreach"] is False and json.loads(default)["time"] == json.loads(loop)["time"]
    assert main(common + ["--foreach"]) == 2
    err = capsys.readouterr().err
    assert "--foreach/--no-foreach needs --train" in err and err.count("\n") == 1
