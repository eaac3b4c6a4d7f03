"""A pipeline stage reads a length off its received activation when the graph read it off an earlier stage's tensor.

torch.export keeps one ``sym_size`` per symbol, on whichever tensor the tracer met first: transformers' Phi reads
the sequence length for layer 1's projections off layer 0's attention output (``sym_size(view_12, 1)``), so
stage 1 of ``pp=2`` seemed to receive two tensors and was refused. Only the length crosses; the stage now reads
it off the activation it receives (``pipeline_stages._resource_sizes``). Checked by hand on the zoo's Phi
(2 layers, hidden 64, fc1 128, vocab 256) with 2 micro-batches of [2, 16].
"""
from __future__ import annotations

import pytest
import torch

from boomfx.core.program import ROLE_PARAM, ProgramOptions
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.frontend.capture import capture

aten = torch.ops.aten


def _params(program) -> dict[str, int]:
    return {program.param_names[n.name]: n.meta["val"].numel() for n in program.graph.nodes
            if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM}


def _count(program, target) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.slow  # export of a transformers model
def test_phi_stage_reads_the_sequence_length_off_its_received_activation(zoo) -> None:
    _, path = zoo("phi")
    program = capture(path, options=ProgramOptions(True, target_kind="cpu"))
    first, second = (rc.program for rc in rank_programs(program, ParallelConfig(pp=2, microbatches=2)))
    # the layers' parameters split between the stages, none lost or held twice
    whole, a, b = _params(program), _params(first), _params(second)
    assert not set(a) & set(b) and {**a, **b} == whole
    assert all(k.startswith("model.layers.0.") or not k.startswith("model.layers.") for k in a)
    assert all(k.startswith("model.layers.1.") or not k.startswith("model.layers.") for k in b)
    # stage 1's forward reads the length off what it received, once per micro-batch
    recvs = {n for n in second.graph.nodes if n.op == "call_function" and "recv_" in str(n.target)
             and second.phase_of(n) == "forward"}
    reads = [n for n in second.graph.nodes if n.op == "call_function" and n.target is aten.sym_size.int
             and n.args[0] in recvs]
    assert len(recvs) == 2 and len(reads) == 2 and all(n.args[1] == 1 for n in reads)
    # every linear of the model runs once per micro-batch on one of the stages, forward and backward:
    # each stage's addmm count is its layers' share of the single-device step's, times 2
    assert _count(first, aten.addmm.default) + _count(second, aten.addmm.default) == \
        2 * _count(program, aten.addmm.default)
