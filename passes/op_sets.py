"""The named sets of ops that move no data, in one place (style rule 2: views and factory ops are an explicit set).

- ``VIEW_OPS``: outputs alias an input's storage; priced at zero (passes/costs/views.py). Liveness reads
  aliasing from the op schemas instead (passes/aliasing.py), which agrees with this set.
- ``METADATA_OPS``: shape queries, runtime assertions and profiler markers: no tensor data; priced at zero.
- ``NO_KERNEL_OPS``: ops the kernel pass treats as launching nothing (allocation-only ops such as ``empty``,
  size queries, assertions, ``alias``/``detach``/``lift_fresh``): no launch and no host issue time.
- ``mutates`` / ``draws_random``: what AOTAutograd's and Inductor's graph passes never move or merge across
  (a mutation region's boundary, an op reading the random state), from the op's schema and tags.
"""
from __future__ import annotations

from typing import Any

import torch

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


# Ops that allocate or check but launch no kernel (passes/kernels.py): no launch, no host issue cost.
NO_KERNEL_OPS: frozenset = frozenset({aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.empty, aten.empty_like,
              aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten._assert_async,
              aten._assert_scalar, aten.sym_constrain_range, aten.sym_constrain_range_for_size,
              aten._assert_tensor_metadata, aten.lift_fresh, aten.alias, aten.detach, aten._local_scalar_dense,
              aten.sym_is_contiguous,
              torch.ops._c10d_functional.wait_tensor})   # waits for a collective; moves no data


def mutates(op: Any) -> bool:
    """Whether ``op`` writes one of its inputs (its schema is mutable): the boundary of a mutation region."""
    return isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable


def draws_random(op: Any) -> bool:
    """Whether ``op`` reads the random state (tagged ``nondeterministic_seeded``): never merged or reordered."""
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags
