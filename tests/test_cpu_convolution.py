"""Which path ATen runs a CPU convolution on (kernels_db/cpu_convolution.py), checked against ATen's own
dispatch under the profiler, and the floor each path's call pays in the CPU model."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from boomfx.core.devices import cpu_spec
from boomfx.kernels_db.cpu_convolution import NATIVE, ONEDNN, floor_key, route, runs_onednn
from boomfx.kernels_db.cpu_model import CpuKernelModel
from boomfx.passes.costs.registry import OpCall
from test_cpu_model import PROFILE
from test_gpu_model import spec

aten = torch.ops.aten

# (input, weight, stride, groups): each side of every clause of ATen's rule
CASES = [
    ((1, 1, 1, 1), (1, 1, 1, 1), 1, 1),       # batch 1, 1x1, tiny: native
    ((2, 1, 1, 1), (1, 1, 1, 1), 1, 1),       # batch 2: oneDNN (multi-threaded)
    ((1, 64, 8, 8), (64, 64, 1, 1), 1, 1),    # batch 1, 4096 elements: native
    ((1, 3, 32, 32), (8, 3, 3, 3), 1, 1),     # batch 1, 3x3, 3072 elements: native
    ((1, 8, 60, 60), (8, 8, 3, 3), 1, 1),     # 28800 elements > 20480: oneDNN
    ((1, 2, 9, 9), (2, 2, 5, 5), 1, 1),       # a kernel larger than 3x3: oneDNN
    ((1, 4, 6, 6), (4, 1, 3, 3), 1, 4),       # depthwise (groups > 1): oneDNN
    ((1, 4, 9, 9), (4, 4, 1, 1), 2, 1),       # strided 1x1, batch 1, small: native
    ((8, 4, 2, 2), (4, 4, 1, 1), 1, 1),       # unstrided 1x1 of batch 8: oneDNN only multi-threaded
    ((16, 4, 2, 2), (4, 4, 1, 1), 1, 1),      # ... of batch 16: oneDNN at any thread count
    ((2, 4, 10), (4, 4, 3), 1, 1),            # conv1d, viewed as 2-D: batch 2, oneDNN
    ((1, 4, 10), (4, 4, 3), 1, 1),            # conv1d, batch 1, small: native
]


def _aten_runs_onednn(x_shape, w_shape, stride, groups) -> bool:
    x, w = torch.ones(x_shape), torch.ones(w_shape)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        aten.convolution(x, w, None, [stride] * (len(x_shape) - 2), [0] * (len(x_shape) - 2),
                         [1] * (len(x_shape) - 2), False, [0] * (len(x_shape) - 2), groups)
    return any(e.key == "aten::mkldnn_convolution" for e in prof.key_averages())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("x_shape,w_shape,stride,groups", CASES)
def test_route_is_atens_own(x_shape, w_shape, stride, groups, threads):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = _aten_runs_onednn(x_shape, w_shape, stride, groups)
    finally:
        torch.set_num_threads(before)
    n = len(x_shape) - 2
    assert runs_onednn(x_shape, w_shape, [stride] * n, [1] * n, groups, torch.float32, threads) == actual
    # and the same answer from the graph's call, as the CPU model reads it
    call = OpCall.build(aten.convolution.default, (spec(*x_shape), spec(*w_shape), None, [stride] * n, [0] * n,
                                                   [1] * n, False, [0] * n, groups), {}, ())
    assert route(call, threads) == (ONEDNN if actual else NATIVE)


def test_only_float_and_supported_low_precision_take_onednn():
    assert not runs_onednn((8, 4, 8, 8), (4, 4, 3, 3), (1, 1), (1, 1), 1, torch.float64, 2)
    assert not runs_onednn((8, 4, 8, 8), (4, 4, 3, 3), (1, 1), (1, 1), 1, torch.int32, 2)


PATHS = dataclasses.replace(PROFILE, op_floors_ns={
    "conv2d": 10_000.0, "conv2d@onednn": 40_000.0, "convolution": 12_000.0, "convolution@onednn": 42_000.0,
    "convolution_backward": 8_000.0, "convolution_backward@onednn": 90_000.0,
    "convolution_backward@onednn_one": 50_000.0})


def _conv2d(batch: int) -> OpCall:
    return OpCall.build(aten.conv2d.default, (spec(batch, 1, 1, 1), spec(1, 1, 1, 1), None, [1, 1], [0, 0], [1, 1], 1),
                        {}, (spec(batch, 1, 1, 1),))


def _backward(batch: int, mask: list[bool]) -> OpCall:
    x = spec(batch, 1, 1, 1)
    return OpCall.build(aten.convolution_backward.default,
                        (x, x, spec(1, 1, 1, 1), [1], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, mask), {},
                        (x, spec(1, 1, 1, 1), spec(1)))


def test_a_convolution_pays_the_floor_of_its_path():
    model = CpuKernelModel(PATHS)          # threads=2, dispatch 1.5 us (charged as host time)
    assert model(_conv2d(1), cpu_spec()) == pytest.approx(10_000.0 - 1_500.0)       # native
    assert model(_conv2d(2), cpu_spec()) == pytest.approx(40_000.0 - 1_500.0)       # oneDNN
    assert model(_backward(1, [True, True, True]), cpu_spec()) == pytest.approx(8_000.0 - 1_500.0)
    assert model(_backward(2, [True, True, True]), cpu_spec()) == pytest.approx(90_000.0 - 1_500.0)
    # the first layer's backward computes no input gradient: one oneDNN primitive
    assert model(_backward(2, [False, True, True]), cpu_spec()) == pytest.approx(50_000.0 - 1_500.0)
    assert floor_key(_backward(2, [False, True, True]), 2) == "convolution_backward@onednn_one"
    # a profile without the oneDNN entries (or any non-convolution op) keeps the op's own floor
    assert CpuKernelModel(PROFILE)(_conv2d(2), cpu_spec()) == pytest.approx(10_000.0 - 1_500.0)
    assert floor_key(OpCall.build(aten.relu.default, (spec(4),), {}, (spec(4),)), 2) is None
    # a conv1d reads the probe's convolution calls, on its path
    conv1d = OpCall.build(aten.conv1d.default, (spec(2, 1, 1), spec(1, 1, 1)), {}, (spec(2, 1, 1),))
    assert floor_key(conv1d, 2) == "convolution@onednn"
    assert model(conv1d, cpu_spec()) == pytest.approx(42_000.0 - 1_500.0)
