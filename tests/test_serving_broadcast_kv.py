"""A model that hands SDPA fewer K/V heads than query heads, unexpanded and without ``enable_gqa`` (Falcon's
multi-query attention), relies on broadcasting: eager PyTorch's fused kernels refuse it and run the math
path (K/V expanded by copies, bmm + softmax + bmm). Under transformers' rules (``concat``) the serving step
calls attention as the model does; under the engine's (``paged``) it reads the cache unexpanded.

Checked against the kernels eager PyTorch really runs on this CPU for each priced call, and against a
GQA model (expanded by repeat_kv in the graph), which keeps the fused call under both rules."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim
from torch.profiler import ProfilerActivity, profile

from boomfx.core.devices import cpu_spec
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.serving.serve import setup
from boomfx.serving.steps import KV_WRITE_CONCAT, KV_WRITE_PAGED, Step

D, HEADS, HEAD_DIM, VOCAB = 64, 4, 16, 128


class _Attention(torch.nn.Module):
    """One layer: ``kv_heads`` K/V heads; ``expand`` repeats them (repeat_kv) before SDPA, else SDPA
    broadcasts them."""

    def __init__(self, kv_heads: int, expand: bool) -> None:
        super().__init__()
        self.kv_heads, self.expand = kv_heads, expand
        self.q = torch.nn.Linear(D, HEADS * HEAD_DIM)
        self.kv = torch.nn.Linear(D, 2 * kv_heads * HEAD_DIM)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if self.expand:
            rep = HEADS // self.kv_heads
            k = k[:, :, None].expand(b, self.kv_heads, rep, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
            v = v[:, :, None].expand(b, self.kv_heads, rep, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class _LM(torch.nn.Module):
    def __init__(self, kv_heads: int, expand: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList([_Attention(kv_heads, expand) for _ in range(2)])
        self.head = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _setup(kv_heads: int, expand: bool) -> Any:
    ep = torch.export.export(_LM(kv_heads, expand), (torch.randint(0, VOCAB, (2, 8)),),
                             dynamic_shapes={"input_ids": {0: Dim("batch", max=64), 1: Dim("seq", min=2, max=512)}})
    program = capture(ep, options=ProgramOptions(target_kind="cpu"))
    return setup(program, cpu_spec(), db="none", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512)


def _eager_kernels(call: Any) -> set[str]:
    """The aten kernels eager PyTorch runs for ``call`` on this CPU (its specs made real)."""
    def real(spec: Any) -> Any:
        return torch.randn(*[int(d) for d in spec.shape], dtype=spec.dtype) if hasattr(spec, "shape") else spec
    args = {k: real(v) for k, v in call.args.items()}
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **{n: a for n, a in args.items()
                                                                         if n in ("attn_mask", "is_causal",
                                                                                  "enable_gqa")})
    return {e.key for e in prof.key_averages()}


MATH, FLASH = "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("step", [Step((64,) * 4), Step((), ((32, 32),), sampled=1)], ids=["decode", "prefill"])
def test_a_broadcasting_model_is_priced_on_the_math_path_it_runs_under_transformers_rules(step: Step) -> None:
    s = _setup(kv_heads=1, expand=False)
    assert [(site.kv_heads, site.broadcast_kv) for site in s.model.sites] == [(1, True)] * 2
    paged, concat = (s.pricer(kv_write=rule).attention_calls(step)[0] for rule in (KV_WRITE_PAGED, KV_WRITE_CONCAT))
    assert paged.args["enable_gqa"] is True and paged.context["sdpa_backend"] == "flash"
    assert concat.args["enable_gqa"] is False and concat.context["sdpa_backend"] == "math"
    assert tuple(concat.args["key"].shape)[1] == 1                       # K/V read at the model's head count
    assert MATH in _eager_kernels(concat) and FLASH not in _eager_kernels(concat)   # what eager runs for it
    assert FLASH in _eager_kernels(paged)
    # the math path writes and reads the expanded K/V copies and the score matrix: more bytes than fused
    from boomfx.passes.costs.registry import price_call
    assert price_call(concat).cost.bytes_read > price_call(paged).cost.bytes_read


def test_a_gqa_model_expanded_in_its_graph_keeps_the_fused_call() -> None:
    s = _setup(kv_heads=2, expand=True)
    assert [(site.kv_heads, site.broadcast_kv) for site in s.model.sites] == [(2, False)] * 2
    for rule in (KV_WRITE_PAGED, KV_WRITE_CONCAT):
        call = s.pricer(kv_write=rule).attention_calls(Step((64,) * 4))[0]
        assert call.args["enable_gqa"] is True and call.context["sdpa_backend"] == "flash"
        assert FLASH in _eager_kernels(call)
