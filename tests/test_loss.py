"""``--train``'s loss: cross-entropy for a language model's logits by default, ``--loss`` to choose.

Independent truth for the default: ``tests/test_cpu_memory_accuracy.py`` (the language models' real
steps run cross-entropy against random labels) and the gloo runs with ``loss="cross_entropy"``
(tensor, loss and pipeline parallelism). Here: which loss each kind of model gets, what cross-entropy
adds to the step against a hand count, and bad input.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boomfx.cli.main import main
from boomfx.core.errors import OptionError
from boomfx.core.program import ROLE_LABEL, ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.training.trace import resolved_loss

from conftest import make_model

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt_tiny.pt2")   # vocab 512
MLP = str(ROOT / "examples" / "mlp.pt2")


def _labels(program) -> list[str]:
    return [n for n, r in program.input_roles.items() if r == ROLE_LABEL]


def _ops(program, name: str) -> list:
    return [n for n in program.graph.nodes if n.op == "call_function" and name in str(n.target)]


@pytest.mark.parametrize("name,expected", [
    ("gpt", "cross_entropy"),       # logits over the vocabulary its embedding reads
    ("hf_gpt2", "cross_entropy"),   # transformers' GPT2LMHeadModel, tied head
    ("hf_bert", "mean"),            # BertModel: hidden states, not logits
    ("mlp", "mean"),
    ("cnn", "mean"),
])
def test_auto_picks_cross_entropy_for_language_model_logits(name: str, expected: str) -> None:
    model, inputs, dynamic = make_model(name)
    ep = torch.export.export(model, inputs, dynamic_shapes=dynamic, strict=False)
    assert resolved_loss(ep, "auto") == expected
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    assert _labels(program) == (["labels"] if expected == "cross_entropy" else [])
    assert bool(_ops(program, "nll_loss_forward")) == (expected == "cross_entropy")


def test_an_export_that_returns_its_loss_trains_on_it() -> None:
    """transformers' models given ``labels`` compute their own loss: the scalar output is the loss."""
    import transformers
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    ep = torch.export.export(model, (), {"input_ids": ids, "labels": ids}, strict=False)
    assert resolved_loss(ep, "auto") == "output"


def test_cross_entropy_keeps_the_fp32_log_probabilities_for_backward() -> None:
    """What the default adds to the GPT example's step: the [tokens, vocab] log-softmax saved for
    backward. Under bf16 autocast the logits are bf16 and the log-softmax fp32: the cross-entropy
    step's forward ends with a [b*s, 512] fp32 tensor alive into the backward that the mean's lacks."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import get_device
    from boomfx.frontend.capture import resolve_bindings
    spec = get_device("h100-sxm")
    ce = capture(GPT, options=ProgramOptions(True, amp="bf16"))
    (log_softmax,) = [n for n in _ops(ce, "_log_softmax") if "backward" not in str(n.target)]
    val = log_softmax.meta["val"]
    assert val.dtype == torch.float32 and int(val.shape[-1]) == 512
    peaks = {}
    for loss in ("mean", "cross_entropy"):
        program = capture(GPT, options=ProgramOptions(True, amp="bf16", loss=loss))
        report = Analysis(program, spec, AnalyzeOptions(spec.name, db="none")).evaluate(
            resolve_bindings(program, {}, 8, 256)).report
        peaks[loss] = report.memory.peak_live_bytes
    tokens_by_vocab_fp32 = 8 * 256 * 512 * 4
    assert peaks["cross_entropy"] - peaks["mean"] >= tokens_by_vocab_fp32


def test_loss_option_and_bad_input(capsys) -> None:
    def bad(*argv: str) -> str:
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    base = ["analyze", GPT, "--batch", "2", "--seq", "16", "--device", "h100-sxm"]
    assert "invalid choice: 'focal'" in bad(*base, "--train", "--loss", "focal")
    assert "--loss needs --train" in bad(*base, "--loss", "mean")
    assert main(base + ["--train", "--loss", "mean", "--json"]) == 0
    mean = capsys.readouterr().out
    assert main(base + ["--train", "--json"]) == 0
    default = capsys.readouterr().out
    import json
    assert json.loads(default)["memory"]["peak_live_bytes"] > json.loads(mean)["memory"]["peak_live_bytes"]
    with pytest.raises(OptionError, match="unknown loss 'focal'"):
        ProgramOptions(True, loss="focal")
    assert _labels(capture(MLP, options=ProgramOptions(True, loss="cross_entropy"))) == ["labels"]
