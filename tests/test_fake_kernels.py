"""Ops whose torch meta function fails on symbolic sizes are traced by boomfx.fake_kernels with the
outputs torch's meta function gives on concrete sizes."""
from __future__ import annotations

import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from boomfx.training.fake_kernels import fake_kernel_fixes

aten = torch.ops.aten


def _attention_with_bias_grad(q, k, v, bias):
    out = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
    return torch.autograd.grad(out[0].sum(), (q, k, v, bias))


def _inputs(mode: FakeTensorMode, seq) -> list[torch.Tensor]:
    with mode:
        qkv = [torch.empty(2, 4, seq, 16, requires_grad=True) for _ in range(3)]
        return [*qkv, torch.empty(2, 4, seq, seq, requires_grad=True)]


def _grads(graph: torch.fx.Graph) -> list:
    node = next(n for n in graph.nodes if n.target is aten._scaled_dot_product_efficient_attention_backward.default)
    return node, node.meta["val"]


def test_efficient_attention_bias_gradient_traces_with_symbolic_sizes() -> None:
    """T5's position bias needs a gradient: the backward is one node whose bias gradient has the bias's
    shape in a buffer padded to 16 columns, exactly what torch's meta function gives for 17 tokens."""
    concrete = FakeTensorMode()
    with concrete:
        reference = make_fx(_attention_with_bias_grad)(*_inputs(concrete, 17))
    _, want = _grads(reference.graph)
    assert want[3].shape == (2, 4, 17, 17) and want[3].stride() == (4 * 17 * 32, 17 * 32, 32, 1)  # 17 -> 32

    env = ShapeEnv()
    symbolic = FakeTensorMode(shape_env=env)
    seq = env.create_symintnode(env.create_symbol(17, ConstantSource("seq"), dynamic_dim=DimDynamic.DYNAMIC), hint=17)
    with fake_kernel_fixes(), symbolic:
        traced = make_fx(_attention_with_bias_grad)(*_inputs(symbolic, seq))
    node, got = _grads(traced.graph)
    assert list(node.args[10]) == [True, True, True, True]          # recorded as called: bias grad asked
    for g, w in zip(got, want):
        hint = env.guarding_hint_or_throw
        assert [hint(s.node.expr) if isinstance(s, torch.SymInt) else s for s in g.shape] == list(w.shape)
        assert [hint(s.node.expr) if isinstance(s, torch.SymInt) else s for s in g.stride()] == list(w.stride())


def test_integer_histc_traces_with_the_float_forms_shape() -> None:
    """transformers' MoE routing counts tokens per expert with histc; a CUDA/meta export records it on int32,
    which torch's meta function refuses on the CPU device (as the CPU kernel does). The traced node has
    the output the float form gives: [bins] in the input's dtype."""
    def count(x):
        return torch.histc(x, bins=4, min=0, max=3)

    with FakeTensorMode():
        ints = torch.empty(12, dtype=torch.int32)
        floats = torch.empty(12)
    with fake_kernel_fixes():
        traced = make_fx(count)(ints)
    reference = make_fx(count)(floats)
    (got,) = [n.meta["val"] for n in traced.graph.nodes if n.target is aten.histc.default]
    (want,) = [n.meta["val"] for n in reference.graph.nodes if n.target is aten.histc.default]
    assert tuple(got.shape) == tuple(want.shape) == (4,) and got.dtype == torch.int32
