"""Attention priced as transformers' eager SDPA path calls it (passes/eager_sdpa.py).

Truth: the arguments the eager ``nn.Module`` really hands ``scaled_dot_product_attention`` (recorded with a
TorchFunctionMode), and the rewritten graph's output on the real weights against the export's own."""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from torch.overrides import TorchFunctionMode

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.eager_sdpa import SDPA, _kind, eager_attention_calls

EAGER = ProgramOptions(target_kind="cpu")
GRAPH = ProgramOptions(target_kind="cpu", python_locals=False)


class _RecordSDPA(TorchFunctionMode):
    """Each call of ``F.scaled_dot_product_attention``: (mask given, is_causal, enable_gqa, key heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool, bool, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            self.calls.append((mask is not None, bool(causal), bool(kwargs.get("enable_gqa", False)),
                               int(args[1].shape[1])))
        return func(*args, **kwargs)


def _sdpa_calls(program) -> list[tuple[bool, bool, bool, int]]:
    out = []
    for n in program.graph.nodes:
        if n.op == "call_function" and n.target is SDPA:
            mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
            causal = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
            out.append((mask is not None, bool(causal), bool(n.kwargs.get("enable_gqa", False)),
                        int(n.args[1].meta["val"].shape[1])))
    return out


def _eager_calls(name: str) -> list[tuple[bool, bool, bool, int]]:
    import hf_zoo
    model, inputs, _ = hf_zoo.build(name, "cpu")
    with torch.no_grad(), _RecordSDPA() as rec:
        model(**inputs)
    return rec.calls


@pytest.mark.parametrize("name, kv_heads, gqa", [("mistral", 2, True), ("gpt2", 4, False)])
def test_program_calls_sdpa_as_the_eager_module_does(zoo, name: str, kv_heads: int, gqa: bool) -> None:
    """The eager module passes no mask and is_causal (and, with fewer KV heads, those heads unrepeated with
    enable_gqa); the export built a causal mask and repeated the heads. The eager program makes the module's
    calls, the graph program (what ep.module() and validate run) keeps the export's."""
    ep, _ = zoo(name, "cpu")
    eager = _eager_calls(name)
    assert eager == [(False, True, gqa, kv_heads)] * 2          # 2 layers
    assert _sdpa_calls(capture(ep, options=EAGER)) == eager
    assert _sdpa_calls(capture(ep, options=GRAPH)) == [(True, False, False, 4)] * 2


def test_rewritten_graph_computes_the_exports_output(zoo) -> None:
    """Same logits on the real weights: the mask was causal and the repeats were GQA's; the mask's and the
    repeats' nodes left the graph."""
    import hf_zoo

    ep, _ = zoo("mistral", "cpu")
    program = capture(ep, options=EAGER)
    graph_program = capture(ep, options=GRAPH)
    assert len(list(program.graph.nodes)) < len(list(graph_program.graph.nodes))
    _, inputs, _ = hf_zoo.build("mistral", "cpu")
    with torch.no_grad():
        got = program.gm(*hf_zoo.graph_args(ep, inputs))[0]
        want = ep.module()(**inputs)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_sliding_window_shorter_than_the_sequence_keeps_its_mask() -> None:
    """A window of 8 tokens: the mask run at the probe hides keys further back than 8, so it is neither causal
    nor empty and stays (the eager module builds it too once the sequence outgrows the window)."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=8, use_cache=False)
    model = tf.MistralForCausalLM(cfg).eval()
    ep = torch.export.export(model, (), {"input_ids": torch.randint(0, 128, (2, 32))},
                             dynamic_shapes={"input_ids": {0: Dim("batch", max=64), 1: Dim("seq", min=2, max=255)}},
                             strict=False)
    program = capture(ep, options=ProgramOptions(target_kind="cpu", python_locals=False))
    assert eager_attention_calls(program) is program
    with torch.no_grad(), _RecordSDPA() as rec:
        model(input_ids=torch.randint(0, 128, (1, 32)))
    assert rec.calls[0][0]                                      # the eager module masks too, at 32 > 8 tokens


def test_mask_kinds() -> None:
    """Causal (boolean or additive), hiding nothing, and the rest (a window, a bias, padding) told apart."""
    n = 6
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(1, 1, n, n).masked_fill(~causal, torch.finfo(torch.float32).min)
    window = causal & ~torch.ones(n, n, dtype=torch.bool).tril(-3)[None, None]
    bias = additive + torch.arange(n, dtype=torch.float32)
    padded = causal.clone()
    padded[..., 0] = False
    assert _kind(causal) is True and _kind(additive) is True
    assert _kind(torch.ones(1, 1, n, n, dtype=torch.bool)) is False
    assert _kind(window) is None and _kind(bias) is None and _kind(padded) is None
    assert _kind(torch.ones(1, 1, n, n + 1, dtype=torch.bool)) is None   # queries != keys
