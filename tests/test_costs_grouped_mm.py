"""Grouped matmul of mixture-of-experts layers (passes/costs/grouped_mm.py): hand-derived numbers for
each layout, torch's FlopCounterMode over the per-group mm loop the op stands for, and transformers'
fallback op priced alike whether registered or a stand-in."""
from __future__ import annotations

import pytest
import sympy
import torch
from torch.utils.flop_counter import FlopCounterMode

from boomfx.passes.costs.registry import Cost, OpCall, price_call
from boomfx.passes.foreign_ops import define_foreign_op
from boomfx.passes.kernels import OP_CLASS_MATMUL, op_class
from boomfx.passes.specs import TensorSpec, contiguous_strides

aten = torch.ops.aten
F32, I32 = 4, 4


def spec(*shape, dtype=torch.float32) -> TensorSpec:
    shape = tuple(sympy.sympify(s) for s in shape)
    return TensorSpec(shape, contiguous_strides(shape), dtype)


def price(op, *args, outputs=(), **kwargs) -> Cost:
    priced = price_call(OpCall.build(op, args, kwargs, outputs))
    assert priced.modelled, priced.reason
    return priced.cost


def test_moe_layout_counts_every_routed_row_once() -> None:
    # 3 tokens x top-2 = 6 routed rows, K=4, 8 experts of [4, 8]: 2*6*4*8 = 384 FLOPs
    cost = price(aten._grouped_mm.default, spec(6, 4), spec(8, 4, 8), spec(8, dtype=torch.int32),
                 outputs=(spec(6, 8),))
    assert cost.flops == 2 * 6 * 4 * 8 == 384
    # reads x 6*4, all 8 experts' weights 8*4*8 and offs 8 (int32); writes 6*8
    assert cost.bytes_read == F32 * (6 * 4 + 8 * 4 * 8) + I32 * 8 == 1152
    assert cost.bytes_written == F32 * 6 * 8 == 192


def test_grouped_k_layout_sums_the_k_groups() -> None:
    # self [M=3, sum K=8], mat2 [8, N=4], 2 groups -> out [2, 3, 4]: 2*3*4*8 = 192 (not 2*out.numel*8 = 384)
    cost = price(aten._grouped_mm.default, spec(3, 8), spec(8, 4), spec(2, dtype=torch.int32),
                 outputs=(spec(2, 3, 4),))
    assert cost.flops == 2 * 3 * 4 * 8 == 192


def test_batched_and_grouped_n_layouts() -> None:
    # batched [G=2, M=3, K=4] x [2, 4, N=5] -> [2, 3, 5]: 2*2*3*5*4 = 240
    assert price(aten._grouped_mm.default, spec(2, 3, 4), spec(2, 4, 5), outputs=(spec(2, 3, 5),)).flops == 240
    # [G=3, M=2, K=4] x [4, sum N=9] -> [2, 9]: 2*2*9*4 = 144
    assert price(aten._grouped_mm.default, spec(3, 2, 4), spec(4, 9), spec(3, dtype=torch.int32),
                 outputs=(spec(2, 9),)).flops == 144


def test_symbolic_tokens_stay_symbolic() -> None:
    s = sympy.Symbol("s0", positive=True, integer=True)
    cost = price(aten._grouped_mm.default, spec(2 * s, 64), spec(4, 64, 256), spec(4, dtype=torch.int32),
                 outputs=(spec(2 * s, 256),))
    assert sympy.simplify(cost.flops - 2 * (2 * s) * 64 * 256) == 0


@pytest.mark.parametrize("offsets", [[2, 2, 6], [0, 6, 6], [1, 3, 6]])
def test_matches_flop_counter_over_the_per_group_loop(offsets: list[int]) -> None:
    """The op stands for one mm per group; FlopCounterMode counts that loop, whatever the split."""
    x, w = torch.randn(6, 4), torch.randn(3, 4, 8)
    with FlopCounterMode(display=False) as counter:
        start = 0
        for g, end in enumerate(offsets):
            if end > start:
                torch.mm(x[start:end], w[g])
            start = end
    out = torch._grouped_mm(x, w, torch.tensor(offsets, dtype=torch.int32))   # the real op's output shape
    cost = price(aten._grouped_mm.default, spec(6, 4), spec(3, 4, 8), spec(3, dtype=torch.int32),
                 outputs=(spec(*out.shape),))
    assert cost.flops == counter.get_total_flops() == 2 * 6 * 4 * 8


def test_transformers_fallback_stand_in_is_priced_and_classed_as_a_matmul() -> None:
    op = define_foreign_op("transformers::grouped_mm_fallback", "default",
                           "(Tensor input, Tensor weight, Tensor offs) -> Tensor")
    cost = price(op, spec(6, 4), spec(8, 4, 8), spec(8, dtype=torch.int32), outputs=(spec(6, 8),))
    assert cost == price(aten._grouped_mm.default, spec(6, 4), spec(8, 4, 8), spec(8, dtype=torch.int32),
                         outputs=(spec(6, 8),))
    assert op_class(op) == OP_CLASS_MATMUL


def test_transformers_fallback_backward_is_two_products() -> None:
    op = define_foreign_op("transformers::grouped_mm_fallback_backward", "default",
                           "(Tensor input, Tensor weight, Tensor offs, Tensor grad_output) -> (Tensor, Tensor)")
    cost = price(op, spec(6, 4), spec(8, 4, 8), spec(8, dtype=torch.int32), spec(6, 8),
                 outputs=(spec(6, 4), spec(8, 4, 8)))
    # grad_input [6,8]x[8,4]: 2*6*8*4 = 384; grad_weight per expert [4,S_g]x[S_g,8], summed: 2*4*6*8 = 384
    assert cost.flops == 384 + 384


@pytest.mark.slow
def test_mixtral_expert_flops_in_a_real_export(zoo) -> None:
    """Default-experts Mixtral (tests/hf_zoo.py): 2 layers, hidden 64, intermediate 128, 4 experts, top-2."""
    import boomfx
    ep, path = zoo("mixtral")
    targets = [str(n.target) for n in ep.graph.nodes if "grouped_mm" in str(n.target)]
    assert targets == ["transformers.grouped_mm_fallback.default"] * 4
    report = boomfx.analyze(path, device="h100-sxm", dims={"batch": 2, "seq": 16})
    experts = [k for k in report.kernels if "grouped_mm" in k.op]
    # S = 2*16 tokens x top-2 = 64 rows; gate_up: 2*64*64*256 = 2_097_152; down: 2*64*128*64 = 1_048_576
    assert sorted(k.flops for k in experts) == [1_048_576] * 2 + [2_097_152] * 2
    assert all(k.modelled for k in experts) and "transformers.grouped_mm_fallback.default" not in report.unmodelled_ops
