"""Reduction family sweep: sums, means, maxima, softmax and layer norm over the last dim.

Rows x columns grids cover both "many short rows" (per-token norms) and "few long rows" (vocab
softmax); reductions over the last dim are what transformer and MLP graphs contain.
"""

from __future__ import annotations

from typing import Sequence

import torch

from boomfx.kernels_db.collectors import Config, build_call, check_grid, spec
from boomfx.passes.costs.registry import OpCall

aten = torch.ops.aten

OPS = ("sum", "mean", "amax", "softmax", "log_softmax", "layer_norm")
_ROWS = {"tiny": [64], "small": [64, 512, 4096], "large": [64, 512, 4096, 32768]}
_COLS = {"tiny": [128], "small": [128, 1024, 8192], "large": [128, 1024, 4096, 16384, 65536]}


def configs(dtypes: Sequence[torch.dtype], grid: str = "small") -> list[Config]:
    check_grid(grid)
    ops = OPS if grid != "tiny" else ("sum", "softmax")
    return [
        {"op": op, "rows": r, "cols": c, "dtype": dtype}
        for dtype in dtypes
        for op in ops
        for r in _ROWS[grid]
        for c in _COLS[grid]
    ]


def make_call(config: Config) -> OpCall:
    op, rows, cols, dtype = config["op"], config["rows"], config["cols"], config["dtype"]
    x = spec((rows, cols), dtype)
    if op == "sum":
        return build_call(aten.sum.dim_IntList, (x, [-1]))
    if op == "mean":
        return build_call(aten.mean.dim, (x, [-1]))
    if op == "amax":
        return build_call(aten.amax.default, (x, [-1]))
    if op == "softmax":
        return build_call(aten._softmax.default, (x, -1, False))
    if op == "log_softmax":
        return build_call(aten._log_softmax.default, (x, -1, False))
    if op == "layer_norm":
        return build_call(
            aten.native_layer_norm.default, (x, [cols], spec((cols,), dtype), spec((cols,), dtype), 1e-5)
        )
    raise KeyError(f"reduction collector has no op {op!r}")
