"""Cost rules for convolutions (forward, transposed, backward).

Derivation (forward, weight ``[C_out, C_in/groups, *kernel]``; transposed weight
``[C_in, C_out/groups, *kernel]``), following ``torch.utils.flop_counter.conv_flop_count``:

1. a regular conv visits every *output* position; a transposed conv scatters every *input*
   position (it is the gradient of a regular conv);
2. at each such position it does ``w[0] * w[1] * prod(kernel)`` multiply-adds for every batch
   element, and ``w[0] * w[1]`` already accounts for groups;
3. so ``flops = 2 * N * prod(spatial) * prod(w.shape)`` with ``spatial`` the output (regular) or
   input (transposed) spatial sizes;
4. a bias adds ``out.numel`` FLOPs (``flop_counter`` leaves it out; we count it, so the
   difference to ``FlopCounterMode`` is exactly the bias elements);
5. bytes: input, weight and bias read once, output written once.

Worked backward example (1-D, ``x = {A, B, C}``, ``w = {i, j}``, ``out = {Ai+Bj, Bi+Cj}``,
``grad_out = {D, E}``):

- grad_input ``{Di, Dj+Ei, Ej}`` is ``conv_transpose(grad_out, w)``: the forward count with
  ``transposed`` flipped, spatial taken from ``grad_out``;
- grad_weight ``{AD+BE, BD+CE}`` is ``conv(x, grad_out)`` with batch and channel dims swapped;
- grad_bias is ``grad_out`` summed over batch and space: ``grad_out.numel`` adds.

Each requested gradient (``output_mask``) is its own kernel and reads its own inputs.

Example::

    >>> # 2*N*prod(out spatial)*prod(w.shape) = 2*1*(6*6)*(4*3*3*3) = 7776
    >>> x = TensorSpec((1, 3, 8, 8), (192, 64, 8, 1), torch.float32)  # doctest: +SKIP

Known limitations:
- NB: padding positions are counted as real work (as ``flop_counter`` does).
- NB: only compulsory traffic: im2col / implicit-GEMM re-reads of the input and cuDNN workspaces
  are not counted.
"""
from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch

from boomfx.passes.costs.pointwise import bytes_of, first_output, unique_bytes
from boomfx.passes.costs.registry import ZERO, Cost, OpCall, register_cost
from boomfx.passes.specs import SymExpr, TensorSpec

aten = torch.ops.aten


def _prod(values: Sequence[Any]) -> SymExpr:
    return sympy.Mul(*values) if len(values) else sympy.Integer(1)


def conv_flops(x_shape: Sequence[Any], w_shape: Sequence[Any], out_shape: Sequence[Any],
               transposed: bool) -> SymExpr:
    """``2 * N * prod(spatial) * prod(w_shape)``, spatial from ``x`` if transposed else from ``out``."""
    spatial = (x_shape if transposed else out_shape)[2:]
    return 2 * x_shape[0] * _prod(spatial) * _prod(w_shape)


def _swap01(shape: Sequence[Any]) -> list[Any]:
    return [shape[1], shape[0], *shape[2:]]


_TRANSPOSED_PACKETS = frozenset({aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d})


def _is_transposed(call: OpCall) -> bool:
    if call.op.overloadpacket in _TRANSPOSED_PACKETS:
        return True
    return bool(call.arg("transposed", False))


@register_cost(aten.convolution, aten._convolution, aten.conv1d, aten.conv2d, aten.conv3d,
               aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d,
               aten.cudnn_convolution, aten.cudnn_convolution_transpose, aten.convolution_overrideable,
               aten._slow_conv2d_forward, aten.mkldnn_convolution, aten.miopen_convolution)
def conv_cost(call: OpCall) -> Cost:
    """Forward (or transposed) convolution: steps 1-5 of the module docstring."""
    x, w, out = call.arg("input", call.arg("self")), call.arg("weight"), first_output(call)
    if not isinstance(x, TensorSpec) or out is None:
        return ZERO
    if x.ndim == w.ndim - 1:  # unbatched input [C, *spatial]: treat as N = 1
        x_shape, out_shape = [1, *x.shape], [1, *out.shape]
    else:
        x_shape, out_shape = list(x.shape), list(out.shape)
    flops = conv_flops(x_shape, list(w.shape), out_shape, _is_transposed(call))
    bias = call.arg("bias")
    if isinstance(bias, TensorSpec):
        flops = flops + out.numel
    return Cost(flops, bytes_of([x, w, bias]), unique_bytes(out))


@register_cost(aten.convolution_backward)
def conv_backward_cost(call: OpCall) -> Cost:
    """Sum of the requested gradient kernels (module docstring, worked example).

    - grad_input: ``conv_flops(grad_out, w, grad_input, not transposed)``; reads grad_out, weight.
    - grad_weight: ``conv_flops(x^T, grad_out^T, grad_w^T)`` (regular) or
      ``conv_flops(grad_out^T, x^T, grad_w^T)`` (transposed); reads grad_out, input.
    - grad_bias: ``grad_out.numel`` adds; reads grad_out.
    """
    g, x, w = call.arg("grad_output"), call.arg("input"), call.arg("weight")
    mask = list(call.arg("output_mask") or [True, True, True])
    transposed = bool(call.arg("transposed"))
    outs = list(call.outputs) + [None] * 3
    total = ZERO
    if mask[0] and isinstance(outs[0], TensorSpec):
        flops = conv_flops(list(g.shape), list(w.shape), list(outs[0].shape), not transposed)
        total = total + Cost(flops, bytes_of([g, w]), unique_bytes(outs[0]))
    if mask[1] and isinstance(outs[1], TensorSpec):
        gw = _swap01(outs[1].shape)
        if transposed:
            flops = conv_flops(_swap01(g.shape), _swap01(x.shape), gw, False)
        else:
            flops = conv_flops(_swap01(x.shape), _swap01(g.shape), gw, False)
        # NB: x^T and grad_out^T span all channels, but with groups each weight group only sees its
        # own C_in/groups x C_out/groups block: divide by groups (flop_counter does not; equal for 1).
        flops = flops / (call.arg("groups") or 1)
        total = total + Cost(flops, bytes_of([g, x]), unique_bytes(outs[1]))
    if len(mask) > 2 and mask[2] and isinstance(outs[2], TensorSpec):
        total = total + Cost(g.numel, unique_bytes(g), unique_bytes(outs[2]))
    return total
