"""What AOTAutograd does to an exported graph before Inductor sees it, in a compiled program: in-place pointwise
ops on the graph's own values functionalised (passes/functional_inplace.py) and the pools ``torch.export``
keeps whole decomposed (passes/pool_decompositions.py). Truth: the kernels of Inductor's own output code for
the same module (``run_and_get_code``), named after the ops they compute."""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture

aten = torch.ops.aten


class PoolBlock(nn.Module):
    """A ResNet block's tail without the convolutions: a ReLU, a max pool, ``z += ...`` on a fresh value and
    a global average pool."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(torch.relu(x * self.scale + 1.0), 3, 2, 1)
        z = y * 2.0
        z += y.sigmoid()
        return F.adaptive_avg_pool2d(torch.relu(z), (1, 1)).flatten(1)


class ViewedWrite(nn.Module):
    """``y += 1`` after a view of ``y`` was taken: the view sees the write, so it stays one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        flat = y.view(-1)
        y += 1.0
        return flat.sum() + y.sum()


def _inductor_kernels(module: nn.Module, x: torch.Tensor) -> list[str]:
    """The ops of each generated kernel of Inductor's code for ``module`` (its kernel names: ``cpp_fused_``,
    the sorted op names, an index)."""
    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(module), x)
    return [re.sub(r"_\d+$", "", name) for name in re.findall(r"^\s+cpp_fused_(\w+)\(", code[0], re.M)]


def _our_kernels(program) -> list[str]:
    return ["_".join(sorted(set(n.target.ops))) for n in program.graph.nodes
            if n.op == "call_function" and getattr(n.target, "boomfx_fused", False)]


def _compiled(ep, train: bool = False):
    return capture(ep, options=ProgramOptions(train, "adamw", compile=True, target_kind="cpu", python_locals=False))


def test_inplace_add_and_pools_fuse_as_inductors():
    """Inductor computes the whole block in one kernel; before these rewrites the max pool, the ``add_`` and
    the adaptive pool were four kernels of their own (ATen's)."""
    x = torch.randn(2, 16, 32, 32)
    ep = torch.export.export(PoolBlock().eval(), (x,))
    assert {"aten.add_.Tensor", "aten.max_pool2d.default", "aten.adaptive_avg_pool2d.default"} <= \
        {str(n.target) for n in ep.graph.nodes}
    theirs = _inductor_kernels(ep.module(), x)
    assert theirs == ["add_max_pool2d_with_indices_mean_mul_relu_sigmoid"]
    program = _compiled(ep)
    assert _our_kernels(program) == theirs
    assert not any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) for n in program.graph.nodes
                   if n.target is not aten.view.default and n.target is not aten.flatten.using_ints)


def test_a_write_seen_through_a_view_stays_in_place():
    ep = torch.export.export(ViewedWrite(), (torch.randn(4, 8),))
    program = _compiled(ep)
    writes = [n for n in program.graph.nodes if n.op == "call_function" and n.target is aten.add_.Tensor]
    assert len(writes) == 1


def test_buffer_updates_and_the_optimizer_keep_their_writes():
    """Training: the batch norm's ``num_batches_tracked += 1`` writes a buffer (AOTAutograd copies it back)
    and the optimizer runs eagerly: their in-place ops stay; the forward's residual ``+=`` on the batch norm's
    output becomes an add."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn(x)
            y += x
            return torch.relu(y)

    ep = torch.export.export(Residual().train(), (torch.randn(2, 8, 6, 6),))
    eager = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", python_locals=False))
    program = _compiled(ep, train=True)

    def forward_writes(p):
        return [n for n in p.graph.nodes if n.op == "call_function" and n.target is aten.add_.Tensor
                and p.phases.get(n.name) == "forward"]

    eager_writes, compiled_writes = forward_writes(eager), forward_writes(program)
    assert len(eager_writes) == 2 and len(compiled_writes) == 1
    (kept,) = compiled_writes
    assert kept.args[0].op == "placeholder" and "num_batches_tracked" in kept.args[0].name
    optimizer = [n for n in program.graph.nodes if program.phases.get(n.name) == "optimizer"
                 and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.name.endswith("_")]
    assert len(optimizer) == len([n for n in eager.graph.nodes if eager.phases.get(n.name) == "optimizer"
                                  and isinstance(n.target, torch._ops.OpOverload)
                                  and n.target._schema.name.endswith("_")]) > 0


def test_an_adaptive_pool_to_several_outputs_keeps_its_op():
    """Only a pool to one element per channel is a mean; Inductor lowers the others itself."""

    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.adaptive_avg_pool2d(torch.relu(x), (2, 2)) + F.adaptive_avg_pool2d(x, (1, 1))

    program = _compiled(torch.export.export(Pool(), (torch.randn(2, 4, 8, 8),)))
    ops = [op for n in program.graph.nodes if getattr(n.target, "boomfx_fused", False) for op in n.target.ops]
    plain = [n for n in program.graph.nodes if n.target is aten.adaptive_avg_pool2d.default]
    assert "mean" in ops and len(plain) == 1 and plain[0].args[1] == [2, 2]
