"""Memory-bound kernels of a mixed-precision training step, each mapped to a calibrated bandwidth class.

The fp32 public data (NeuSight) calibrates three classes of memory-bound kernels per GPU: streaming
elementwise ops, layer norm and softmax (``gpu_model_core.memory_time_ns``: a floor plus bytes over an
achieved bandwidth that depends on the row length). These kernels are bandwidth-bound at every precision
(PyTorch's elementwise and norm kernels load 16-byte vectors for fp32 and bf16 alike), so a kernel at
another dtype is priced by the *bytes it moves* on its class's curve:

* ``elementwise``: autocast casts (``_to_copy``), every other pointwise op at any dtype, dropout and its
  backward, the multi-tensor-apply ``_foreach_*`` optimizer kernels and fused Adam/AdamW/SGD (one
  stream over all the tensors of the list), the fp16 gradient scaler's
  ``_amp_foreach_non_finite_check_and_unscale_`` / ``_amp_update_scale_``, ``cat``, and full or
  batch reductions (``sum``, ``mean``: one read of the input, which is what bounds them);
* ``layer_norm``: layer / RMS norm forward and backward (row = last dimension);
* ``softmax``: softmax and log-softmax forward and backward in any dtype (the fp32 loss softmax of an
  autocast step included) and ``nll_loss`` forward/backward.

Bytes are the project's cost formulas' (``passes/costs``: every tensor read once, written once).
NB: reductions over a non-contiguous axis (bias gradients) and the optimizer's foreach kernels may reach
a lower bandwidth than a streaming op; no public data here measures them, so they share the class.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import sympy
import torch

from boomfx.passes.costs.registry import OpCall, price_call
from boomfx.passes.specs import TensorSpec

aten = torch.ops.aten

_ELEMENTWISE_PACKETS = (
    "_to_copy", "copy", "copy_", "clone", "fill", "fill_", "zero", "zero_", "masked_fill", "native_dropout",
    "native_dropout_backward", "cat", "sum", "mean", "where", "add", "add_", "sub", "sub_", "mul", "mul_",
    "div", "div_", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "silu", "relu", "gelu",
    "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "threshold_backward", "abs",
    "clamp", "clamp_min", "maximum", "minimum", "reciprocal", "lerp", "addcmul", "addcdiv", "erf",
    "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_", "_fused_adam_", "_fused_adamw_",
    "_fused_adam", "_fused_adamw", "_fused_sgd_", "_fused_sgd",
)
_NORM_PACKETS = ("native_layer_norm", "native_layer_norm_backward", "layer_norm", "rms_norm", "_fused_rms_norm",
                 "_fused_rms_norm_backward")
_SOFTMAX_PACKETS = ("_softmax", "softmax", "_log_softmax", "log_softmax", "_softmax_backward_data",
                    "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")


def _packets(names: tuple[str, ...]) -> frozenset:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


CLASS_OF_PACKET: Mapping[Any, str] = {
    **{p: "elementwise" for p in _packets(_ELEMENTWISE_PACKETS)},
    **{p: "layer_norm" for p in _packets(_NORM_PACKETS)},
    **{p: "softmax" for p in _packets(_SOFTMAX_PACKETS)},
}


def bandwidth_class(op: Any) -> Optional[str]:
    """The calibrated class of ``op`` (an OpOverload), including every ``_foreach_*`` op; None if none."""
    packet = op.overloadpacket
    if packet in CLASS_OF_PACKET:
        return CLASS_OF_PACKET[packet]
    if packet.__name__.startswith("_foreach_"):
        return "elementwise"
    return None


def _int(value: Any) -> int:
    expr = sympy.sympify(value)
    if expr.free_symbols:
        raise ValueError(f"unbound symbols {sorted(map(str, expr.free_symbols))}: bind sizes first")
    return int(expr)


def bandwidth_problem(call: OpCall) -> Optional[tuple[str, int, int]]:
    """(class, bytes moved, row length) of a memory-bound call, else None."""
    cls = bandwidth_class(call.op)
    if cls is None:
        return None
    _, read, written = price_call(call).cost.evaluate()
    nbytes = _int(read) + _int(written)
    tensors = call.tensor_args()
    row = 1
    if cls != "elementwise" and tensors and isinstance(tensors[0], TensorSpec) and tensors[0].ndim:
        row = _int(tensors[0].shape[-1])
    return cls, nbytes, row
