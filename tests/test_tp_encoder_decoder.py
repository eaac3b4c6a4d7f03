"""An encoder-decoder's two stacks are both split by the derived TP plan (boomfx/distributed/model_shape.py).

The plan was derived inside the main layer list only: Whisper's (and BART's, T5's) encoder and decoder are two
lists, so one stack stayed whole, and with one layer each (the zoo's) neither was found and TP was refused
("no linear matches"). Now every module-list entry counts. Truth: each rank's graph run on the export's real
weights, one thread per rank (``tests/tp_lockstep.py``), reproduces the unsharded model's logits.
"""
from __future__ import annotations

import pytest
import torch

from boomfx.core.program import ROLE_PARAM, ProgramOptions
from boomfx.distributed.model_shape import tp_plan
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.distributed.tensor_parallel import module_plan, shard_export
from boomfx.frontend.capture import capture
from tp_lockstep import run_ranks


def _layout(plan: dict[str, str]):
    def layout(fqn: str, value: torch.Tensor):
        style = plan.get(fqn)
        if style is None or (style == "rowwise" and value.dim() == 1):
            return None
        dim = 0 if style == "colwise" else 1
        return dim, [value.shape[dim]]
    return layout


@pytest.mark.slow  # real-weight export of a transformers model
def test_whisper_splits_encoder_decoder_and_cross_attention(zoo) -> None:
    import hf_zoo

    ep, _ = zoo("whisper", "cpu")
    _, inputs, _ = hf_zoo.build("whisper", "cpu")
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    plan = tp_plan(program)
    # self-attention of both stacks and the decoder's cross-attention: q/k/v colwise, out_proj rowwise; fc1/fc2
    for prefix in ("model.encoder.layers.0.self_attn", "model.decoder.layers.0.self_attn",
                   "model.decoder.layers.0.encoder_attn"):
        assert [plan[f"{prefix}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj", "out_proj")] == \
            ["colwise"] * 3 + ["rowwise"]
    for stack in ("encoder", "decoder"):
        assert (plan[f"model.{stack}.layers.0.fc1.weight"], plan[f"model.{stack}.layers.0.fc2.weight"]) == \
            ("colwise", "rowwise")
    assert len(plan) == 3 * 4 + 2 * 2
    with torch.no_grad():
        want = ep.module()(**inputs).logits
    rplan = module_plan(program, ParallelConfig(tp=2))
    for out in run_ranks(shard_export(ep, rplan, 2), ep, 2, _layout(rplan), list(inputs.values())):
        torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
    # the training program: every planned weight halved, the rest whole
    (rc,) = rank_programs(program, ParallelConfig(tp=2))
    local = {rc.program.param_names[n.name]: n.meta["val"].numel() for n in rc.program.graph.nodes
             if n.op == "placeholder" and rc.program.input_roles.get(n.name) == ROLE_PARAM}
    whole = {program.param_names[n.name]: n.meta["val"].numel() for n in program.graph.nodes
             if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM}
    for fqn, n in whole.items():
        halved = fqn in plan or (fqn.endswith(".bias") and plan.get(fqn[:-4] + "weight") == "colwise")
        assert local[fqn] * (2 if halved else 1) == n, fqn
