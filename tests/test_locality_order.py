"""Inductor's locality order of inference graphs (passes/locality_order.py) against Inductor's own pass, and the
peak it explains."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.fx_passes.post_grad import reorder_for_locality as inductor_reorder_for_locality

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.locality_order import reorder_for_locality
from boomfx.passes.liveness import liveness_pass
from conftest import make_model
from test_fusion import FusedQKVCopies


def _program(name: str, train: bool = False):
    if name == "qkv":
        model, args, dynamic = FusedQKVCopies(), (torch.randn(2, 16, 32),), None
    else:
        model, args, dynamic = make_model(name)
    ep = torch.export.export(model.train(train), args, dynamic_shapes=dynamic, strict=False)
    return capture(ep, options=ProgramOptions(train=train, target_kind="cpu"))


def _inductors_order(program) -> list[str]:
    """Inductor's own pass over a copy of the graph without the export's asserts (Inductor has none)."""
    graph, _ = program.copied_graph()
    for node in [n for n in graph.nodes if "assert" in str(n.target)]:
        graph.erase_node(node)
    inductor_reorder_for_locality(graph)
    return [n.name for n in graph.nodes]


@pytest.mark.parametrize("name", ["qkv", "gpt", "llama", "cnn", "hf_gpt2"])
def test_order_is_inductors(name) -> None:
    program = _program(name)
    ours = [n.name for n in reorder_for_locality(program).graph.nodes if "assert" not in str(n.target)]
    assert ours == _inductors_order(program)


def test_a_copy_read_late_is_made_late_and_keeps_its_source_alive() -> None:
    """BLOOM's pattern: the value copy's only reader is the second matmul, so it is made after the softmax, and
    the fused projection it copies from lives through the scores to there (before the first matmul, as
    exported)."""
    program = _program("qkv")
    ordered = reorder_for_locality(program)

    def projection_dies_after_softmax(p) -> bool:
        info = liveness_pass(p)
        last = info.intervals[info.node_storages["linear"][0]].end_step
        return last > list(info.order).index("softmax")
    assert not projection_dies_after_softmax(program)
    assert projection_dies_after_softmax(ordered)
    names = [n.name for n in ordered.graph.nodes]
    assert names.index("bmm") < names.index("softmax") < names.index("reshape_2") < names.index("bmm_1")


def test_training_programs_keep_their_order() -> None:
    program = _program("gpt", train=True)
    assert reorder_for_locality(program) is program
