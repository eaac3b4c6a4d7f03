"""Inductor's ConcatKernel writes the kernels computing a ``cat``'s inputs straight into its slices
(passes/concat_into.py): against the real compiled step on this CPU, and the rules it follows."""
from __future__ import annotations

import torch

from boomfx.core.devices import get_device
from boomfx.core.program import META_CONCAT_INTO, ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.fusion import CLASS_POINTWISE, node_class
from boomfx.passes.kernels import kernel_pass
from boomfx.passes.manager import AnalysisManager
from boomfx.validate import validate
from test_empty_cat import EmptyPassLM     # Phi-3's query/key cats; here with a fused q/k/v projection


class _CatOfKernels(torch.nn.Module):
    """``cat(sin(x), cos(x))``: two generated kernels' outputs, each written into its half of the cat."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(1024, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([x.sin(), x.cos()], dim=-1))


class _CatAfterAMatmulRead(torch.nn.Module):
    """``h = sin(x); cat(h, h @ W)``: the matmul reads ``h`` first, which fixes its layout, so ``h`` keeps its
    own buffer and is copied into its slice; the matmul's output is written into the other (``out=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(512, 512, bias=False)
        self.fc = torch.nn.Linear(1024, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        return self.fc(torch.cat([h, self.proj(h)], dim=-1))


def _compiled_inference_error(model: torch.nn.Module, tmp_path) -> tuple[float, int, int]:
    torch.manual_seed(0)
    ep = torch.export.export(model.eval(), (torch.randn(256, 512),))
    path = tmp_path / "cat.pt2"
    torch.export.save(ep, str(path))
    r = validate(str(path), train=False, compile=True, db="none", repeats=1, warmup=0, threads=1)
    return r.memory_error, r.predicted_peak_above_start_bytes, r.measured_peak_above_start_bytes


def _cats(model: torch.nn.Module) -> list:
    ep = torch.export.export(model.eval(), (torch.randn(256, 512),))
    program = capture(ep, options=ProgramOptions(compile=True, target_kind="cpu"))
    kernels = kernel_pass(program, AnalysisManager(program, get_device("cpu")))
    return [(n, kernels.choice(n).launches) for n in program.graph.nodes if n.op == "call_function"
            and getattr(n.target, "overloadpacket", None) is torch.ops.aten.cat]


def test_kernel_outputs_are_written_into_the_concat_buffer(tmp_path):
    """The two halves have no buffers of their own: the peak is the input, the 1 MiB concat buffer and the
    output (each half counted apart, the prediction was +88%)."""
    ((cat, launches),) = _cats(_CatOfKernels())
    assert [p for p, _, _ in cat.meta[META_CONCAT_INTO]] == [0, 1]
    assert not launches        # Inductor's ConcatKernel with nothing to copy is no kernel
    error, predicted, measured = _compiled_inference_error(_CatOfKernels(), tmp_path)
    assert abs(error) <= 0.01, (predicted, measured)


def test_an_input_an_extern_read_first_is_copied_and_a_matmul_writes_its_slice(tmp_path):
    ((cat, launches),) = _cats(_CatAfterAMatmulRead())
    assert [p for p, _, _ in cat.meta[META_CONCAT_INTO]] == [1]
    assert launches            # the copy of ``h`` into its slice
    error, predicted, measured = _compiled_inference_error(_CatAfterAMatmulRead(), tmp_path)
    assert abs(error) <= 0.01, (predicted, measured)


def test_a_concat_copies_view_inputs_with_kernels_of_its_own(tmp_path):
    """Each view input of the backward's q/k/v gradient cat is copied into its slice by a kernel that
    computes the inlined values it reads (``FusedKernel.into_concat``), writing the concat buffer: no
    pointwise op of the backward is left outside a kernel (they were separate ops, each with a buffer of its
    own: +4.6% against the real compiled step); within 1% of it."""
    torch.manual_seed(0)
    ep = torch.export.export(EmptyPassLM(fused_qkv=True).train(), (torch.randint(0, 1024, (4, 128)),))
    program = capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="cross_entropy"))
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    loose = [n.name for n in nodes if isinstance(n.target, torch._ops.OpOverload)
             and node_class(n) == CLASS_POINTWISE and program.phase_of(n) == "backward"
             and n.target.overloadpacket is not torch.ops.aten.cat]
    assert loose == []
    cats = [n for n in nodes if getattr(n.target, "overloadpacket", None) is torch.ops.aten.cat
            and program.phase_of(n) == "backward"]
    assert len(cats) == 2
    for cat in cats:        # the q and k gradients' copies write into it; v's gradient is a view copied
        copies = [n for n in nodes if getattr(n.target, "into_concat", None) == cat.name]
        assert len(copies) == 2 and {k for _, k, _ in cat.meta[META_CONCAT_INTO]} == {c.name for c in copies}
    path = tmp_path / "qkv.pt2"
    torch.export.save(ep, str(path))
    r = validate(str(path), train=True, compile=True, loss="cross_entropy", db="none", repeats=1, warmup=0,
                 threads=1)
    assert abs(r.memory_error) <= 0.01, (r.predicted_peak_above_start_bytes, r.measured_peak_above_start_bytes)
