"""The transformers models a new user brings (tests/hf_zoo.py: small configs, meta device, strict=False,
dynamic batch/length dims) analyse in the four modes people run, on a GPU target, or stop with one line
that says what is unsupported and what to do. Each of these crashed or was refused before (issue 14):
T5 --train (efficient-attention backward with a bias gradient), Mistral/Phi/Phi-3 --train --compile
(fusion cycle), Mixtral with batched experts --train --amp bf16 (export's dtype asserts under autocast), Mixtral with the
default experts (transformers' grouped-mm custom op; registered here, since the zoo export imports it)."""
from __future__ import annotations

import pytest

import boomfx
from boomfx.frontend.capture import capture
from boomfx.core.errors import BoomfxError
from boomfx.frontend.loader import LoadError

MODELS = ["mistral", "phi", "phi3", "t5", "whisper", "vit", "resnet", "mixtral", "mixtral_batched"]
MODES = {"inference": {}, "train": {"train": True}, "train_amp": {"train": True, "amp": "bf16"},
         "train_compile": {"train": True, "compile": True}}


def _dims(path: str) -> dict[str, int]:
    program = capture(path)
    return {name: 2 if info.role == "batch" else max(info.min_value, 16) for name, info in program.symbols.items()}


def _run_modes(path: str) -> dict[str, object]:
    results: dict[str, object] = {}
    try:
        dims = _dims(path)
    except (BoomfxError, LoadError) as err:
        return {mode: err for mode in MODES}
    for mode, options in MODES.items():
        try:
            results[mode] = boomfx.analyze(path, device="h100-sxm", dims=dims, **options)
        except (BoomfxError, LoadError) as err:
            results[mode] = err
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_model_runs_in_every_mode_or_says_why(zoo, name: str) -> None:
    _, path = zoo(name)
    results = _run_modes(path)
    for mode, result in results.items():
        if isinstance(result, Exception):
            text = str(result)
            assert "\n" not in text and len(text) < 400, (mode, text)
            assert "instead" in text or "analyse without" in text, (mode, text)   # says what to do
            continue
        assert result.time.total_ns > 0 and result.memory.peak_live_bytes > 0 and result.time.flops > 0, mode
    reports = {m: r for m, r in results.items() if not isinstance(r, Exception)}
    assert set(reports) == set(MODES), {m: str(r) for m, r in results.items() if m not in reports}
    train = reports["train"].time.flops
    # backward does about twice the forward's matmul work: a step is >= 2x inference
    assert train >= 2 * reports["inference"].time.flops
    assert reports["train_amp"].time.flops == pytest.approx(train, rel=1e-6)   # autocast changes dtypes only
    # compiled: the same members' FLOPs, plus what Inductor recomputes instead of storing (< 2%)
    assert train <= reports["train_compile"].time.flops <= 1.02 * train
