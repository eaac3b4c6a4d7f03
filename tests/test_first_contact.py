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


def _outside_attention(report) -> float:
    """FLOPs of the step's kernels outside the attention modules' own code (``self_attn``, ``SelfAttention``;
    their projections, ``self_attn.q_proj``, count): where SDPA runs, whatever its kernel."""
    return sum(k.flops for k in report.kernels
               if not k.module.rsplit(".", 1)[-1].lower().endswith(("attn", "attention")))


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
    # autocast changes dtypes only, and with them the SDPA kernel CUDA picks for transformers' eager GQA call (no
    # mask, fewer KV heads: passes/eager_sdpa.py): fp32 the math kernel (every score), bf16 flash (causal half)
    outside = _outside_attention(reports["train"])
    assert _outside_attention(reports["train_amp"]) == pytest.approx(outside, rel=1e-6)
    assert reports["train_amp"].time.flops <= train * (1 + 1e-6)
    # compiled: the same members' FLOPs, plus what Inductor recomputes instead of storing (< 2%); its attention
    # keeps the export's causal mask (every score) where the eager step skips the masked half
    assert outside <= _outside_attention(reports["train_compile"]) <= 1.02 * outside
    assert train <= reports["train_compile"].time.flops
