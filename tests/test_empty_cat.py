"""Inductor's ``cat`` decomposition (passes/empty_cat.py): a cat with an input empty along its dimension
keeps its one real input's layout, and the ``.contiguous()`` copy that layout makes a no-op is gone."""
from __future__ import annotations

import torch

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.validate import validate

aten = torch.ops.aten


class EmptyPassAttention(torch.nn.Module):
    """Phi-3's attention: the query and key are ``cat((rotated, pass_through), -1)`` with an empty
    pass-through part, then SDPA, ``transpose(1, 2).contiguous()`` and the output projection.
    ``fused_qkv``: one q/k/v projection split by ``chunk`` (its backward concatenates the three gradients)."""

    def __init__(self, dim: int = 256, heads: int = 4, fused_qkv: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.projections = torch.nn.ModuleList(
            [torch.nn.Linear(dim, 3 * dim, bias=False)] if fused_qkv
            else [torch.nn.Linear(dim, dim, bias=False) for _ in range(3)])
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        parts = self.projections[0](x).chunk(3, -1) if len(self.projections) == 1 \
            else [p(x) for p in self.projections]
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in parts)
        rotary = d // self.heads
        q = torch.cat((q[..., :rotary] * 0.5, q[..., rotary:]), dim=-1)
        k = torch.cat((k[..., :rotary] * 0.5, k[..., rotary:]), dim=-1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(o.transpose(1, 2).contiguous().reshape(b, s, d))


class EmptyPassLM(torch.nn.Module):
    def __init__(self, vocab: int = 1024, dim: int = 256, fused_qkv: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.Sequential(*(EmptyPassAttention(dim, fused_qkv=fused_qkv) for _ in range(2)))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def _export():
    torch.manual_seed(0)
    return torch.export.export(EmptyPassLM().train(), (torch.randint(0, 1024, (4, 128)),))


def test_the_copy_after_attention_is_gone_and_the_cats_are_clones():
    program = capture(_export(), options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="cross_entropy"))
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    cats = [n for n in nodes if getattr(n.target, "overloadpacket", None) is aten.cat]
    assert all(0 not in a.meta["val"].shape for n in cats for a in n.args[0])   # the backward's q/k/v cat only
    flash = [n for n in nodes if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert len(flash) == 2
    for node in flash:          # sequence-major, as the projection's output the query came from
        assert node.meta["val"][0].transpose(1, 2).is_contiguous()
    # the forward copies left: none of the attention output (only the query/key kernels' own outputs)
    copies = [n for n in nodes if getattr(n.target, "ops", None) == ("clone",) and n.target.phase == "forward"]
    assert copies == [], [n.target.members for n in copies]


def test_compiled_training_peak_equals_the_real_step(tmp_path):
    """With the copy counted (saved for the output projection's weight gradient) the prediction was +8.2%."""
    path = tmp_path / "attention.pt2"
    torch.export.save(_export(), str(path))
    r = validate(str(path), train=True, compile=True, loss="cross_entropy", db="none", repeats=1, warmup=0, threads=1)
    assert abs(r.memory_error) <= 0.01, (r.predicted_peak_above_start_bytes, r.measured_peak_above_start_bytes)
