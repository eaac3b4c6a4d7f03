"""Scratch memory of CPU convolutions, for memory predictions without a measured database.

PyTorch's CPU convolutions run oneDNN (mkldnn) kernels that compute in blocked layouts (nChw8c/16c).
With tensors in the default contiguous (NCHW) layout the kernel reorders its input and weight into a
blocked copy, then computes into a blocked output buffer that it reorders back: the two phases do not
overlap, so the forward's scratch peak is ``max(input + weight, output)``. The backward (input and
weight gradients) holds blocked copies of the incoming gradient and the input at once, plus the
weight: ``input + output + weight``. Channels-last tensors are already in a layout the kernels use
and take (almost) none. These are allocations of the CPU allocator inside one aten op: a real step's
profiler peak has them, the graph's tensors do not.

Measured on this repository's CPU host (torch 2.13.0, oneDNN, AVX2; profiler peak of single
``aten.convolution`` / ``convolution_backward`` calls minus their outputs, 8 configurations: depthwise
3x3 s1/s2, pointwise 1x1 widening/narrowing, dense 3x3, grouped g=4, the 3-channel stem s2, dense 3x3
16->48 at 64x64): the forward rule within 0.4% in all 8, the backward within 1% in 7 of 8 (the stem:
766 KiB measured, 896 KiB by the rule). With one intra-op thread a 1x1 stride-1 unpadded convolution
runs as a plain GEMM on NCHW and takes none (measured: 0 B; 2 MiB with 2 threads).

Depthwise weight gradients: with a channels-last input and a kernel larger than 3x3 (ConvNeXt's 7x7),
the backward's weight gradient takes ``257 x`` the weight's bytes of scratch, whatever the batch, the
image size or the thread count (measured: 256.8-257.1x for C = 32..256, k = 4, 5, 7, 1 and 2 threads;
3x3: none; only when the weight gradient is requested): ``DEPTHWISE_WGRAD_SCRATCH_PER_WEIGHT``.

On 12 further configurations (tests/test_cpu_scratch.py: channel counts that are not multiples of
16, stride 2, 5x5, groups 2) the blocked copies are padded to 16 channels (``CHANNEL_BLOCK``) for dense convolutions and
depthwise forwards (a 40-channel depthwise forward: 325 KiB real, 254 KiB unpadded, 305 KiB padded),
dense and grouped backwards, not for grouped forwards or depthwise backwards (a 24-channel g=2
forward: exactly the unpadded sizes), nor for fewer than 16 channels (the 3-channel stem: the padded
rule made ResNet inference +51%); with that the rules hold within 7% of the real scratch there.

Which layout a call runs in is oneDNN's choice in ATen (``mkldnn_conv_use_channels_last``): channels-last
when the input or the weight *suggests* it (``suggest_memory_format``, c10's
``is_channels_last_strides_2d``), else contiguous; an operand in neither that layout is copied into it
first (``.contiguous(memory_format)``), and the copy is scratch too. Measured (1 thread, depthwise 7x7
backward, 8x32x16x16): input in (N, H, C, W) order with a contiguous incoming gradient 512 KiB = the input's
copy + the contiguous path's 256 KiB; a channels-last input with a contiguous gradient 1830 KiB = the 257x
partials + the gradient's copy. Inductor's backward hands depthwise backwards exactly those (N, H, C, W)
inputs (passes/layout.py).

Contiguous depthwise backwards with kernels larger than 3x3 take another path than 3x3 (which takes
``input + grad_output``): the input gradient takes ``input + weight``; the weight gradient keeps partials of
``4 x weight`` bytes per thread, the first thread's in the input gradient's space:
``max(input + weight, 4 weight) + 4 weight x (threads - 1)``. Measured on 13 shapes (k = 5, 7; C = 32..256;
stride 1 and 2): median error 9% / 11% / 14% at 1 / 2 / 4 threads, worst -28% / +48% / +46% (with more
threads the partials sometimes fit inside the input gradient's space and sometimes not; at one thread the
5x5 on 40 channels at 20x20 is the -28%: the partials grow with the image there, not modelled); 3x3 at
both thread counts within 4%.

Dense convolutions on channels-last activations (Inductor's forward, and its backward's saved
operands) read the activations as they are, but make the weight channels-last if it is not (a copy)
and reorder it into a blocked copy (both channel dimensions padded to ``CHANNEL_BLOCK``); the backward
also holds the weight gradient's own buffer: forward ``copy + blocked``, backward
``copy + weight + blocked``. Measured on 8 shapes (2x2 stride 2, 3x3, 1x1; 16..512 channels) at 1 and 2
threads: 2.00-2.38x / 3.00x the weight with a contiguous weight (forward / backward), 2.00x with a
channels-last weight's backward; within 8% of the rule except small forwards (a 32->64 2x2 and 1x1
convolutions at 2 threads: 72-76 KiB real, 64 KiB by the rule); a 1x1 stride-1 convolution at one
thread is a plain GEMM again (0). Grouped (not depthwise) convolutions get the same rule, unmeasured.

1-d convolutions run as 2-d ones on ``[N, C, 1, L]`` views (ATen's ``view1d_as_2d``) and take the same rules
(measured, 2 threads, AVX-512 host: 4 forwards, 3 of them exactly the rule's, a 40->24 channel one 1.17x;
backwards exact but for a 1-channel stem). Transposed convolutions (oneDNN's deconvolution, contiguous):
the forward holds two plain copies of its output (measured 2.00x on 4 shapes, 32 and 64 output channels,
and 1-d; 24 channels: exactly 2x, unpadded), with fewer than 16 output channels the input's blocked copy
and the plain output (a 32 -> 3 channel 4x4 stride 2: 2428 KiB real, 2816 KiB by the rule); the backward
the input's plain and the incoming gradient's blocked copies (exact on 2 shapes, 24 channels within 3%),
with fewer than 16 output channels the input's (2062 KiB real, 2048 by the rule). Not modelled: a strided
dense 1-d backward (48 -> 32 channels, kernel 9, stride 2) took 4.55 MB against the rule's 3.13 MB.

Known limitations: other ISAs (AVX-512, AMX) block by 16 and may pick other paths; a database
measures the real scratch (``workspace_bytes``) and always wins over this model.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from boomfx.passes.specs import TensorSpec

aten = torch.ops.aten
CHANNEL_BLOCK = 16       # channels of a blocked copy are padded to this (40 -> 48 measured: nChw16c)
DEPTHWISE_WGRAD_SCRATCH_PER_WEIGHT = 257   # x weight bytes (see the module docstring)
DEPTHWISE_WGRAD_PARTIALS_PER_THREAD = 4    # x weight bytes, contiguous depthwise backward, kernel > 3x3
FORWARD_OPS = (aten.conv2d.default, aten.conv1d.default, aten.convolution.default, aten._convolution.default,
               aten.conv_transpose2d.input, aten.conv_transpose1d.default)
BACKWARD_OPS = (aten.convolution_backward.default,)
TRANSPOSED_OPS = (aten.conv_transpose2d.input, aten.conv_transpose1d.default)


def _bytes(spec: Any) -> int:
    return int(math.prod(int(s) for s in spec.shape)) * spec.dtype.itemsize


def _plain_bytes(spec: Any) -> int:
    return _bytes(spec)


def _blocked_bytes(spec: Any, channel_dims: tuple[int, ...] = (1,)) -> int:
    """Bytes of a blocked copy: the channel dimension(s) padded to a multiple of CHANNEL_BLOCK."""
    shape = [int(s) for s in spec.shape]
    for d in channel_dims:
        if shape[d] >= CHANNEL_BLOCK:    # a 3-channel image stays plain (oneDNN's first-layer path)
            shape[d] = -(-shape[d] // CHANNEL_BLOCK) * CHANNEL_BLOCK
    return int(math.prod(shape)) * spec.dtype.itemsize


def suggests_channels_last(spec: Any) -> bool:
    """c10's ``is_channels_last_strides_2d`` (what ``suggest_memory_format`` answers) for a 4-D spec: the
    strides fall in the order C, W, H, N; ambiguous cases (size-1 dimensions) count as contiguous."""
    shape = [int(s) for s in spec.shape]
    stride = [int(s) for s in spec.stride]
    if len(shape) != 4 or stride[1] == 0:
        return False
    smallest = 0
    for d in (1, 3, 2, 0):
        if shape[d] == 0 or stride[d] < smallest or (d == 0 and smallest == stride[1]):
            return False
        smallest = stride[d] * (shape[d] if shape[d] > 1 else 1)
    return True


def _dense(spec: Any, inner_first: Sequence[int]) -> bool:
    """Whether ``spec`` is laid out densely with its dimensions in ``inner_first`` order, size-1
    dimensions ignored (as ``is_contiguous`` does): making it so copies nothing."""
    shape = [int(s) for s in spec.shape]
    stride = [int(s) for s in spec.stride]
    expected = 1
    for d in inner_first:
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def _dense_channels_last(spec: Any) -> bool:
    return _dense(spec, (1, 3, 2, 0))


def _contiguous(spec: Any) -> bool:
    """Whether a tensor is in its default (NCHW) order."""
    return _dense(spec, range(len(spec.shape) - 1, -1, -1))


def _pointwise_gemm(weight: Any, call: Any) -> bool:
    k = [int(s) for s in weight.shape[2:]]
    stride = call.arg("stride") or [1, 1]
    padding = call.arg("padding") or [0, 0]
    groups = int(call.arg("groups") or 1)
    return all(x == 1 for x in k) and all(int(s) == 1 for s in stride) and all(int(p) == 0 for p in padding) \
        and groups == 1


def _is_depthwise(call: Any, inp: Any, weight: Any) -> bool:
    groups = int(call.arg("groups") or 1)
    return groups > 1 and groups == int(inp.shape[1]) and int(weight.shape[1]) == 1


def _kernel_area(weight: Any) -> int:
    return int(math.prod(int(s) for s in weight.shape[2:]))


def _copied_bytes(operands: tuple[Any, ...], channels_last: bool) -> int:
    """Bytes of the operands the call copies into the layout it runs in (``.contiguous(memory_format)``)."""
    return sum(_bytes(t) for t in operands
               if t is not None and not (_dense_channels_last(t) if channels_last else _contiguous(t)))


def _as_image(spec: Any) -> Any:
    """A 1-d convolution's ``[N, C, L]`` operand as the ``[N, C, 1, L]`` image ATen runs it as (oneDNN's 2-d
    kernels: ``view1d_as_2d``); other specs unchanged."""
    if spec is None or len(spec.shape) != 3:
        return spec
    shape, stride = tuple(spec.shape), tuple(spec.stride)
    return TensorSpec((*shape[:2], 1, shape[2]), (*stride[:2], stride[2] * shape[2], stride[2]), spec.dtype)


def _transposed_scratch(backward: bool, inp: Any, out: Any) -> int:
    """A transposed convolution (oneDNN's deconvolution), contiguous (see the module docstring)."""
    if out is None:
        return 0
    wide = int(out.shape[1]) >= CHANNEL_BLOCK
    if backward:
        return _plain_bytes(inp) + (_blocked_bytes(out) if wide else 0)
    return 2 * _plain_bytes(out) if wide else _blocked_bytes(inp) + _plain_bytes(out)


def _contiguous_depthwise_backward(call: Any, inp: Any, weight: Any, threads: int) -> int:
    """Contiguous depthwise backward with a kernel larger than 3x3 (see the module docstring)."""
    mask = call.arg("output_mask") or [True, True, True]
    grad_input = _bytes(inp) + _bytes(weight) if mask[0] else 0
    if not mask[1]:
        return grad_input
    partials = DEPTHWISE_WGRAD_PARTIALS_PER_THREAD * _bytes(weight)
    # the first thread's partials share the input gradient's space; every further thread adds its own
    return max(grad_input, partials) + partials * (max(threads, 1) - 1)


def convolution_scratch_bytes(call: Any, threads: Optional[int] = None) -> int:
    """Bytes a CPU convolution allocates inside itself (0 for other ops; see the module docstring)."""
    op = call.op
    if op not in FORWARD_OPS and op not in BACKWARD_OPS:
        return 0
    try:
        inp = _as_image(call.arg("input"))
        weight = _as_image(call.arg("weight"))
        if inp is None or weight is None or len(inp.shape) != 4:
            return 0
        grad_out = _as_image(call.arg("grad_output")) if op in BACKWARD_OPS else None
        if op in BACKWARD_OPS and grad_out is None:
            return 0
        if op in TRANSPOSED_OPS or call.arg("transposed"):
            out = _as_image(call.outputs[0]) if op in FORWARD_OPS and call.outputs else grad_out
            return _transposed_scratch(op in BACKWARD_OPS, inp, out)
        depthwise = _is_depthwise(call, inp, weight)
        channels_last = suggests_channels_last(inp) or suggests_channels_last(weight)
        copies = _copied_bytes((inp, grad_out), channels_last)
        threads = torch.get_num_threads() if threads is None else threads
        if channels_last and depthwise:
            # the kernels read the activations as they are; a depthwise forward reorders its (contiguous)
            # weight once; a depthwise weight gradient with a kernel over 3x3 keeps per-weight partials
            mask = call.arg("output_mask") or [True, True, True]
            if op in BACKWARD_OPS:
                partials = bool(mask[1]) and _kernel_area(weight) > 9
                return copies + (DEPTHWISE_WGRAD_SCRATCH_PER_WEIGHT * _bytes(weight) if partials else 0)
            return copies + (_bytes(weight) if _contiguous(weight) else 0)
        if threads == 1 and _pointwise_gemm(weight, call):
            return copies
        if channels_last:
            # a dense kernel reads the activations as they are but reorders the weight into a blocked
            # copy (after making it channels-last); its backward also holds the weight gradient's
            blocked_weight = _blocked_bytes(weight, channel_dims=(0, 1))
            return (copies + _copied_bytes((weight,), True) + blocked_weight
                    + (_bytes(weight) if op in BACKWARD_OPS else 0))
        if op in FORWARD_OPS:
            out = call.outputs[0] if call.outputs else None
            if out is None:
                return copies
            groups = int(call.arg("groups") or 1)
            blocked = _blocked_bytes if groups == 1 or depthwise else _plain_bytes
            return copies + max(blocked(inp) + _bytes(weight), blocked(out))
        if depthwise and _kernel_area(weight) > 9:
            return copies + _contiguous_depthwise_backward(call, inp, weight, threads)
        blocked = _plain_bytes if depthwise else _blocked_bytes
        return copies + blocked(inp) + blocked(grad_out) + _bytes(weight)
    except (TypeError, ValueError):          # unbound symbolic sizes: no scratch claimed
        return 0
