"""CPU convolution scratch without a database (kernels_db/cpu_scratch.py) against the real allocator.

Truth: the profiler peak of one real ``aten.convolution`` / ``convolution_backward`` call minus the
tensors it returns. The configurations here are not the ones the rules were read from (see the
module's docstring). The rules model oneDNN's reorders into blocked copies, not its exact choices:
tolerance 8% plus 8 KiB (small bookkeeping allocations). Not covered (a known limitation the module
states): dense convolutions on channels-last activations.
"""
from __future__ import annotations

import pytest
import torch

from boomfx.kernels_db.cpu_scratch import convolution_scratch_bytes
from boomfx.memory.live_bytes import profiler_peak_bytes
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec

aten = torch.ops.aten
SLACK_BYTES = 8 * 1024
TOLERANCE = 0.08

# (name, batch, in channels, size, kernel, groups, stride, out channels, input order, gradient order)
CASES = [
    ("depthwise3x3", 4, 48, 24, 3, 48, 1, 48, "nchw", "nchw"),
    ("depthwise5x5-s2", 4, 40, 20, 5, 40, 2, 40, "nchw", "nchw"),
    ("dense3x3", 4, 24, 20, 3, 1, 1, 40, "nchw", "nchw"),
    ("grouped3x3-g2", 4, 24, 20, 3, 2, 1, 24, "nchw", "nchw"),
    ("depthwise7x7-channels-last", 4, 96, 6, 7, 96, 1, 96, "nhwc", "nhwc"),
    # a layout oneDNN does not run in: the operand is copied into the one it picks (Inductor's backward
    # hands a depthwise backward an (N, H, C, W) input and a contiguous gradient: passes/layout.py)
    ("depthwise3x3-nhcw-input", 4, 72, 10, 3, 72, 1, 72, "nhcw", "nchw"),
    ("depthwise7x7-channels-last-contiguous-grad", 2, 48, 10, 7, 48, 1, 48, "nhwc", "nchw"),
    # dense channels-last (Inductor's forward): the weight made channels-last, then blocked
    ("dense3x3-channels-last", 4, 48, 10, 3, 1, 1, 96, "nhwc", "nhwc"),
    ("dense2x2-s2-channels-last", 4, 96, 8, 2, 1, 2, 192, "nhwc", "nhwc"),
    ("dense3x3-channels-last-odd-channels", 2, 40, 12, 3, 1, 1, 24, "nhwc", "nhwc"),
]
_ORDERS = {"nchw": (0, 1, 2, 3), "nhwc": (0, 2, 3, 1), "nhcw": (0, 2, 1, 3)}


def _in_order(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t``'s values, laid out densely with its dimensions in the named order (outermost first)."""
    order = _ORDERS[name]
    dense = t.permute(*order).contiguous()
    return dense.permute(*[order.index(d) for d in range(4)])


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec.from_tensor(t)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_convolution_scratch_matches_profiler(case, backward) -> None:
    _, n, c, h, k, g, s, co, x_order, grad_order = case
    x = _in_order(torch.randn(n, c, h, h), x_order)
    w = torch.randn(co, c // g, k, k)
    pad = [k // 2, k // 2]
    conv_args = ([s, s], pad, [1, 1], False, [0, 0], g)
    y = aten.convolution(x, w, None, *conv_args)
    if not backward:
        def run() -> None:
            aten.convolution(x, w, None, *conv_args)
        returned = y.numel() * 4
        call = OpCall(aten.convolution.default, {"input": _spec(x), "weight": _spec(w), "bias": None,
                                                 "stride": [s, s], "padding": pad, "dilation": [1, 1],
                                                 "transposed": False, "output_padding": [0, 0], "groups": g},
                      (_spec(y),))
    else:
        go = _in_order(torch.randn(y.shape), grad_order)
        mask = [True, True, False]

        def run() -> None:
            aten.convolution_backward(go, x, w, [co], *conv_args, mask)
        returned = (x.numel() + w.numel()) * 4
        call = OpCall(aten.convolution_backward.default,
                      {"grad_output": _spec(go), "input": _spec(x), "weight": _spec(w), "bias_sizes": [co],
                       "stride": [s, s], "padding": pad, "dilation": [1, 1], "transposed": False,
                       "output_padding": [0, 0], "groups": g, "output_mask": mask},
                      (_spec(x), _spec(w), None))
    run()
    real = profiler_peak_bytes(run) - returned
    predicted = convolution_scratch_bytes(call)
    assert abs(predicted - real) <= TOLERANCE * max(real, predicted) + SLACK_BYTES, (case, backward, predicted, real)


def _backward_scratch(n: int, c: int, h: int, k: int, x_order: str, grad_order: str) -> tuple[int, int]:
    """(real, predicted) scratch of one depthwise ``convolution_backward`` (input and weight gradients)."""
    x = _in_order(torch.randn(n, c, h, h), x_order)
    w = torch.randn(c, 1, k, k)
    conv_args = ([1, 1], [k // 2, k // 2], [1, 1], False, [0, 0], c)
    go = _in_order(torch.randn(n, c, h, h), grad_order)
    mask = [True, True, False]

    def run() -> None:
        aten.convolution_backward(go, x, w, [c], *conv_args, mask)
    run()
    real = profiler_peak_bytes(run) - (x.numel() + w.numel()) * 4
    call = OpCall(aten.convolution_backward.default,
                  {"grad_output": _spec(go), "input": _spec(x), "weight": _spec(w), "bias_sizes": [c],
                   "stride": [1, 1], "padding": [k // 2, k // 2], "dilation": [1, 1], "transposed": False,
                   "output_padding": [0, 0], "groups": c, "output_mask": mask},
                  (_spec(x), _spec(w), None))
    return real, convolution_scratch_bytes(call)


@pytest.mark.parametrize("k", [7, 3])
def test_an_input_in_neither_layout_costs_exactly_its_copy(k) -> None:
    """Inductor's (N, H, C, W) input of a depthwise backward: oneDNN runs the contiguous path and first
    copies the input, so the scratch exceeds the contiguous input's by the input's bytes, whatever the
    path's own scratch is (the kernel-size-dependent part cancels)."""
    real_nhcw, pred_nhcw = _backward_scratch(4, 64, 12, k, "nhcw", "nchw")
    real_nchw, pred_nchw = _backward_scratch(4, 64, 12, k, "nchw", "nchw")
    copy = 4 * 64 * 12 * 12 * 4
    assert pred_nhcw - pred_nchw == copy
    assert abs((real_nhcw - real_nchw) - copy) <= 0.02 * copy + SLACK_BYTES, (real_nhcw, real_nchw, copy)


@pytest.mark.parametrize("shape", [(4, 64, 12, 7), (6, 192, 3, 7), (4, 48, 16, 5)], ids=str)
def test_contiguous_depthwise_large_kernel_backward_one_thread(shape) -> None:
    """The contiguous path of a depthwise backward with a kernel over 3x3 at one thread:
    ``max(input + weight, 4 weight)`` (its per-thread partials scatter more with more threads; the
    module states the measured spread). Shapes other than the ones the rule was read from."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        real, predicted = _backward_scratch(*shape, "nchw", "nchw")
    finally:
        torch.set_num_threads(before)
    assert abs(predicted - real) <= 0.12 * max(real, predicted) + SLACK_BYTES, (shape, predicted, real)


# 1-d and transposed convolutions, at shapes other than the ones their rules were read from:
# (name, input shape, weight shape, stride, padding, transposed, output padding)
ONE_D_AND_TRANSPOSED = [
    ("conv1d", (6, 24, 1500), (48, 24, 5), [1], [2], False, [0]),
    ("conv1d-s2", (4, 48, 3000), (32, 48, 9), [2], [4], False, [0]),   # backward: see KNOWN_GAPS
    ("transposed2d", (8, 96, 12, 12), (96, 48, 4, 4), [2, 2], [1, 1], True, [0, 0]),
    ("transposed1d", (4, 48, 700), (48, 24, 4), [2], [1], True, [0]),
]


# the strided dense 1-d backward holds 1.4 MB more than the rule (kernels_db/cpu_scratch.py says so): strict, so a
# rule that comes to model it says it here
KNOWN_GAPS = {("conv1d-s2", True)}


@pytest.mark.parametrize("case", ONE_D_AND_TRANSPOSED, ids=[c[0] for c in ONE_D_AND_TRANSPOSED])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_one_d_and_transposed_convolution_scratch_matches_profiler(case, backward, request) -> None:
    """A 1-d convolution runs as the 2-d one on ``[N, C, 1, L]``; a transposed one (oneDNN's deconvolution)
    holds two blocked copies of its output forward, the input's and the gradient's plain copies backward."""
    name, x_shape, w_shape, stride, pad, transposed, out_pad = case
    if (name, backward) in KNOWN_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason="strided dense 1-d backward: not modelled"))
    x, w = torch.randn(*x_shape), torch.randn(*w_shape)
    dilation = [1] * len(stride)
    conv_args = (stride, pad, dilation, transposed, out_pad, 1)
    y = aten.convolution(x, w, None, *conv_args)
    named = {"stride": stride, "padding": pad, "dilation": dilation, "transposed": transposed,
             "output_padding": out_pad, "groups": 1}
    if not backward:
        def run() -> None:
            aten.convolution(x, w, None, *conv_args)
        returned = y.numel() * 4
        call = OpCall(aten.convolution.default, {"input": _spec(x), "weight": _spec(w), "bias": None, **named},
                      (_spec(y),))
    else:
        go, mask = torch.randn(y.shape), [True, True, False]

        def run() -> None:
            aten.convolution_backward(go, x, w, None, *conv_args, mask)
        returned = (x.numel() + w.numel()) * 4
        call = OpCall(aten.convolution_backward.default, {"grad_output": _spec(go), "input": _spec(x),
                                                          "weight": _spec(w), "bias_sizes": None,
                                                          **named, "output_mask": mask},
                      (_spec(x), _spec(w), None))
    run()
    real = profiler_peak_bytes(run) - returned
    predicted = convolution_scratch_bytes(call)
    assert real > 0
    assert abs(predicted - real) <= TOLERANCE * max(real, predicted) + SLACK_BYTES, (case, backward, predicted, real)
