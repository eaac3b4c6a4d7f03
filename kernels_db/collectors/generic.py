"""Generic family sweep: indexing and list ops that models contain but that fit no other family.

``embedding`` (int64 indices inside the vocabulary), ``cat`` (a list of tensors), ``index_select``,
``copy_`` (in place), and ``_foreach_add_`` (the list-of-tensors update optimizers use).
"""

from __future__ import annotations

from typing import Sequence

import torch

from boomfx.kernels_db.collectors import Config, build_call, check_grid, spec
from boomfx.passes.costs.registry import OpCall

aten = torch.ops.aten

OPS = ("embedding", "cat", "index_select", "copy_", "foreach_add_")
_ROWS = {"tiny": [256], "small": [256, 4096, 32768], "large": [256, 4096, 32768, 262144]}
_WIDTHS = {"tiny": [64], "small": [64, 768], "large": [64, 768, 4096]}


def configs(dtypes: Sequence[torch.dtype], grid: str = "small") -> list[Config]:
    check_grid(grid)
    return [
        {"op": op, "rows": r, "width": w, "dtype": dtype}
        for dtype in dtypes
        for op in OPS
        for r in _ROWS[grid]
        for w in _WIDTHS[grid]
    ]


def make_call(config: Config) -> OpCall:
    op, rows, width, dtype = config["op"], config["rows"], config["width"], config["dtype"]
    if op == "embedding":
        vocab = spec((32000, width), dtype)
        return build_call(aten.embedding.default, (vocab, spec((rows,), torch.int64)))
    if op == "cat":
        half = spec((rows, width), dtype)
        return build_call(aten.cat.default, ([half, half], -1))
    if op == "index_select":
        return build_call(
            aten.index_select.default, (spec((rows, width), dtype), 0, spec((rows // 2,), torch.int64))
        )
    if op == "copy_":
        return build_call(aten.copy_.default, (spec((rows, width), dtype), spec((rows, width), dtype)))
    if op == "foreach_add_":
        params = [spec((rows, width), dtype), spec((width,), dtype), spec((width, width), dtype)]
        return build_call(aten._foreach_add_.List, (params, params), {"alpha": 0.5})
    raise KeyError(f"generic collector has no op {op!r}")
