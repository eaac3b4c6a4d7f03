"""Pipeline stages of a training step with activation checkpointing: each layer's recomputation runs
in the backward of the stage that owns the layer, once per micro-batch (it crashed with a KeyError
on the first recomputed node before the recompute phase was split with the backward; transformers'
GPT-2 was refused because its recomputation reads a size, batch x seq, that the stage's forward does
not compute)."""
from __future__ import annotations

from pathlib import Path

import pytest

from boomfx.core.devices import get_device
from boomfx.core.program import PHASE_RECOMPUTE, ROLE_PARAM, ProgramOptions
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.plan import ParallelConfig
from boomfx.frontend.capture import capture, resolve_bindings

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MICRO = 2


def _recomputed(program) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and program.phase_of(n) == PHASE_RECOMPUTE)


def _param_bytes(program) -> int:
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in program.graph.nodes
               if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM)


# sequence lengths at which activations, not the optimizer step's state, set each stage's peak
@pytest.mark.parametrize("example, seq", [("gpt_tiny", 32), ("gpt2_small", 1024)])
def test_checkpointed_stages_recompute_their_own_layers_per_micro_batch(example: str, seq: int) -> None:
    cfg = ParallelConfig(pp=2, microbatches=MICRO)
    device = get_device("h100-sxm")
    path = str(EXAMPLES / f"{example}.pt2")
    plain = capture(path, options=ProgramOptions(True, target_kind="cuda"))
    ckpt = capture(path, options=ProgramOptions(True, checkpoint=True, target_kind="cuda"))
    assert _recomputed(ckpt) > 0 and _recomputed(plain) == 0
    plain_dist = DistributedAnalysis(plain, cfg, device)
    ckpt_dist = DistributedAnalysis(ckpt, cfg, device)
    stages = [rc.program for rc in ckpt_dist.classes]
    # every recomputed op of the step is in exactly one stage, once per micro-batch
    assert sum(_recomputed(p) for p in stages) == MICRO * _recomputed(ckpt)
    assert all(_recomputed(p) > 0 for p in stages)   # every stage holds checkpointed layers
    # checkpointing moves no parameter between stages
    assert [_param_bytes(p) for p in stages] == [_param_bytes(rc.program) for rc in plain_dist.classes]
    bindings = resolve_bindings(ckpt, {}, 8, seq)
    with_ckpt = ckpt_dist.evaluate(bindings, memory_only=True).report.parallel["classes"]
    without = plain_dist.evaluate(resolve_bindings(plain, {}, 8, seq), memory_only=True).report.parallel["classes"]
    # the stage keeps its layers' inputs instead of their activations: never more live memory
    assert all(c["peak_live_bytes"] <= p["peak_live_bytes"] for c, p in zip(with_ckpt, without))
    assert any(c["peak_live_bytes"] < p["peak_live_bytes"] for c, p in zip(with_ckpt, without))
