"""Pooling cost formulas: hand-derived numbers and the equivalence adaptive 1x1 average == mean."""
import sympy
import torch

from test_costs_conv import price, spec   # the same spec/price helpers the conv formulas are tested with

aten = torch.ops.aten
F32 = 4
n = sympy.Symbol("n", positive=True, integer=True)


def test_max_pool2d_with_indices() -> None:
    x, out, idx = spec(n, 16, 32, 32), spec(n, 16, 16, 16), spec(n, 16, 16, 16, dtype=torch.int64)
    cost = price(aten.max_pool2d_with_indices.default, x, [2, 2], [2, 2], outputs=(out, idx))
    assert sympy.simplify(cost.flops - n * 4096 * 4) == 0            # out n*16*16*16, 2*2 compares each
    assert sympy.simplify(cost.bytes_read - n * 16384 * F32) == 0    # x n*16*32*32
    assert sympy.simplify(cost.bytes_written - n * 4096 * (F32 + 8)) == 0   # values + int64 indices


def test_avg_pool2d_adds_one_divide_per_output() -> None:
    x, out = spec(2, 8, 9, 9), spec(2, 8, 3, 3)
    cost = price(aten.avg_pool2d.default, x, [3, 3], [3, 3], outputs=(out,))
    assert cost.flops == 144 * (9 + 1)            # out 2*8*3*3 = 144; 3*3 adds + 1 divide


def test_adaptive_average_to_one_pixel_equals_mean() -> None:
    """torch decomposes a 1x1 adaptive average into mean over H, W: both must cost the same."""
    x, out = spec(n, 32, 4, 4), spec(n, 32, 1, 1)
    pooled = price(aten._adaptive_avg_pool2d.default, x, [1, 1], outputs=(out,))
    mean = price(aten.mean.dim, x, [-1, -2], True, outputs=(out,))
    assert sympy.simplify(pooled.flops - mean.flops) == 0
    assert sympy.simplify(pooled.flops - n * 32 * 17) == 0             # 16 adds + 1 divide per channel
    assert sympy.simplify(pooled.bytes_moved - mean.bytes_moved) == 0
