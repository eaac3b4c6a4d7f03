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

# (name, batch, in channels, size, kernel, groups, stride, out channels, channels_last)
CASES = [
    ("depthwise3x3", 4, 48, 24, 3, 48, 1, 48, False),
    ("depthwise5x5-s2", 4, 40, 20, 5, 40, 2, 40, False),
    ("dense3x3", 4, 24, 20, 3, 1, 1, 40, False),
    ("grouped3x3-g2", 4, 24, 20, 3, 2, 1, 24, False),
    ("depthwise7x7-channels-last", 4, 96, 6, 7, 96, 1, 96, True),
]


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec.from_tensor(t)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_convolution_scratch_matches_profiler(case, backward) -> None:
    _, n, c, h, k, g, s, co, cl = case
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = torch.randn(n, c, h, h).contiguous(memory_format=fmt)
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
        go = torch.randn_like(y)
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
