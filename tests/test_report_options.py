"""The report says how the step was predicted: JSON options and the text summary's mode line."""
from __future__ import annotations

import boomfx
from boomfx.report.text import render_text


def test_report_options_and_text_name_every_mode_switch(exported):
    """The JSON options and the text summary's mode line say how the step was predicted."""
    ep, _ = exported("gpt")
    compiled = boomfx.analyze(ep, device="a100-80gb", batch=2, seq=8, compile=True, cudagraphs=True)
    assert compiled.options["compile"] is True and compiled.options["cudagraphs"] is True
    assert "torch.compile + CUDA graphs" in render_text(compiled).splitlines()[1]
    resident = boomfx.analyze(ep, device="a100-80gb", batch=2, seq=8, train=True, resident_grads=True)
    assert resident.options["resident_grads"] is True and resident.options["compile"] is False
    assert "gradients resident between steps" in render_text(resident).splitlines()[1]
    # torch.optim's default for the target's tensors: foreach on a GPU, its per-parameter loop on a CPU
    assert resident.options["foreach"] is True and compiled.options["foreach"] is None
    assert "adamw (foreach)" in render_text(resident).splitlines()[1]
    on_cpu = boomfx.analyze(ep, device="cpu", db="none", batch=2, seq=8, train=True)
    assert on_cpu.options["foreach"] is False
    assert "adamw (per-parameter loop)" in render_text(on_cpu).splitlines()[1]
    # foreach asked for on a CPU is not what torch.optim picks for CPU tensors: the line says so
    cpu_foreach = boomfx.analyze(ep, device="cpu", db="none", batch=2, seq=8, train=True, foreach=True)
    assert cpu_foreach.options["foreach"] is True
    assert "torch's default for CPU tensors is its per-parameter loop" in render_text(cpu_foreach).splitlines()[1]
    import torch
    params = [torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.zeros(2)
    from torch.optim.optimizer import _default_to_fused_or_foreach
    assert _default_to_fused_or_foreach(params, differentiable=False, use_fused=False) == (False, False)
