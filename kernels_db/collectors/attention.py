"""Attention family sweep: ``aten.scaled_dot_product_attention`` over batch x heads, sequence, head dim.

Causal and non-causal variants are separate keys (``is_causal`` is part of the key), so the causal
half-work saving is measured, not assumed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from boomfx.kernels_db.collectors import Config, build_call, check_grid, spec
from boomfx.passes.costs.registry import OpCall

aten = torch.ops.aten

_BATCH_HEADS = {"tiny": [(1, 2)], "small": [(1, 8), (4, 12)], "large": [(1, 16), (4, 32), (16, 32)]}
_SEQS = {"tiny": [32], "small": [128, 256, 512, 1024], "large": [256, 512, 1024, 2048, 4096, 8192]}
_HEAD_DIMS = {"tiny": [16], "small": [64], "large": [64, 128]}


def configs(dtypes: Sequence[torch.dtype], grid: str = "small") -> list[Config]:
    check_grid(grid)
    return [
        {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": causal, "dtype": dtype}
        for dtype in dtypes
        for b, h in _BATCH_HEADS[grid]
        for s in _SEQS[grid]
        for d in _HEAD_DIMS[grid]
        for causal in (False, True)
    ]


def make_call(config: Config) -> OpCall:
    shape = (config["batch"], config["heads"], config["seq"], config["head_dim"])
    q = spec(shape, config["dtype"])
    return build_call(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0, config["causal"]))
