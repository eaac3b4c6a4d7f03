"""Tied parameters are not merged by --train yet; the report must say so rather than stay silent."""
from __future__ import annotations

import boomfx
from boomfx.capture import tied_parameters


def test_tied_parameters_are_found_and_reported(exported) -> None:
    ep, _ = exported("hf_gpt2", "cpu")
    assert tied_parameters(ep) == [["lm_head.weight", "transformer.wte.weight"]]
    report = boomfx.analyze(ep, device="cpu", train=True, batch=2, seq=8)
    assert any("lm_head.weight = transformer.wte.weight" in w for w in report.warnings)
    inference = boomfx.analyze(ep, device="cpu", batch=2, seq=8)
    assert inference.warnings == []           # inference counts the shared storage once (liveness)


def test_untied_model_has_no_warning(exported) -> None:
    ep, _ = exported("gpt", "cpu")
    assert tied_parameters(ep) == []
    assert boomfx.analyze(ep, device="cpu", train=True, batch=2, seq=8).warnings == []
