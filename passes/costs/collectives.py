"""Collectives (``torch.ops._c10d_functional``): what one rank's call reads and writes.

These formulas give a collective's BYTES only (0 FLOPs): the tensor this rank hands to the
collective is read once, the tensor it gets back written once. Pricing a collective's time (link
bandwidth, latency, algorithm, overlap) is the collective time model's job (issue 18); until it
lands, the pricer's fallback turns these bytes into a memory-bound time like any data-movement op,
which is NOT a network time. ``wait_tensor`` only waits: no data, no kernel.

Worked example (2 ranks, an all-gather of a [1024] fp32 shard into [2048]): read 1024 x 4 = 4,096 B,
written 2048 x 4 = 8,192 B.

Known limitations:
- NB: the bytes are this rank's buffers, not what crosses the network (a ring all-reduce of n bytes
  sends and receives 2 (N-1)/N n per rank); the time model converts.
"""

from __future__ import annotations

import sympy
import torch

from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost

c10d = torch.ops._c10d_functional


def _bytes(specs: list) -> sympy.Expr:
    return sum((s.nbytes for s in specs), sympy.Integer(0))


@register_cost(
    c10d.all_gather_into_tensor.default,
    c10d.all_gather_into_tensor_out.default,
    c10d.all_gather_into_tensor_coalesced.default,
    c10d.reduce_scatter_tensor.default,
    c10d.reduce_scatter_tensor_out.default,
    c10d.reduce_scatter_tensor_coalesced.default,
    c10d.all_reduce.default,
    c10d.all_reduce_.default,
    c10d.all_reduce_coalesced.default,
    c10d.all_reduce_coalesced_.default,
    c10d.all_to_all_single.default,
    c10d.broadcast.default,
    c10d.broadcast_.default,
)
def collective_cost(call: OpCall) -> Cost:
    """Input tensors read once, outputs written once (an in-place op writes its input back)."""
    inputs = [s for name, v in call.args.items() if name != "out" for s in _flat(v)]
    outputs = call.tensor_outputs()
    return Cost(0, _bytes(inputs), _bytes(outputs))


@register_cost(c10d.wait_tensor.default)
def wait_cost(call: OpCall) -> Cost:
    return ZERO


def _flat(value: object) -> list:
    from boomfx.passes.costs.registry import _flatten_specs

    return _flatten_specs(value)
