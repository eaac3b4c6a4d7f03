"""Which kernel eager PyTorch runs a CPU convolution with, and so which fixed cost the call pays.

ATen sends a convolution to oneDNN (``mkldnn_convolution``) or to its own im2col kernels
(``thnn_conv2d`` / ``_slow_conv2d_forward``) by a size rule (``ConvParams::use_mkldnn``,
``aten/src/ATen/native/Convolution.cpp``): a float32 call goes to oneDNN when it has several groups, a
kernel larger than 3x3, a batch above one, or more than 20480 input elements (and, single-threaded, is
not an unstrided 1x1 of a batch under 16); bf16/fp16 go to oneDNN where the CPU supports them. The two
paths' fixed costs differ by an order of magnitude: on the 2-vCPU development VM a one-element call is
~5 us on the native path and ~41 us through oneDNN (its primitive lookup and the weight's reorder out of
the plain layout), and its backward ~45 us per gradient it computes. A MobileNetV2 at batch 8 makes 52
such calls whose own work is a few microseconds: priced from the native path's floor, its step was
58% under (``benchmarks/results/cpu_accuracy_nodb_rerun.md``).

``host_probe`` measures both paths' floors; ``cpu_model`` charges the one the call's route pays.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

aten = torch.ops.aten
FORWARD_OPS = (aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution, aten._convolution)
BACKWARD_OPS = (aten.convolution_backward,)
ONEDNN = "onednn"
NATIVE = "native"


def _ints(value: Any, n: int) -> tuple[int, ...]:
    """A stride/dilation argument as ``n`` ints (a single value, or a one-element list, repeats)."""
    out = tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)
    return out * n if len(out) == 1 else out


def _low_precision_on_onednn(dtype: torch.dtype) -> bool:
    """Whether this CPU runs bf16/fp16 convolutions through oneDNN (``mkldnn_bf16_device_check``)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
    return False


def runs_onednn(input_shape: Sequence[int], weight_shape: Sequence[int], stride: Sequence[int],
                dilation: Sequence[int], groups: int, dtype: torch.dtype, threads: int) -> bool:
    """ATen's ``use_mkldnn`` for a convolution of these sizes at ``threads`` intra-op threads (a 1-D
    convolution's sizes are viewed as 2-D first, as ATen does)."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if dtype in (torch.bfloat16, torch.float16):
        return _low_precision_on_onednn(dtype)
    if dtype != torch.float32:
        return False
    x = list(input_shape)
    w = list(weight_shape)
    if len(x) == 3:                       # view1d_as_2d: [N, C, L] -> [N, C, 1, L]
        x.insert(2, 1)
        w.insert(2, 1)
    if len(x) < 4 or len(w) < 3:
        return False
    strided = any(s != 1 for s in stride)
    dilated = any(d != 1 for d in dilation)
    not_plain_1x1 = strided or dilated or x[0] >= 16 or w[-1] != 1 or w[-2] != 1 or threads > 1
    large = groups > 1 or (w[-1] > 3 and w[-2] > 3) or x[0] > 1 or x[0] * x[1] * x[2] * x[3] > 20480
    return not_plain_1x1 and large


def _shape(spec: Any) -> Optional[tuple[int, ...]]:
    try:
        return tuple(int(d) for d in spec.shape)
    except (AttributeError, TypeError):
        return None


def route(call: Any, threads: int) -> Optional[str]:
    """``ONEDNN`` or ``NATIVE`` for a (non-transposed) convolution call, None for any other op or sizes
    that are not numbers."""
    packet = call.op.overloadpacket
    if packet not in FORWARD_OPS + BACKWARD_OPS or call.arg("transposed", False):
        return None
    x, w = _shape(call.arg("input")), _shape(call.arg("weight"))
    if x is None or w is None:
        return None
    n = max(len(x) - 2, 1)
    try:
        stride, dilation = _ints(call.arg("stride", 1), n), _ints(call.arg("dilation", 1), n)
        groups = int(call.arg("groups", 1))
    except (TypeError, ValueError):
        return None
    dtype = getattr(call.arg("input"), "dtype", torch.float32)
    return ONEDNN if runs_onednn(x, w, stride, dilation, groups, dtype, threads) else NATIVE


def floor_key(call: Any, threads: int) -> Optional[str]:
    """The ``HostProfile.op_floors_ns`` entry a convolution call pays (None: not a convolution): the
    probe's ``conv2d`` and ``convolution`` calls (conv1d/conv3d read ``convolution``'s), ``@onednn`` on
    that path; oneDNN's backward runs one primitive per gradient of input and weight it is asked for."""
    path = route(call, threads)
    if path is None:
        return None
    if call.op.overloadpacket in BACKWARD_OPS:
        mask = call.arg("output_mask") or (True, True, True)
        if path == NATIVE:
            return "convolution_backward"
        return "convolution_backward@onednn" if mask[0] and mask[1] else "convolution_backward@onednn_one"
    name = "conv2d" if call.op.overloadpacket is aten.conv2d else "convolution"
    return f"{name}@onednn" if path == ONEDNN else name
