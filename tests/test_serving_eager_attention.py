"""boomfx serve on decoders whose attention is written out as ops (``matmul -> softmax -> matmul``):
Gemma-2 as transformers runs it (eager only: logit soft-capping), and a hand-written GPT. Sites, masks
and windows against the model configs, KV bytes against a real CPU decode loop, a decode step's
FLOPs against PyTorch's own counter (boomfx/serving/eager_attention.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.serving.model import serving_model
from boomfx.serving.steps import KV_WRITE_CONCAT, Step

pytest.importorskip("transformers")
import hf_decode  # noqa: E402  (tests/ is on sys.path under pytest)

WINDOW = 8
aten = torch.ops.aten


def _setup(ep: Any) -> Any:
    from boomfx.core.devices import cpu_spec
    from boomfx.serving.serve import setup
    # db=None: prices a pure function of the graph (this host's probe would floor the tiny decode
    # attention calls at one SDPA call's fixed cost, whatever the window)
    return setup(capture(ep, options=ProgramOptions(target_kind="cpu")), cpu_spec(), db=None, max_num_seqs=8,
                 max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def gemma2() -> Any:
    return hf_decode.gemma2(window=WINDOW)


@pytest.fixture(scope="module")
def plain(gemma2: Any) -> Any:
    assert gemma2.config._attn_implementation == "eager"
    return _setup(hf_decode.export_plain(gemma2))


def test_each_written_out_attention_is_a_site(plain: Any) -> None:
    """Two layers, two sites at their value matmuls: 4 query and 2 KV heads of 16 (the config's), the
    first sliding over the config's window (Gemma-2's layer types), the second full; the scores'
    matmul, scaling, soft-cap, mask and softmax attention-side; the q/k/v/o projections token-wise; the
    LM head and its soft-cap the logits nodes."""
    m = plain.model
    nodes = {n.name: n for n in m.program.graph.nodes}
    assert [s.eager for s in m.sites] == [True, True]
    assert [s.score_passes for s in m.sites] == [4, 4]     # the scale on the scores, soft-cap's div, tanh, mul
    assert all((s.q_heads, s.kv_heads, s.head_dim, s.v_head_dim) == (4, 2, 16, 16) for s in m.sites)
    assert [s.sliding_window for s in m.sites] == [WINDOW, None]
    assert all(nodes[s.node].target is aten.matmul.default for s in m.sites)
    side = [nodes[name] for name in m.attention_side]
    assert sum(n.target is aten.matmul.default for n in side) == 4        # q @ k^T and p @ v, per layer
    assert sum(n.target is aten.softmax.int for n in side) == 2
    assert sum(n.target is aten.tanh.default for n in side) == 2          # attention logit soft-capping
    assert not any(n.target is aten.linear.default for n in side)
    logits = {nodes[name].target for name in m.logits_nodes}
    assert aten.linear.default in logits and aten.tanh.default in logits  # final logit soft-capping


def test_kv_bytes_equal_a_real_decode_loop(gemma2: Any, plain: Any) -> None:
    """512 B per token over the two layers (2 x 2 KV heads x 16 x 4 B each); a real greedy loop's
    DynamicCache holds every token in the full layer and the last window - 1 in the sliding one."""
    assert plain.plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    per_layer = plain.plan.kv_bytes_per_token // 2
    batch, prompt, steps = 3, 9, 4
    cache = hf_decode.decode_loop(gemma2, batch, prompt, steps)
    sliding, full = cache.layers
    nbytes = [sum(t.numel() * t.element_size() for t in (layer.keys, layer.values)) for layer in (sliding, full)]
    assert nbytes == [per_layer * batch * (WINDOW - 1), per_layer * batch * (prompt + steps)]


def test_prefill_prices_no_score_matrix_as_token_wise_work(plain: Any) -> None:
    """The engine's attention replaces the [1, 4, N, N] scores: a 512-token prefill's token-wise part
    is what a 1-token one costs, times at most the token ratio (linear work), and the attention part
    is its own."""
    pricer = plain.pricer()
    long, short = pricer.step_time(Step((), ((512, 512),))), pricer.step_time(Step((), ((64, 64),)))
    assert long.parts["attention"].device_ns > 0
    token_wise_ratio = long.parts["token_wise"].device_ns / short.parts["token_wise"].device_ns
    assert token_wise_ratio < 512 / 64


@pytest.fixture(scope="module")
def gemma2_long() -> Any:
    """Every layer full: a sliding layer's decode step does not export with one dynamic cache length
    (cache_inputs.py, known limitations)."""
    return hf_decode.gemma2(window=None)


@pytest.fixture(scope="module")
def decode_setup(gemma2_long: Any) -> Any:
    return _setup(hf_decode.export_decode_step(gemma2_long))


@pytest.mark.parametrize("batch,context", [(2, 33), (3, 100)])
def test_decode_step_flops_match_pytorchs_counter(gemma2_long: Any, decode_setup: Any, batch: int,
                                                  context: int) -> None:
    """The decode-step export carries its cache into the written-out attention: the graph's linear and
    matmul FLOPs at (batch, context) are the real step's as PyTorch counts them (the matmuls read the
    whole cached context)."""
    gemma2 = gemma2_long
    from torch.utils.flop_counter import FlopCounterMode
    m = decode_setup.model
    assert m.carries_cache and all(s.eager and s.cache_inputs for s in m.sites)
    point = decode_setup.analysis.evaluate(m.bindings(batch, 1, context - 1))
    nodes = {n.name: n for n in m.program.graph.nodes}
    flops: dict[object, float] = {}
    for k in point.report.kernels:
        target = nodes[k.node].target if k.node in nodes else None
        flops[target] = flops.get(target, 0.0) + k.flops
    cache = hf_decode.prefilled_cache(gemma2, batch, context - 1)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        gemma2(torch.randint(0, hf_decode.VOCAB, (batch, 1)), past_key_values=cache, use_cache=True)
    assert flops[aten.linear.default] + flops[aten.matmul.default] == counter.get_total_flops()


def test_decode_from_the_graph_prices_the_written_out_attention_by_context(decode_setup: Any) -> None:
    pricer = decode_setup.pricer(kv_write=KV_WRITE_CONCAT)
    assert pricer.decode_from_graph
    attention = [pricer.step_time(Step((ctx,) * 4)).parts["attention"].device_ns for ctx in (64, 256, 448)]
    assert attention[0] < attention[1] < attention[2]


class _HandWritten(torch.nn.Module):
    """nanoGPT's attention without flash: q @ k^T / sqrt(d), a causal -inf mask, softmax, @ v."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        b, t, c = x.shape
        mask = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in qkv(x).split(c, dim=2))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            x = x + proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return self.head(x)


def test_a_hand_written_attention_is_served() -> None:
    """Two sites of 4 heads of 8 (no GQA: KV heads = query heads), causal through their masked_fill, the
    mask's construction attention-side; 2 layers x 2 x 4 x 8 x 4 B = 512 B of KV per token."""
    torch.manual_seed(0)
    dims = {"input_ids": {0: Dim("batch", min=1, max=16), 1: Dim("seq", min=2, max=256)}}
    ep = torch.export.export(_HandWritten(), (), {"input_ids": torch.randint(0, 64, (2, 16))}, dynamic_shapes=dims,
                             strict=False)
    m = serving_model(capture(ep, options=ProgramOptions(target_kind="cpu")))
    assert [(s.q_heads, s.kv_heads, s.head_dim, s.causal, s.eager, s.score_passes) for s in m.sites] == [
        (4, 4, 8, True, True, 1)] * 2                      # the scale on the scores; masked_fill is the mask
    nodes = {n.name: n for n in m.program.graph.nodes}
    assert any(nodes[n].target is aten.tril.default for n in m.attention_side)
    assert sum(s.kv_heads * (s.head_dim + s.v_head_dim) * 4 for s in m.sites) == 512


@pytest.mark.parametrize("batch,context", [(2, 33), (3, 100)])
def test_a_sliding_layer_decode_reads_its_window_as_the_real_step(gemma2: Any, plain: Any, batch: int,
                                                                  context: int) -> None:
    """Past the window, a real decode step's attention matmuls (PyTorch's counter: the bmm FLOPs) read
    the window's keys in the sliding layer and the whole context in the full one; the pricer's
    attention calls of each layer, the step windowed as that layer runs it, count the same FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from boomfx.passes.costs.registry import price_call
    from boomfx.serving.steps import windowed
    pricer = plain.pricer()
    assert pricer.windows == (WINDOW, None)
    step = Step((context,) * batch)
    predicted = sum(price_call(c).cost.flops for w in pricer.windows for c in pricer.attention_calls(windowed(step, w)))
    cache = hf_decode.prefilled_cache(gemma2, batch, context - 1)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        gemma2(torch.randint(0, hf_decode.VOCAB, (batch, 1)), past_key_values=cache, use_cache=True)
    real = counter.get_flop_counts()["Global"][aten.bmm]
    assert predicted == real == 4 * batch * 4 * 16 * (WINDOW + context)
    # and the step's attention part prices the sliding layer at its window: less than two full layers
    full = _with_windows(pricer, (None, None))
    assert pricer.step_time(step).parts["attention"].device_ns < full.step_time(step).parts["attention"].device_ns


def _with_windows(pricer: Any, windows: tuple) -> Any:
    from boomfx.serving.steps import StepPricer
    return StepPricer(pricer.analysis, pricer.model, pricer.engine, pricer.config, pricer.kv_dtype, pricer.kv_heads,
                      windows=windows)


def test_transformers_rule_prices_the_written_out_attention_as_it_runs(plain: Any) -> None:
    """Under the concat rule (transformers' loop) a decode layer is repeat_kv's two copies of the cached
    K and V to the 4 query heads, then the math path over them; under the engine's (paged) rule one fused
    call reading the 2 KV heads. Both count the same matmul FLOPs."""
    from boomfx.passes.costs.registry import price_call
    from boomfx.serving.steps import KV_WRITE_PAGED
    step = Step((64,) * 2)
    concat = plain.pricer(kv_write=KV_WRITE_CONCAT).attention_calls(step)
    paged = plain.pricer(kv_write=KV_WRITE_PAGED).attention_calls(step)
    assert [str(c.op) for c in concat] == (["aten.clone.default"] * 2 + ["aten.mul.Tensor"] * 4
                                           + ["aten.scaled_dot_product_attention.default"])
    assert [tuple(int(x) for x in c.args["self"].shape) for c in concat[:2]] == [(2, 4, 64, 16)] * 2
    # the scores' passes SDPA's math path does not make: the scale on the scores, soft-capping's div, tanh, mul
    assert [tuple(int(x) for x in c.args["self"].shape) for c in concat[2:6]] == [(2, 4, 1, 64)] * 4
    assert concat[-1].context["sdpa_backend"] == "math" and int(concat[-1].args["key"].shape[1]) == 4
    assert len(paged) == 1 and int(paged[0].args["key"].shape[1]) == 2 and paged[0].args["enable_gqa"]
    assert price_call(concat[-1]).cost.flops == price_call(paged[0]).cost.flops == 4 * 2 * 4 * 64 * 16


def test_the_engine_prices_a_long_prefill_of_a_sliding_layer_as_its_band(plain: Any) -> None:
    """vLLM's kernels skip the key blocks outside a sliding layer's band: a fresh 33-token prompt over a
    window of 8 is a causal block of 8 then blocks of at most 8 queries over the 15 keys their band spans.
    transformers computes every score and masks them: the chunk stays whole under its rule. The engine's
    sliding layer then costs less than its full layer on a 512-token prefill; under transformers' rule
    both layers cost the same."""
    from boomfx.serving.steps import KV_WRITE_PAGED, windowed
    prompt = Step((), ((33, 33),))
    assert windowed(prompt, WINDOW, banded=True).prefills == ((8, 8), (8, 15), (8, 15), (8, 15), (1, 8))
    assert windowed(prompt, WINDOW).prefills == ((33, 33),)
    assert windowed(Step((), ((16, 40),)), WINDOW, banded=True).prefills == ((8, 15), (8, 15))
    long = Step((), ((512, 512),))
    for rule, cheaper in ((KV_WRITE_PAGED, True), (KV_WRITE_CONCAT, False)):
        pricer = plain.pricer(kv_write=rule)
        sliding = pricer._layer_part("attention", windowed(long, WINDOW, banded=rule == KV_WRITE_PAGED))
        full = pricer._layer_part("attention", long)
        assert (sliding.device_ns < full.device_ns / 4) if cheaper else sliding.device_ns == full.device_ns
