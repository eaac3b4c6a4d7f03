"""View and metadata ops: they launch no kernel, so they cost nothing.

``VIEW_OPS`` is the one named set of ops whose output aliases an input's storage (no data moved);
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

from typing import Any

import torch

from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost

aten = torch.ops.aten


def _existing(*names: str) -> frozenset:
    """Packets for the names this PyTorch build defines (a few are version-dependent)."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


VIEW_OPS: frozenset = frozenset({
    aten.view, aten._unsafe_view, aten.view_as, aten.reshape, aten.reshape_as, aten._reshape_alias,
    aten.flatten, aten.unflatten, aten.expand, aten.expand_as, aten.permute, aten.transpose,
    aten.transpose_, aten.swapaxes, aten.swapdims, aten.t, aten.t_, aten.numpy_T, aten.mT, aten.mH,
    aten.adjoint, aten.movedim, aten.moveaxis, aten.unsqueeze, aten.unsqueeze_, aten.squeeze,
    aten.squeeze_, aten.slice, aten.select, aten.narrow, aten.alias, aten.as_strided, aten.as_strided_,
    aten.detach, aten.detach_, aten.split, aten.split_with_sizes, aten.unsafe_split,
    aten.unsafe_split_with_sizes, aten.tensor_split, aten.unbind, aten.chunk, aten.unsafe_chunk,
    aten.diagonal, aten.unfold, aten.view_as_real, aten.view_as_complex, aten.real, aten.imag,
    aten.lift_fresh, aten._conj, aten.conj, aten.resolve_conj, aten.resolve_neg, aten._neg_view,
    aten.hsplit, aten.vsplit, aten.dsplit, aten.atleast_1d, aten.atleast_2d, aten.atleast_3d,
    aten.positive, aten._indices, aten._values, aten.indices, aten.values,
}) | _existing("_unsafe_view_copy", "_nested_view_from_buffer")

METADATA_OPS: frozenset = frozenset({
    aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.size, aten.stride,
    aten.numel, aten.dim, aten.is_contiguous, aten._assert_async, aten._assert_scalar,
    aten._assert_tensor_metadata, aten.sym_constrain_range, aten.sym_constrain_range_for_size,
    aten._local_scalar_dense, aten.item, aten.is_same_size, aten.is_nonzero,
    aten._functional_assert_async, aten._functional_sym_constrain_range,
}) | _existing("_functional_assert_scalar", "_print") | frozenset({
    # profiler markers that ``optimizer.step()`` leaves in make_fx graphs: host-side only
    torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit,
    torch.ops.profiler._record_function_enter,
})


def is_view_op(op: Any) -> bool:
    """True when ``op`` (an OpOverload or OpOverloadPacket) returns an alias of an input, moving no data."""
    if op in VIEW_OPS:
        return True
    packet = getattr(op, "overloadpacket", None)
    return packet is not None and packet in VIEW_OPS


@register_cost(*VIEW_OPS, *METADATA_OPS)
def view_cost(call: OpCall) -> Cost:
    """Views only rewrite sizes/strides/offset on the host; metadata ops read no tensor data."""
    return ZERO
