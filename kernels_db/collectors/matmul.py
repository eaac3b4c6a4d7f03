"""Matmul family sweep: ``mm``, ``addmm``, ``bmm`` and ``linear`` over log-spaced M, N, K.

Sizes are log-spaced with 1.5x points between powers of two (``log_sizes(per_octave=2)`` on the large
grid), so the database sees aligned and unaligned shapes and lookup can interpolate achieved FLOP/s
rather than time. Weights of ``linear`` are stored (N, K) as ``nn.Linear`` keeps them; ``mm`` is also
swept with a transposed second operand (what ``x @ w.t()`` gives after decomposition).
"""

from __future__ import annotations

from typing import Sequence

import torch

from boomfx.kernels_db.collectors import Config, build_call, check_grid, log_sizes, spec, transposed
from boomfx.passes.costs.registry import OpCall

aten = torch.ops.aten

_SIZES = {"tiny": [16, 64], "small": log_sizes(16, 1024), "large": log_sizes(64, 16384, per_octave=2)}
_BATCHES = {"tiny": [2], "small": [1, 8, 32], "large": [1, 8, 32, 128]}
_BMM_SIZES = {"tiny": [16, 64], "small": log_sizes(16, 512), "large": log_sizes(64, 8192)}


def configs(dtypes: Sequence[torch.dtype], grid: str = "small") -> list[Config]:
    check_grid(grid)
    out: list[Config] = []
    sizes = _SIZES[grid]
    for dtype in dtypes:
        for m in sizes:
            for n in sizes:
                for k in sizes:
                    out.append({"op": "mm", "m": m, "n": n, "k": k, "dtype": dtype, "t_b": False})
                    out.append({"op": "linear", "m": m, "n": n, "k": k, "dtype": dtype})
                    if grid != "large" or (m == n == k):
                        out.append({"op": "mm", "m": m, "n": n, "k": k, "dtype": dtype, "t_b": True})
                        out.append({"op": "addmm", "m": m, "n": n, "k": k, "dtype": dtype})
        for b in _BATCHES[grid]:
            for m in _BMM_SIZES[grid]:
                for k in _BMM_SIZES[grid]:
                    out.append({"op": "bmm", "b": b, "m": m, "n": m, "k": k, "dtype": dtype})
    return out


def make_call(config: Config) -> OpCall:
    m, n, k, dtype = config["m"], config["n"], config["k"], config["dtype"]
    if config["op"] == "mm":
        b = transposed((k, n), dtype) if config["t_b"] else spec((k, n), dtype)
        return build_call(aten.mm.default, (spec((m, k), dtype), b))
    if config["op"] == "addmm":
        return build_call(
            aten.addmm.default, (spec((n,), dtype), spec((m, k), dtype), transposed((k, n), dtype))
        )
    if config["op"] == "linear":
        return build_call(aten.linear.default, (spec((m, k), dtype), spec((n, k), dtype), spec((n,), dtype)))
    if config["op"] == "bmm":
        b = config["b"]
        return build_call(aten.bmm.default, (spec((b, m, k), dtype), spec((b, k, n), dtype)))
    raise KeyError(f"matmul collector has no op {config['op']!r}")
