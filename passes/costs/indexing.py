"""Cost rules for data movement: gathers, scatters, concatenation, padding, factories, sort/topk.

These kernels do (almost) no arithmetic; their cost is bytes. The rules, by pattern:

- gather-like (``embedding``, ``index``, ``index_select``, ``gather``): read the indices and only
  the *gathered* elements (``out.numel`` of them), write the output. 0 FLOPs. ``embedding_bag`` gathers
  ``indices.numel`` rows and pools them into bags (one add per gathered element); its dense backward
  zero-fills the whole table's gradient and adds each gathered row's gradient into it.
- scatter-like out of place (``scatter``, ``index_put``, ``index_add``, ``slice_scatter``...):
  copy ``self`` into the output (read self, write out), then read indices + source and write the
  source-sized region again; accumulating variants do one add per source element.
- in-place scatters (``index_put_``, ``scatter_add_``...): no copy; only the source-sized region
  is read and written (plus a read of it when accumulating).
- resizes: nearest upsampling is copy-like; the interpolating ones (linear family, bicubic) read the input
  once and do ``2 x taps`` FLOPs per output element; every backward zero-fills the input's gradient and
  accumulates the output's into it.
- copy-like (``cat``, ``stack``, ``repeat``, ``expand_copy``, ``tril``...): every input read once at
  its own size, output written once. 0 FLOPs. ``constant_pad_nd`` with a border fills its output and then
  copies the input into it: the output written once and the input's bytes again.
- factories (``zeros``, ``full``, ``arange``, ``*_like``, ``new_*``): write the output, read
  nothing; ``empty*`` allocates without touching memory: 0 bytes.

Example::

    >>> # embedding(weight [100, 16] f32, indices [2, 8] i64): read 16*8 + 2*8*16*4 = 640 B,
    >>> # write 2*8*16*4 = 512 B, 0 FLOPs

Known limitations:
- NB: gathers are priced at useful bytes; real kernels fetch whole 32-byte sectors, so scattered
  narrow gathers move more.
- NB: ``sort`` is priced at ``numel * ceil(log2(dim size))`` compare FLOPs with one read and one
  write (a radix sort makes several passes); ``topk`` at one compare per element and one read
  (radix select makes a few passes).
- NB: ``embedding_dense_backward`` is priced as a zero-fill of the weight gradient plus one
  accumulate per ``grad_output`` element; ``scale_grad_by_freq`` counting is ignored.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from boomfx.passes.costs.pointwise import bytes_of, first_output, read_all, unique_bytes, written_all
from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.specs import SymExpr, TensorSpec

aten = torch.ops.aten


def _index_bytes(indices: Any) -> SymExpr:
    """Bytes of an index argument: a tensor, or a list of optional tensors (``index.Tensor``)."""
    if isinstance(indices, (list, tuple)):
        return bytes_of([i for i in indices if isinstance(i, TensorSpec)])
    return unique_bytes(indices)


# ---------------------------------------------------------------------------------------------
# Gathers
# ---------------------------------------------------------------------------------------------

_GATHER_INDEX_ARG = {aten.embedding: "indices", aten.index: "indices", aten._unsafe_index: "indices",
                     aten.index_select: "index", aten.gather: "index", aten.take_along_dim: "indices",
                     aten.take: "index"}


@register_cost(*_GATHER_INDEX_ARG)
def gather_cost(call: OpCall) -> Cost:
    """Read indices + the ``out.numel`` gathered elements; write the output."""
    out = first_output(call)
    index = call.arg(_GATHER_INDEX_ARG[call.op.overloadpacket])
    return Cost(0, _index_bytes(index) + unique_bytes(out), unique_bytes(out))


@register_cost(aten.embedding_dense_backward)
def embedding_backward_cost(call: OpCall) -> Cost:
    """Zero-fill grad_weight (written), then add each grad_output row into it: ``grad.numel`` FLOPs,
    reading grad_output, indices and the touched rows (read-modify-write of ``grad.numel`` elements)."""
    g, out = call.arg("grad_output"), first_output(call)
    touched = g.numel * out.itemsize
    return Cost(g.numel, bytes_of([g, call.arg("indices")]) + touched, unique_bytes(out) + touched)


@register_cost(aten.embedding_bag, aten._embedding_bag, aten._embedding_bag_forward_only)
def embedding_bag_cost(call: OpCall) -> Cost:
    """Pool ``indices.numel`` rows of ``weight`` into bags: reads the indices, offsets, per-sample weights and
    the gathered rows (never the whole table), ``rows x D`` FLOPs (twice with per-sample weights); writes
    the pooled output and the bookkeeping outputs (``offset2bag``, ``bag_size``, ``max_indices``)."""
    weight, indices = call.arg("weight"), call.arg("indices")
    per_sample = call.arg("per_sample_weights")
    rows = indices.numel * weight.shape[-1]
    read = bytes_of([indices, call.arg("offsets"), per_sample]) + rows * weight.itemsize
    return Cost(rows * (2 if isinstance(per_sample, TensorSpec) else 1), read, written_all(call))


@register_cost(aten._embedding_bag_backward, aten._embedding_bag_dense_backward)
def embedding_bag_backward_cost(call: OpCall) -> Cost:
    """The dense weight gradient: the whole ``[num_weights, D]`` table zero-filled (written), then each
    index's bag gradient row added into its row (read-modify-write of ``indices.numel x D`` elements,
    reading the incoming gradient and the bookkeeping tensors)."""
    grad, indices, out = call.arg("grad"), call.arg("indices"), first_output(call)
    touched = indices.numel * grad.shape[-1] * out.itemsize
    bookkeeping = bytes_of([indices, call.arg("offset2bag"), call.arg("bag_size"), call.arg("per_sample_weights")])
    return Cost(indices.numel * grad.shape[-1], unique_bytes(grad) + bookkeeping + touched,
                unique_bytes(out) + touched)


# ---------------------------------------------------------------------------------------------
# Scatters
# ---------------------------------------------------------------------------------------------

# op -> (source argument, index argument, accumulates)
_SCATTERS: dict[Any, tuple[str, str, bool]] = {
    aten.scatter: ("src", "index", False), aten.scatter_add: ("src", "index", True),
    aten.scatter_reduce: ("src", "index", True), aten.index_put: ("values", "indices", False),
    aten._unsafe_index_put: ("values", "indices", False), aten.index_add: ("source", "index", True),
    aten.index_copy: ("source", "index", False), aten.index_fill: ("", "index", False),
    aten.masked_scatter: ("source", "mask", False), aten.slice_scatter: ("src", "", False),
    aten.select_scatter: ("src", "", False), aten.diagonal_scatter: ("src", "", False),
    aten.as_strided_scatter: ("src", "", False),
}
_INPLACE_SCATTERS = {aten.scatter_: aten.scatter, aten.scatter_add_: aten.scatter_add,
                     aten.scatter_reduce_: aten.scatter_reduce, aten.index_put_: aten.index_put,
                     aten.index_add_: aten.index_add, aten.index_copy_: aten.index_copy,
                     aten.index_fill_: aten.index_fill, aten.masked_scatter_: aten.masked_scatter}


def _scatter_region(call: OpCall, src_name: str, index_name: str) -> SymExpr:
    """Elements the scatter writes: the source's, else the index's (scalar ``value`` scatters)."""
    src = call.arg(src_name) if src_name else None
    if isinstance(src, TensorSpec):
        return src.numel
    index = call.arg(index_name)
    return index.numel if isinstance(index, TensorSpec) else sympy.Integer(0)


@register_cost(*_SCATTERS, *_INPLACE_SCATTERS)
def scatter_cost(call: OpCall) -> Cost:
    """Out of place: copy self (read + write), then read index + source and write the region
    (read it too when accumulating, one add per element). In place: region work only."""
    packet = call.op.overloadpacket
    inplace = packet in _INPLACE_SCATTERS
    src_name, index_name, accumulates = _SCATTERS[_INPLACE_SCATTERS.get(packet, packet)]
    accumulates = accumulates or bool(call.arg("accumulate"))
    self_spec = call.arg("self")
    region = _scatter_region(call, src_name, index_name) * self_spec.itemsize
    src = call.arg(src_name) if src_name else None
    read = unique_bytes(src) + (_index_bytes(call.arg(index_name)) if index_name else 0)
    written = region
    if accumulates:
        read = read + region
    if not inplace:
        read, written = read + unique_bytes(self_spec), written + unique_bytes(first_output(call))
    flops = region / self_spec.itemsize if accumulates else 0
    return Cost(flops, read, written)


@register_cost(aten.embedding_renorm_)
def embedding_renorm_cost(call: OpCall) -> Cost:
    """``nn.Embedding(max_norm=...)``: each looked-up row's norm computed (read) and the row rescaled in place
    when over the limit (written, at most once per index): 3 FLOPs per element for the norm and scale."""
    weight, indices = call.arg("self"), call.arg("indices")
    rows = indices.numel * weight.shape[-1] * weight.itemsize
    return Cost(3 * indices.numel * weight.shape[-1], _index_bytes(indices) + rows, rows)


@register_cost(aten.select_backward, aten.slice_backward, aten.diagonal_backward)
def view_backward_cost(call: OpCall) -> Cost:
    """A view's gradient (autograd's ``select_backward``, ``slice_backward``, ``diagonal_backward``): a
    zero-filled tensor of the input's sizes (written) with the incoming gradient copied into the viewed
    region (read, written)."""
    grad, out = call.arg("grad_output"), first_output(call)
    return Cost(0, unique_bytes(grad), unique_bytes(out) + unique_bytes(grad))


# ---------------------------------------------------------------------------------------------
# Copies: concatenation, repetition, padding, masking
# ---------------------------------------------------------------------------------------------

@register_cost(aten.cat, aten.stack, aten.hstack, aten.vstack, aten.split_with_sizes_copy,
               aten.split_copy, aten.unbind_copy, aten.repeat, aten.expand_copy, aten.tile,
               aten.repeat_interleave, aten.reflection_pad1d,
               aten.reflection_pad2d, aten.reflection_pad3d, aten.replication_pad1d, aten.replication_pad2d,
               aten.replication_pad3d, aten.tril, aten.triu, aten.flip, aten.roll, aten.rot90,
               aten.view_copy, aten.permute_copy, aten.transpose_copy, aten.t_copy, aten.slice_copy,
               aten.select_copy, aten.unsqueeze_copy, aten.squeeze_copy, aten.diagonal_copy,
               aten.as_strided_copy, aten.unfold_copy, aten.detach_copy, aten._reshape_copy,
               aten.im2col, aten.col2im, aten.nonzero, aten.masked_select, aten.one_hot,
               aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
               aten.pixel_shuffle, aten.pixel_unshuffle, aten.channel_shuffle, aten.bucketize,
               aten.searchsorted, aten.unique_consecutive, aten._unique2, aten.tril_, aten.triu_)
def copy_like_cost(call: OpCall) -> Cost:
    """Every tensor input read once at its own size; every output written once; 0 FLOPs."""
    written = written_all(call)
    if not call.tensor_outputs() and isinstance(call.arg("self"), TensorSpec):  # in-place tril_/triu_
        written = unique_bytes(call.arg("self"))
    return Cost(0, read_all(call), written)


# interpolating resizes: input taps per output element (each a multiply-add)
_INTERPOLATION_TAPS = {"upsample_linear1d": 2, "upsample_bilinear2d": 4, "upsample_trilinear3d": 8,
                       "upsample_bicubic2d": 16, "_upsample_bilinear2d_aa": 4}


@register_cost(aten.upsample_linear1d, aten.upsample_bilinear2d, aten.upsample_trilinear3d, aten.upsample_bicubic2d,
               aten._upsample_bilinear2d_aa)
def interpolate_cost(call: OpCall) -> Cost:
    """``F.interpolate`` (linear family, bicubic): the input read once (its taps overlap), the output written
    once, ``taps x 2`` FLOPs per output element (2^d taps for (bi/tri)linear, 16 for bicubic)."""
    taps = _INTERPOLATION_TAPS[call.op.overloadpacket.__name__]
    out = first_output(call)
    return Cost(2 * taps * out.numel, read_all(call), written_all(call))


@register_cost(aten.upsample_nearest1d_backward, aten.upsample_nearest2d_backward, aten.upsample_nearest3d_backward,
               aten.upsample_linear1d_backward, aten.upsample_bilinear2d_backward, aten.upsample_trilinear3d_backward,
               aten.upsample_bicubic2d_backward)
def interpolate_backward_cost(call: OpCall) -> Cost:
    """The input's gradient zero-filled, then each output gradient element added into its taps (nearest: 1):
    reads the incoming gradient and read-modify-writes the input's gradient, ``taps x 2`` FLOPs per
    incoming element."""
    name = call.op.overloadpacket.__name__.removesuffix("_backward")
    taps = _INTERPOLATION_TAPS.get(name, 1)
    grad, out = call.arg("grad_output"), first_output(call)
    return Cost(2 * taps * grad.numel, unique_bytes(grad) + unique_bytes(out), 2 * unique_bytes(out))


@register_cost(aten.constant_pad_nd, aten.pad)
def constant_pad_cost(call: OpCall) -> Cost:
    """ATen's ``constant_pad_nd`` (``aten/src/ATen/native/PadNd.cpp``): with any positive pad it fills the
    whole output, then copies the kept input into its interior (two passes over the output's bytes where
    the border is thin); with none it is a narrowed copy (read and written once). ``pad`` with another
    mode is a copy."""
    x, pads = call.arg("self"), call.arg("pad")
    mode = call.arg("mode", "constant")
    if not isinstance(x, TensorSpec) or not isinstance(pads, (list, tuple)) or mode not in (None, "constant"):
        return copy_like_cost(call)
    try:
        grows = any(int(p) > 0 for p in pads)
        shrink = [min(int(pads[2 * i]), 0) + min(int(pads[2 * i + 1]), 0) for i in range(len(pads) // 2)]
    except (TypeError, ValueError):       # symbolic pads: as a copy
        return copy_like_cost(call)
    if not grows:
        return copy_like_cost(call)
    kept = sympy.Integer(x.itemsize)
    for i, dim in enumerate(x.shape):
        back = len(x.shape) - 1 - i                      # pads run from the last dimension backwards
        kept = kept * (dim + shrink[back] if back < len(shrink) else dim)
    return Cost(0, read_all(call), written_all(call) + kept)


# ---------------------------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------------------------

@register_cost(aten.zeros, aten.ones, aten.full, aten.arange, aten.linspace, aten.logspace, aten.eye,
               aten.zeros_like, aten.ones_like, aten.full_like, aten.new_zeros, aten.new_ones,
               aten.new_full, aten.scalar_tensor, aten.hann_window, aten.hamming_window, aten.blackman_window,
               aten.bartlett_window, aten.kaiser_window)
def factory_cost(call: OpCall) -> Cost:
    """Writes its output; reads nothing (a ``*_like``/``new_*`` uses only the template's metadata)."""
    return Cost(0, 0, written_all(call))


@register_cost(aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
               aten.empty_permuted)
def empty_cost(call: OpCall) -> Cost:
    """Allocation only: no kernel, 0 bytes (the memory pass accounts for the allocation)."""
    return ZERO


# ---------------------------------------------------------------------------------------------
# Sorting and selection
# ---------------------------------------------------------------------------------------------

def _dim_size(x: TensorSpec, dim: Any) -> SymExpr:
    if x.ndim == 0:
        return sympy.Integer(1)
    return x.shape[int(dim) % x.ndim]


@register_cost(aten.sort, aten.argsort, aten.msort)
def sort_cost(call: OpCall) -> Cost:
    """``numel * ceil(log2(n))`` compares along a dim of size ``n``; one read, values/indices written."""
    x = call.arg("self")
    if not isinstance(x, TensorSpec):  # aten.sort.int etc. on Python lists
        return ZERO
    n = _dim_size(x, call.arg("dim", -1) if call.arg("dim") is not None else -1)
    compares = x.numel * sympy.ceiling(sympy.log(n, 2)) if n != 1 else sympy.Integer(0)
    return Cost(compares, unique_bytes(x), written_all(call))


@register_cost(aten.topk, aten.kthvalue)
def topk_cost(call: OpCall) -> Cost:
    """One compare per element (radix select), one read; the ``k`` values and indices written."""
    x = call.arg("self")
    return Cost(x.numel, unique_bytes(x), written_all(call))
