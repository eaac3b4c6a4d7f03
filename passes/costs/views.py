"""View and metadata ops: they launch no kernel, so they cost nothing.

``VIEW_OPS`` (passes/op_sets.py) is the one named set of ops whose output aliases an input's storage (no data moved);
``METADATA_OPS`` holds shape queries and runtime assertions that produce no tensor data. Both are
registered with a zero ``Cost``; ``is_view_op`` lets other passes (liveness, block grouping) ask
the same question from the same source of truth.

Example::

    >>> is_view_op(torch.ops.aten.view.default)
    True
    >>> is_view_op(torch.ops.aten.add.Tensor)
    False

Known limitations:
- NB: ``reshape``/``flatten``/``unflatten`` alias when the input's strides allow it and copy
  otherwise; they are priced as views (free). Export and make_fx graphs normally show the copy as
  a separate ``clone``/``_unsafe_view`` pair when one happens, so this rarely under-counts.
- NB: ``_conj``/``resolve_conj``/``resolve_neg`` are free for real tensors only.
"""
from __future__ import annotations

import torch

from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.op_sets import METADATA_OPS, VIEW_OPS, is_view_op  # noqa: F401  (is_view_op re-exported)

aten = torch.ops.aten

@register_cost(*VIEW_OPS, *METADATA_OPS)
def view_cost(call: OpCall) -> Cost:
    """Views only rewrite sizes/strides/offset on the host; metadata ops read no tensor data."""
    return ZERO
