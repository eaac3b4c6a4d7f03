"""``--device cpu`` peak memory equals a real CPU run's allocator-level peak (profiler memory events).

For small models (an MLP, a small CNN, a tiny GPT, `transformers` BERT and GPT-2), inference and an AdamW training step:
a kernel database is collected on the fly for the exact kernels of the step (so kernel scratch, the
measured ``workspace_bytes``, is part of the prediction), then the prediction's peak above the
storages that exist before the step (``peak_live_bytes - resident_bytes``: parameters, buffers,
inputs, optimizer state) is compared with the profiler's running-sum peak of one real step above its
starting point. The real step runs the exported program eagerly (``ep.module()``, op by op on real
CPU tensors): the program boomfx analyses. (The original nn.Module can peak higher in inference,
because its Python keeps tensors bound to local variables until ``forward`` returns; see
benchmarks/cpu_accuracy.py, which reports both.)

Training is the eager step boomfx's ``--train`` traces: cross-entropy against next-token labels for
the language models (``LANGUAGE_MODELS``, --train's default loss for logits over a vocabulary),
``first_output.mean()`` for the others, ``loss.backward()``, ``AdamW.step()`` with ``foreach=True`` (every
parameter's temporaries at once; ``--train``'s default) and, in a second case, ``foreach=False`` (its
per-parameter loop, torch's default on CPU; ``--no-foreach``), ``zero_grad(set_to_none=True)``, measured after
a warm-up step so the optimizer state already exists.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.core.devices import cpu_spec
from boomfx.kernels_db.collect import collect_calls
from boomfx.kernels_db.measure import Measurer
from boomfx.kernels_db.store import Store
from boomfx.memory.live_bytes import profiler_peak_bytes
from boomfx.core.program import ProgramOptions

from conftest import make_model

TOLERANCE = 0.01


def _first_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out
    return next(v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())


def step_loss(loss: str) -> Any:
    """The real step's loss on a model's output: ``"mean"`` of the first output, or ``"cross_entropy"``
    against random labels over its last dimension (drawn at the first call and kept, as a batch's)."""
    labels: list[torch.Tensor] = []

    def reduce(out: Any) -> torch.Tensor:
        logits = _first_output(out)
        if loss == "mean":
            return logits.mean()
        if not labels:
            gen = torch.Generator().manual_seed(0)
            labels.append(torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=gen))
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels[0].flatten())
    return reduce


def real_peak(ep: torch.export.ExportedProgram, inputs: tuple, train: bool, set_to_none: bool = True,
              loss: str = "mean", foreach: Optional[bool] = True) -> int:
    """Profiler peak of one real eager step (after two warm-ups); ``set_to_none=False`` keeps the .grad
    buffers between steps (the --resident-grads steady state). ``loss="cross_entropy"``: a language
    model's training loss against random next-token labels (drawn once, resident like a batch's).
    ``foreach``: AdamW's argument (None: torch's default, the loop on CPU, as ``--train``'s on a CPU target)."""
    gm = ep.module()
    reduce = step_loss(loss)

    if not train:
        def step() -> None:
            with torch.no_grad():
                gm(*inputs)
    else:
        opt = torch.optim.AdamW(list(gm.parameters()), foreach=foreach)

        def step() -> None:
            reduce(gm(*inputs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        step()   # warm-up: AdamW's state (and resident .grad buffers) are created on the first step
    step()
    return profiler_peak_bytes(step)


def predicted_peak(ep: torch.export.ExportedProgram, inputs: tuple, options: ProgramOptions,
                   db: str) -> tuple[int, int]:
    """(predicted peak above the resident bytes, kernel workspace at the peak) of one step on this CPU,
    with every kernel's workspace measured here (also used by tests/test_resident_grads.py)."""
    spec = cpu_spec()
    program = capture(ep, options=options)
    x = inputs[0]
    seq = x.shape[1] if x.ndim == 2 and not x.is_floating_point() else None
    bindings = resolve_bindings(program, {}, x.shape[0], seq)
    calls = Analysis(program, spec, AnalyzeOptions(spec.name, db="none")).kernel_calls(bindings)
    # memory only: short timing, but the workspace measurement of every kernel is the real one; the
    # plausibility check would refuse a one-sample time taken under load, and its workspace with it
    measurer = Measurer("cpu", warmup_s=0.0, target_s=0.0, min_runs=1, max_runs=1, min_sample_ns=0)
    result = collect_calls(Store(db), calls, "cpu", progress=False, measurer=measurer, check_plausible=False)
    assert not result.failed, [(k.op, why) for k, why in result.failed]
    memory = Analysis(program, spec, AnalyzeOptions(spec.name, db=db)).evaluate(bindings).report.memory
    return memory.peak_live_bytes - memory.resident_bytes, memory.workspace_bytes


# hf_gpt2 ties lm_head.weight to wte.weight: one gradient and one AdamW state in eager, as in the trace
# the language models (logits over the vocabulary their embedding reads): --train's default loss is
# cross-entropy for them, the mean of the output for the others
LANGUAGE_MODELS = {"gpt", "llama", "hf_gpt2"}
# training twice: AdamW(foreach=True) (--train's default) and its per-parameter loop (torch's CPU default)
CASES = [(name, train, foreach) for name in ("mlp", "cnn", "gpt", "hf_bert", "hf_gpt2")
         for train, foreach in ((False, None), (True, True), (True, False))]


def _case_id(case: Any) -> str:
    name, train, foreach = case
    return f"{name}-{'train' if train else 'infer'}{'-loop' if foreach is False else ''}"


@pytest.mark.parametrize("name,train,foreach", CASES, ids=[_case_id(c) for c in CASES])
def test_cpu_peak_matches_profiler(name: str, train: bool, foreach: Optional[bool], tmp_path) -> None:
    model, inputs, dynamic_shapes = make_model(name)
    model.train(train)
    ep = torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    # the real step runs the export's graph (ep.module()): its frees, not the nn.Module's Python locals
    options = ProgramOptions(train, "adamw", target_kind="cpu", foreach=foreach, python_locals=False)
    predicted, workspace = predicted_peak(ep, inputs, options, str(tmp_path / "cpu.db"))
    real = real_peak(ep, inputs, train, loss="cross_entropy" if name in LANGUAGE_MODELS else "mean",
                     foreach=foreach)
    assert real > 0
    assert abs(predicted - real) <= TOLERANCE * real, (
        f"{name} {'train' if train else 'inference'}: predicted peak above start {predicted} B "
        f"(workspace at peak {workspace} B) vs profiler {real} B ({predicted / real - 1:+.2%})")


class _RescaledInPlace(torch.nn.Module):
    """RWKV's eval forward: a weight divided in place under ``torch.no_grad()`` before it is used."""
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.down.weight.div_(1.0)
        return self.down(torch.relu(self.up(x)))


def test_a_weight_rescaled_in_place_under_no_grad_is_not_a_new_tensor(tmp_path) -> None:
    """torch.export wraps the no_grad region in ``wrap_with_set_grad_enabled``, whose output is the weight
    itself (an in-place write): counted as a fresh 1 MiB storage held from the step's start, it put RWKV's
    eval peak +45% over the profiler's."""
    model = _RescaledInPlace().eval()
    inputs = (torch.randn(64, 256),)
    ep = torch.export.export(model, inputs)
    assert any("wrap_with_set_grad_enabled" in str(n.target) for n in ep.graph.nodes)
    predicted, workspace = predicted_peak(ep, inputs, ProgramOptions(), str(tmp_path / "db.sqlite"))
    real = real_peak(ep, inputs, train=False)
    assert abs(predicted - real) <= TOLERANCE * real, (predicted, real, workspace)
