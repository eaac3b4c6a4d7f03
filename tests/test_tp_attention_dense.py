"""Phi (transformers' PhiForCausalLM) names its attention's output projection ``dense``, beside q_proj/k_proj/
v_proj: the derived TP plan splits it rowwise (before, the split q/k/v output reached a replicated ``dense``
and TP was refused). Checked by hand on the zoo's Phi (2 layers, hidden 64, 4 heads, MLP fc1/fc2 of 128)."""
from __future__ import annotations

import pytest
import torch

from boomfx.core.program import ROLE_PARAM, ProgramOptions
from boomfx.distributed.model_shape import tp_plan
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.frontend.capture import capture


@pytest.mark.slow
def test_phi_attention_dense_is_rowwise_and_each_block_all_reduces_twice(zoo) -> None:
    _, path = zoo("phi")
    program = capture(path, options=ProgramOptions(True, target_kind="cpu"))
    plan = tp_plan(program)
    for i in range(2):
        layer = f"model.layers.{i}"
        assert {k: v for k, v in plan.items() if k.startswith(layer + ".")} == {
            f"{layer}.self_attn.q_proj.weight": "colwise", f"{layer}.self_attn.k_proj.weight": "colwise",
            f"{layer}.self_attn.v_proj.weight": "colwise", f"{layer}.self_attn.dense.weight": "rowwise",
            f"{layer}.mlp.fc1.weight": "colwise", f"{layer}.mlp.fc2.weight": "rowwise"}
    (rc,) = rank_programs(program, ParallelConfig(tp=2))
    shapes = {rc.program.param_names[n.name]: tuple(n.meta["val"].shape) for n in rc.program.graph.nodes
              if n.op == "placeholder" and rc.program.input_roles.get(n.name) == ROLE_PARAM}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)     # 2 of 4 heads x 16
    assert shapes["model.layers.0.self_attn.dense.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.fc1.weight"] == (64, 64) and shapes["model.layers.0.mlp.fc2.weight"] == (64, 64)
    forward_all_reduces = [n for n in rc.program.graph.nodes if n.op == "call_function"
                           and n.target is torch.ops._c10d_functional.all_reduce.default
                           and rc.program.phase_of(n) == "forward"]
    assert len(forward_all_reduces) == 2 * 2    # dense and fc2 of each of the 2 layers
