"""``F.interpolate`` in a training step with a symbolic batch (``boomfx/training/resize.py``): ``--train``
refused every model with an interpolation (the ``.vec`` overload's C++ composite reads sizes as ints). Truth:
the real eager step's profiler (which kernels) and its memory peak; the cost rules by hand."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.core.devices import cpu_spec
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture, resolve_bindings
from test_costs_conv import price, spec
from test_cpu_memory_accuracy import real_peak

aten = torch.ops.aten
MODES = ("nearest", "bilinear", "bicubic")


class Decoder(torch.nn.Module):
    """A decoder stage on 16-channel features: convolution, 2x interpolation, convolution."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        # 16 channels throughout: the regime kernels_db/cpu_scratch.py's rules were measured in (fewer, on this
        # AVX-512 host, oneDNN pads them to 16 as well, and a 3-channel stem's backward differs: not modelled,
        # a 3 -> 8 -> 4 head's training peak is -28%)
        self.a = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.b = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {} if self.mode == "nearest" else {"align_corners": False}
        return self.b(F.interpolate(self.a(x), scale_factor=2, mode=self.mode, **kwargs))


def _export(mode: str) -> tuple[torch.export.ExportedProgram, tuple]:
    torch.manual_seed(0)
    x = torch.randn(3, 16, 12, 12)
    return torch.export.export(Decoder(mode), (x,), dynamic_shapes=({0: Dim("batch", min=2, max=64)},)), (x,)


@pytest.mark.parametrize("mode", MODES)
def test_interpolation_trains_as_one_kernel_and_its_backward(mode: str):
    """The traced step holds the resize and its backward once each, as the real eager step's profiler shows
    them; at batch 6 the step's peak is larger than at batch 3 (the batch stayed symbolic)."""
    ep, inputs = _export(mode)
    program = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", loss="mean"))
    traced = Counter(n.target.overloadpacket.__name__ for n in program.gm.graph.nodes
                     if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
    module = ep.module()
    module(*inputs).mean().backward()
    with torch.profiler.profile() as prof:
        module(*inputs).mean().backward()
    eager = Counter({e.key.removeprefix("aten::"): e.count for e in prof.key_averages()})
    name = f"upsample_{mode}2d"
    assert traced[name] == eager[name] == 1
    assert traced[f"{name}_backward"] == eager[f"{name}_backward"] == 1
    analysis = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none"))
    peaks = [analysis.evaluate(resolve_bindings(program, {}, b, None)).report.memory.peak_live_bytes for b in (3, 6)]
    assert peaks[1] > peaks[0]


class Scaled(torch.nn.Module):
    """Interpolation between two learned per-channel scales: no convolution (whose scratch is modelled
    elsewhere) in the step, so the peak is the resize's tensors and its backward's."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.w = torch.nn.Parameter(torch.ones(1, 16, 1, 1))
        self.v = torch.nn.Parameter(torch.ones(1, 16, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {} if self.mode == "nearest" else {"align_corners": False}
        return F.interpolate(x * self.w, scale_factor=2, mode=self.mode, **kwargs) * self.v


@pytest.mark.parametrize("mode", MODES)
def test_interpolation_training_peak_matches_the_profiler(mode: str):
    """The predicted training peak above the resident bytes against the profiler's peak of one real step (the
    export's module, AdamW as torch defaults it on a CPU)."""
    x = torch.randn(3, 16, 12, 12)
    ep = torch.export.export(Scaled(mode), (x,), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    program = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", python_locals=False,
                                                 loss="mean"))
    memory = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none")).evaluate(
        resolve_bindings(program, {}, x.shape[0], None)).report.memory
    predicted = memory.peak_live_bytes - memory.resident_bytes
    real = real_peak(ep, (x,), True, loss="mean", foreach=None)
    assert abs(predicted - real) <= 0.01 * real, (predicted, real)


def test_interpolation_costs_by_hand():
    """Bilinear: the input read once, 4 taps x 2 FLOPs per output element; bicubic 16 taps; a backward
    zero-fills the input's gradient and accumulates each incoming element into its taps."""
    x, out = spec(2, 8, 10, 10), spec(2, 8, 20, 20)
    bilinear = price(aten.upsample_bilinear2d.default, x, [20, 20], False, outputs=(out,))
    assert (bilinear.flops, bilinear.bytes_read, bilinear.bytes_written) == (2 * 4 * 6400, 1600 * 4, 6400 * 4)
    bicubic = price(aten.upsample_bicubic2d.default, x, [20, 20], False, outputs=(out,))
    assert bicubic.flops == 2 * 16 * 6400
    backward = price(aten.upsample_bilinear2d_backward.default, out, [20, 20], [2, 8, 10, 10], False, outputs=(x,))
    assert (backward.flops, backward.bytes_read, backward.bytes_written) == (2 * 4 * 6400, (6400 + 1600) * 4,
                                                                             2 * 1600 * 4)
    nearest = price(aten.upsample_nearest2d_backward.default, out, [20, 20], [2, 8, 10, 10], outputs=(x,))
    assert nearest.flops == 2 * 6400
    # a view's gradient: zeros of the input's sizes, the incoming gradient copied into the viewed row
    select = price(aten.select_backward.default, spec(8, 10), [4, 8, 10], 0, 1, outputs=(spec(4, 8, 10),))
    assert (select.flops, select.bytes_read, select.bytes_written) == (0, 80 * 4, (320 + 80) * 4)
