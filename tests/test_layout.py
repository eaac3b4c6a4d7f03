"""Channels-last convolutions under torch.compile (passes/layout.py), checked against Inductor's own
output code on the CPU and against the rules of ``GraphLowering.decide_layout_opt``."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import nn

from boomfx.frontend.capture import capture
from boomfx.passes.layout import channels_last_convolutions, uses_channels_last
from boomfx.core.program import ProgramOptions


class ConvNet(nn.Module):
    """A 3x3 convolution (its weight must be copied channels-last) and a 1x1 one (already is)."""

    def __init__(self, c_in: int = 3, c: int = 8, k2: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.a = nn.Conv2d(c_in, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, k2, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).relu()


def _program(model: nn.Module, x: torch.Tensor, train: bool = False, kind: str = "cpu"):
    return capture(torch.export.export(model, (x,)), options=ProgramOptions(train=train, target_kind=kind))


def _copies(program) -> Counter:
    return Counter(tuple(d if isinstance(d, int) else str(d) for d in n.meta["val"].shape) for n in program.graph.nodes
                   if n.target is torch.ops.aten.clone.default and n.kwargs.get("memory_format") is torch.channels_last)


def _inductor_input_copies(model: nn.Module, x: torch.Tensor) -> Counter:
    """Buffers of Inductor's CPU output code shaped like a graph input (a weight or the image) and
    allocated channels-last: the conversion copies."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    with torch.no_grad():
        _, (code, *_) = run_and_get_code(torch.compile(model), x)
    inputs = {tuple(p.shape) for p in model.parameters()} | {tuple(x.shape)}
    call = code[code.index("def call("):]
    found = Counter()
    for shape_text, stride_text in re.findall(r"= empty_strided_cpu\(\(([^)]*)\), \(([^)]*)\)", call):
        shape = tuple(int(s) for s in shape_text.replace(" ", "").split(",") if s)
        stride = tuple(int(s) for s in stride_text.replace(" ", "").split(",") if s)
        if shape in inputs and len(shape) == 4 and stride[1] == 1:
            found[shape] += 1
    return found


def test_copies_equal_inductors():
    """The copies we insert are the ones in Inductor's output code: the image and the 3x3 weight, not
    the 1x1 weight (reinterpreted in place)."""
    model, x = ConvNet().eval(), torch.randn(2, 3, 12, 12)
    ours = _copies(channels_last_convolutions(_program(model, x), "cpu"))
    assert ours == Counter({(2, 3, 12, 12): 1, (8, 3, 3, 3): 1})
    assert ours == _inductor_input_copies(model, x)


def test_training_copy_is_saved_for_backward():
    """In training the weight copy is read by the forward convolution and by its backward (Inductor
    returns it as a saved tensor), so it is live across the step, not just around one convolution."""
    model, x = ConvNet(), torch.randn(2, 3, 12, 12)
    program = channels_last_convolutions(_program(model, x, train=True), "cpu")
    copies = [n for n in program.graph.nodes if n.target is torch.ops.aten.clone.default
              and n.kwargs.get("memory_format") is torch.channels_last]
    weight_copy = next(n for n in copies if tuple(n.meta["val"].shape) == (8, 3, 3, 3))
    readers = {u.target for u in weight_copy.users}
    assert readers == {torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}
    assert program.phase_of(weight_copy) == "forward"
    assert weight_copy.meta["val"].is_contiguous(memory_format=torch.channels_last)


def test_no_convolution_no_rewrite():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    program = _program(model, torch.randn(2, 8))
    assert not uses_channels_last(program, "cpu")
    assert channels_last_convolutions(program, "cpu") is program


def _decision(model: nn.Module, train: bool) -> bool:
    program = _program(model, torch.randn(2, model.a.in_channels, 8, 8), kind="cuda")
    return uses_channels_last(replace(program, options=ProgramOptions(train=train)), "gpu")


@pytest.mark.parametrize("model, train, expected", [
    # the CPU backend always converts; the GPU heuristics, training:
    (ConvNet(c=128, k2=3), True, True),                       # large channels: converted
    (ConvNet(c=32, k2=3), True, False),                       # every convolution <= 64 channels
    (ConvNet(c=128, k2=3, groups=2), True, False),            # a grouped convolution (64 in-channels/group)
    # inference: FLOP-weighted average channels-last speed-up per convolution kind
    (ConvNet(c=32, k2=3), False, True),                       # small: 0.783
    (ConvNet(c_in=4, c=128, k2=3, groups=2), False, False),  # mostly grouped FLOPs: 1.358
])
def test_gpu_heuristics(model, train, expected):
    assert _decision(model, train) is expected
    assert uses_channels_last(_program(model, torch.randn(2, model.a.in_channels, 8, 8)), "cpu")


def test_symbolic_batch(exported):
    """The conftest CNN exported with a symbolic batch: the decision evaluates its FLOPs at the example
    size (a compiled run specialises its first shapes), and the copies keep the symbolic image shape."""
    ep, _ = exported("cnn")
    program = capture(ep, options=ProgramOptions(target_kind="cuda"))
    assert uses_channels_last(program, "gpu")                 # inference, small channels: 0.783 < 1
    copies = _copies(channels_last_convolutions(program, "gpu"))
    assert sum(copies.values()) == 3                           # the image and both 3x3 weights
    assert any(not isinstance(s[0], int) for s in copies)     # the image copy keeps the batch symbol


def test_layouts_follow_the_copies():
    """Downstream of the copies values take Inductor's layouts: the convolutions (and the ReLU between
    them) are channels-last, so the kernel database keys and measures channels-last convolutions; the
    weight gradient the optimizer reads is a contiguous copy (AccumulateGrad's), the gradient the step
    holds."""
    model, x = ConvNet(), torch.randn(2, 3, 12, 12)
    program = channels_last_convolutions(_program(model, x, train=True), "cpu")
    convs = [n for n in program.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert convs and all(n.meta["val"].is_contiguous(memory_format=torch.channels_last) for n in convs)
    assert all(not n.meta["val"].is_contiguous() for n in convs)
    relus = [n for n in program.graph.nodes if n.target is torch.ops.aten.relu.default]
    assert relus and all(n.meta["val"].is_contiguous(memory_format=torch.channels_last) for n in relus)
    by_fqn = {fqn: name for name, fqn in program.grad_nodes.items()}
    grad = next(n for n in program.graph.nodes if n.name == by_fqn["a.weight"])
    assert grad.target is torch.ops.aten.clone.default and grad.kwargs["memory_format"] is torch.contiguous_format
    assert grad.meta["val"].is_contiguous() and program.phase_of(grad) == "backward"
    assert not grad.args[0].meta["val"].is_contiguous()              # convolution_backward's own output
    assert all(program.phase_of(u) == "optimizer" for u in grad.users)


def test_accumulate_grad_copy_runs_eagerly():
    """AccumulateGrad's copy of a channels-last weight gradient runs in the autograd engine after the
    compiled backward returned: one eager aten copy of its own, in no fused group (it was fused into an
    Inductor kernel before, priced as one)."""
    from boomfx.passes.fusion import fusion_groups
    program = channels_last_convolutions(_program(ConvNet(), torch.randn(2, 3, 12, 12), train=True), "cpu")
    by_fqn = {fqn: name for name, fqn in program.grad_nodes.items()}
    copy = by_fqn["a.weight"]
    assert program.runs_eagerly(next(n for n in program.graph.nodes if n.name == copy))
    info = fusion_groups(program, "cpu")
    group = info.groups[info.group_of[copy]]
    assert group.kind == "separate" and set(group.members) == {copy}
    compiled = capture(torch.export.export(ConvNet(), (torch.randn(2, 3, 12, 12),)),
                       options=ProgramOptions(train=True, compile=True, target_kind="cpu"))
    grads = {fqn: name for name, fqn in compiled.grad_nodes.items()}
    node = next(n for n in compiled.graph.nodes if n.name == grads["a.weight"])
    assert node.target is torch.ops.aten.clone.default and compiled.runs_eagerly(node)   # not a fused node
