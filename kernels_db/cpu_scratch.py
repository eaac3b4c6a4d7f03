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

Known limitations: a dense convolution on channels-last activations still takes some scratch
(86 KiB for a 24->40 3x3 at 20x20, not modelled: 0 here); other ISAs (AVX-512, AMX) block by 16 and may pick other paths; a database
measures the real scratch (``workspace_bytes``) and always wins over this model.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

aten = torch.ops.aten
CHANNEL_BLOCK = 16       # channels of a blocked copy are padded to this (40 -> 48 measured: nChw16c)
DEPTHWISE_WGRAD_SCRATCH_PER_WEIGHT = 257   # x weight bytes (see the module docstring)
FORWARD_OPS = (aten.conv2d.default, aten.convolution.default, aten._convolution.default)
BACKWARD_OPS = (aten.convolution_backward.default,)


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


def _contiguous(spec: Any) -> bool:
    """Whether a 4-D tensor is in NCHW order (channels-last strides have C innermost)."""
    shape = [int(s) for s in spec.shape]
    stride = [int(s) for s in spec.stride]
    expected, ok = 1, True
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            ok = False
            break
        expected *= size
    return ok


def _pointwise_gemm(weight: Any, call: Any) -> bool:
    k = [int(s) for s in weight.shape[2:]]
    stride = call.arg("stride") or [1, 1]
    padding = call.arg("padding") or [0, 0]
    groups = int(call.arg("groups") or 1)
    return all(x == 1 for x in k) and all(int(s) == 1 for s in stride) and all(int(p) == 0 for p in padding) \
        and groups == 1


def _depthwise_wgrad_partials(call: Any, inp: Any, weight: Any) -> bool:
    """A depthwise weight gradient of a channels-last input with a kernel larger than 3x3."""
    groups = int(call.arg("groups") or 1)
    mask = call.arg("output_mask") or [True, True, True]
    kernel = math.prod(int(s) for s in weight.shape[2:])
    return (groups > 1 and groups == int(inp.shape[1]) and int(weight.shape[1]) == 1 and bool(mask[1])
            and kernel > 9 and not _contiguous(inp))


def convolution_scratch_bytes(call: Any, threads: Optional[int] = None) -> int:
    """Bytes a CPU convolution allocates inside itself (0 for other ops; see the module docstring)."""
    op = call.op
    if op not in FORWARD_OPS and op not in BACKWARD_OPS:
        return 0
    try:
        inp = call.arg("input")
        weight = call.arg("weight")
        if inp is None or weight is None or len(inp.shape) != 4:
            return 0
        if op in BACKWARD_OPS and _depthwise_wgrad_partials(call, inp, weight):
            return DEPTHWISE_WGRAD_SCRATCH_PER_WEIGHT * _bytes(weight)
        if not (_contiguous(inp) and _contiguous(weight)) or not _contiguous(inp):
            # channels-last: the kernels read the activations as they are; a depthwise forward
            # reorders its (contiguous) weight once
            depthwise = int(weight.shape[1]) == 1 and int(call.arg("groups") or 1) > 1
            return _bytes(weight) if op in FORWARD_OPS and depthwise and _contiguous(weight) else 0
        threads = torch.get_num_threads() if threads is None else threads
        if threads == 1 and _pointwise_gemm(weight, call):
            return 0
        out = call.outputs[0] if call.outputs else None
        if op in FORWARD_OPS:
            if out is None:
                return 0
            groups = int(call.arg("groups") or 1)
            blocked = _blocked_bytes if groups == 1 or groups == int(inp.shape[1]) else _plain_bytes
            return max(blocked(inp) + _bytes(weight), blocked(out))
        grad_out = call.arg("grad_output")
        if grad_out is None:
            return 0
        depthwise = int(call.arg("groups") or 1) == int(inp.shape[1]) > 1
        blocked = _plain_bytes if depthwise else _blocked_bytes
        return blocked(inp) + blocked(grad_out) + _bytes(weight)
    except (TypeError, ValueError):          # unbound symbolic sizes: no scratch claimed
        return 0
