"""Cost rules for Fourier transforms (``torch.fft``, ``torch.stft``) and grid sampling (spatial transformers).

Derivation:

1. a complex FFT of length ``n`` costs ``5 n log2 n`` FLOPs (the radix-2 count every FFT library quotes); a
   real-input (or real-output) transform half of that, ``2.5 n log2 n``; a batch of them, that times the
   number of transforms (the tensor's elements outside the transformed dimensions);
2. ``stft``: one real transform of ``n_fft`` per frame (``2.5 n_fft log2 n_fft``) plus the window's multiply
   (``n_fft``), frames read from the signal (each sample read ``n_fft / hop`` times: frames x ``n_fft``
   elements), the spectrum written;
3. ``grid_sampler`` (bilinear): per output element 4 input taps, 2 FLOPs each, plus the grid's coordinate
   arithmetic (about 10 FLOPs per output location); the grid read, the taps read from the input, the output
   written; its backward does it twice (input and grid gradients) and zero-fills the input's gradient;
4. ``affine_grid_generator``: a 2x3 (or 3x4) matrix per batch applied to every location: 6 (12) FLOPs per
   point, the grid written.

Example::

    >>> # fft_rfft of [4, 10, 64] along the last dim: 40 transforms x 2.5 x 64 x 6 = 38,400 FLOPs
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import sympy
import torch

from boomfx.passes.costs.pointwise import bytes_of, first_output, read_all, unique_bytes, written_all
from boomfx.passes.costs.registry import Cost, OpCall, register_cost
from boomfx.passes.specs import SymExpr, TensorSpec

aten = torch.ops.aten
COMPLEX_FFT_FLOPS = 5.0      # x n log2 n
REAL_FFT_FLOPS = 2.5
GRID_TAP_FLOPS = 2
GRID_COORDINATE_FLOPS = 10


def _log2(n: Any) -> SymExpr:
    return sympy.log(n, 2) if not isinstance(n, int) else sympy.Float(math.log2(max(n, 2)))


def _transform_flops(real_domain: TensorSpec, dims: Sequence[int], per_point: float) -> SymExpr:
    """``per_point x n log2 n`` per transform over ``dims`` of ``real_domain``, times the transforms."""
    length = sympy.Integer(1)
    for d in dims:
        length = length * real_domain.shape[d]
    transforms = real_domain.numel / length
    return per_point * transforms * length * _log2(length)


def _dims(call: OpCall, spec: TensorSpec) -> list[int]:
    dims = call.arg("dim")
    if dims is None:
        return [spec.ndim - 1]
    return [int(d) % spec.ndim for d in (dims if isinstance(dims, (list, tuple)) else [dims])]


@register_cost(aten._fft_r2c, aten._fft_c2r, aten._fft_c2c, aten.fft_rfft, aten.fft_irfft, aten.fft_fft,
               aten.fft_ifft, aten.fft_hfft, aten.fft_ihfft)
def fft_cost(call: OpCall) -> Cost:
    """Step 1: the transform over its real-domain tensor (the input of r2c, the output of c2r; a complex one
    either), read once and written once."""
    x, out = call.arg("self"), first_output(call)
    name = call.op.overloadpacket.__name__
    complex_both = name in ("_fft_c2c", "fft_fft", "fft_ifft")
    real_domain = out if name in ("_fft_c2r", "fft_irfft", "fft_hfft") else x
    per_point = COMPLEX_FFT_FLOPS if complex_both else REAL_FFT_FLOPS
    return Cost(_transform_flops(real_domain, _dims(call, real_domain), per_point), read_all(call), written_all(call))


@register_cost(aten.stft)
def stft_cost(call: OpCall) -> Cost:
    """Step 2: frames x (a real transform of ``n_fft`` + the window's multiply)."""
    x, out = call.arg("self"), first_output(call)
    n_fft = call.arg("n_fft")
    # complex output [..., freq, frames]; the deprecated real form [..., freq, frames, 2]
    frames = out.shape[-1] if out.dtype.is_complex else out.shape[-2]
    batch = x.numel / x.shape[-1]
    flops = batch * frames * (REAL_FFT_FLOPS * n_fft * _log2(n_fft) + n_fft)
    read = batch * frames * n_fft * x.itemsize + bytes_of([call.arg("window")])
    return Cost(flops, read, written_all(call))


@register_cost(aten.grid_sampler, aten.grid_sampler_2d, aten.grid_sampler_3d)
def grid_sampler_cost(call: OpCall) -> Cost:
    """Step 3, forward: the taps of every output element and the grid's coordinates."""
    x, grid, out = call.arg("input"), call.arg("grid"), first_output(call)
    taps = 2 ** (x.ndim - 2)
    locations = grid.numel / grid.shape[-1]
    flops = out.numel * taps * GRID_TAP_FLOPS + locations * GRID_COORDINATE_FLOPS
    read = unique_bytes(grid) + out.numel * taps * x.itemsize
    return Cost(flops, read, written_all(call))


@register_cost(aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward)
def grid_sampler_backward_cost(call: OpCall) -> Cost:
    """Step 3, backward: the forward's work for each of the two gradients, the input's gradient zero-filled."""
    x, grid, grad = call.arg("input"), call.arg("grid"), call.arg("grad_output")
    taps = 2 ** (x.ndim - 2)
    locations = grid.numel / grid.shape[-1]
    flops = 2 * (grad.numel * taps * GRID_TAP_FLOPS + locations * GRID_COORDINATE_FLOPS)
    read = bytes_of([grad, grid]) + grad.numel * taps * x.itemsize
    return Cost(flops, read, written_all(call) + grad.numel * taps * x.itemsize)


@register_cost(aten.affine_grid_generator)
def affine_grid_cost(call: OpCall) -> Cost:
    """Step 4: the batch's affine map applied to every location of the grid it writes."""
    out = first_output(call)
    per_point = 6 if out.shape[-1] == 2 else 12
    return Cost(out.numel / out.shape[-1] * per_point, read_all(call), written_all(call))
