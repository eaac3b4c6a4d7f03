"""Inductor's post-grad ``addmm`` rewrite (passes/post_grad.py): which sums of a product it rewrites, and
what that does to a tied-weight gradient."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from boomfx.frontend.capture import capture
from boomfx.passes.post_grad import fuse_addmm
from boomfx.core.program import ProgramOptions


class MmAdd(nn.Module):
    def __init__(self, transposes: int = 0, reuse: bool = False, then_relu: bool = False) -> None:
        super().__init__()
        self.transposes, self.reuse, self.then_relu = transposes, reuse, then_relu

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        p = torch.mm(a, b)
        q = p
        for _ in range(self.transposes):
            q = q.t()
        out = q + c
        if self.reuse:
            out = out * p                      # the product has a second user: no rewrite
        return torch.relu(out) if self.then_relu else out


def _targets(model: nn.Module, c: torch.Tensor, backend: str = "cpu") -> list:
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    program = fuse_addmm(capture(torch.export.export(model, (a, b, c))), backend)
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("model, c, rewritten", [
    (MmAdd(), torch.randn(4, 6), True),
    (MmAdd(), torch.randn(6), True),                        # a bias expandable to the product
    (MmAdd(transposes=2), torch.randn(4, 6), True),         # t(t(mm)): the pointless pair goes first
    (MmAdd(transposes=1), torch.randn(6, 4), False),        # a real transpose: no addmm
    (MmAdd(reuse=True), torch.randn(4, 6), False),
    (MmAdd(), torch.randn(4, 6, dtype=torch.float64), False),   # mixed dtypes
])
def test_which_sums_become_addmm(model, c, rewritten):
    targets = _targets(model, c)
    assert (torch.ops.aten.addmm.default in targets) is rewritten
    assert (torch.ops.aten.mm.default in targets) is not rewritten


def test_gpu_keeps_a_sum_feeding_pointwise_ops():
    """On a GPU Inductor prefers the unfused sum when every user of it is pointwise (it fuses there)."""
    model, c = MmAdd(then_relu=True), torch.randn(4, 6)
    assert torch.ops.aten.addmm.default in _targets(model, c, "cpu")
    assert torch.ops.aten.addmm.default not in _targets(model, c, "gpu")


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.wte(idx)))


def test_tied_weight_gradient_is_one_addmm_at_the_end():
    """GPT-2-style tie: the shared weight's gradient is the embedding gradient plus the head's product,
    one ``addmm`` where the sum was (Inductor's output code: ``addmm(embedding_grad, grad_logits^T, h)``
    last in the backward), so the logits' gradient lives until then."""
    model, idx = TiedLM(), torch.randint(0, 64, (2, 8))
    program = capture(model, idx, options=ProgramOptions(train=True, compile=True, target_kind="cpu"))
    grads = {fqn: name for name, fqn in program.grad_nodes.items()}
    by_name = {n.name: n for n in program.graph.nodes}
    grad = by_name[grads["wte.weight"]]
    assert grad.target is torch.ops.aten.addmm.default and program.phase_of(grad) == "backward"
    backward = [n for n in program.graph.nodes if program.phase_of(n) == "backward" and n.op == "call_function"]
    assert backward.index(grad) > len(backward) // 2
    assert not any(n.target is torch.ops.aten.mm.default and tuple(n.meta["val"].shape) == (64, 16)
                   for n in program.graph.nodes)
