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
from tp_lockstep import plain_layout, run_ranks


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
    for out in run_ranks(shard_export(ep, rplan, 2), ep, 2, plain_layout(rplan), list(inputs.values())):
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


@pytest.mark.slow  # real-weight export of a transformers model
def test_t5_splits_its_position_bias_by_head(zoo) -> None:
    """T5 adds a learned relative-position bias per head (``relative_attention_bias``: an embedding of
    [buckets, heads], looked up by computed buckets) to every attention's scores through SDPA's mask. Each
    rank holds its heads' columns of that table (and looks up its own heads); the cross-attention's
    replicated ``zeros(1, heads, q, k)`` bias is read by each rank's heads. ``wi`` (DenseReluDense) is colwise."""
    import hf_zoo

    ep, _ = zoo("t5", "cpu")
    _, inputs, _ = hf_zoo.build("t5", "cpu")
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    plan = tp_plan(program)
    for stack in ("encoder", "decoder"):
        block = f"{stack}.block.0"
        assert plan[f"{block}.layer.0.SelfAttention.relative_attention_bias.weight"] == "colwise"
        ff = 2 if stack == "decoder" else 1
        assert (plan[f"{block}.layer.{ff}.DenseReluDense.wi.weight"], plan[f"{block}.layer.{ff}.DenseReluDense.wo.weight"]) \
            == ("colwise", "rowwise")
    with torch.no_grad():
        want = ep.module()(**inputs).logits
    rplan = module_plan(program, ParallelConfig(tp=2))
    table = plain_layout(rplan)

    def layout(fqn: str, value: torch.Tensor):
        return (1, [value.shape[1]]) if fqn.endswith("relative_attention_bias.weight") else table(fqn, value)

    for out in run_ranks(shard_export(ep, rplan, 2), ep, 2, layout, list(inputs.values())):
        torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
    (rc,) = rank_programs(program, ParallelConfig(tp=2))
    local = {rc.program.param_names[n.name]: tuple(n.meta["val"].shape) for n in rc.program.graph.nodes
             if n.op == "placeholder" and rc.program.input_roles.get(n.name) == ROLE_PARAM}
    assert local["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == (32, 2)  # 32 buckets
