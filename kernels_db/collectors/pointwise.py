"""Pointwise family sweep: common unary/binary elementwise ops over log-spaced element counts.

Memory-bound kernels depend on bytes moved, not on rank, so the grid is 1-D per op (element counts
4x apart) and lookup interpolates achieved bytes/s against size.
"""

from __future__ import annotations

from typing import Sequence

import torch

from boomfx.kernels_db.collectors import Config, build_call, check_grid, spec
from boomfx.passes.costs.registry import OpCall

aten = torch.ops.aten

UNARY = (
    aten.relu.default,
    aten.gelu.default,
    aten.silu.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.exp.default,
    aten.neg.default,
    aten.clone.default,
    aten.rsqrt.default,
)
BINARY = (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor)
_NUMELS = {
    "tiny": [2**10, 2**14],
    "small": [4**i for i in range(5, 12)],
    "large": [4**i for i in range(5, 15)],
}


def configs(dtypes: Sequence[torch.dtype], grid: str = "small") -> list[Config]:
    check_grid(grid)
    ops = UNARY + BINARY if grid != "tiny" else (aten.relu.default, aten.add.Tensor)
    return [{"op": op, "numel": n, "dtype": dtype} for dtype in dtypes for op in ops for n in _NUMELS[grid]]


def make_call(config: Config) -> OpCall:
    op, numel, dtype = config["op"], config["numel"], config["dtype"]
    tensors = [spec((numel,), dtype)] * (2 if op in BINARY else 1)
    return build_call(op, tuple(tensors))
