"""Mixture-of-experts layers under tensor parallelism. The router of Mixtral / Qwen-MoE is a linear
named ``gate`` (hidden -> experts, then a softmax over the experts); the derived plan's name rule
planned it colwise, and the walk then refused the softmax over the split experts (Mixtral could not
use TP at all). A ``gate`` with no rowwise sibling is a router and stays replicated; a gated MLP's
``gate`` (beside ``up`` and ``down``) is still split. Serving: vLLM's FusedMoE splits each expert's
intermediate dimension, which the walk does not, so ``serve --tensor-parallel-size`` does not cut
such a model (a stated TP=1 fallback) rather than price every rank with all the experts."""

from __future__ import annotations

import pytest
import torch

from boomfx.core.errors import OptionError
from boomfx.core.program import ROLE_PARAM, ProgramOptions
from boomfx.distributed.model_shape import tp_plan
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.frontend.capture import capture
from layer_stack import export_stack
from boomfx.serving.tensor_parallel import tp_serving_program

D, EXPERTS = 16, 4


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(D, EXPERTS, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(EXPERTS, D, D) / D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.gate(x), dim=-1)              # [b, t, experts]
        per_expert = torch.einsum("btd,eod->bteo", x, self.experts)
        return torch.einsum("bte,bteo->bto", scores, per_expert)


class _GatedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(D, 32), torch.nn.Linear(D, 32), torch.nn.Linear(32, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe, self.mlp = _Router(), _GatedMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x) + self.mlp(x)


def _export() -> torch.export.ExportedProgram:
    return export_stack(_Layer, D)


def test_the_router_stays_replicated_and_the_gated_mlp_is_split() -> None:
    program = capture(_export(), options=ProgramOptions(True, "adamw", target_kind="cpu"))
    plan = tp_plan(program)
    assert plan == {f"layers.{i}.mlp.{m}.weight": s for i in range(2)
                    for m, s in (("gate", "colwise"), ("up", "colwise"), ("down", "rowwise"))}
    (rc,) = rank_programs(program, ParallelConfig(tp=2))
    shapes = {rc.program.param_names[n.name]: list(n.meta["val"].shape) for n in rc.program.graph.nodes
              if n.op == "placeholder" and rc.program.input_roles.get(n.name) == ROLE_PARAM}
    assert shapes["layers.0.moe.gate.weight"] == [EXPERTS, D]          # whole router
    assert shapes["layers.0.moe.experts"] == [EXPERTS, D, D]           # whole experts
    assert shapes["layers.0.mlp.gate.weight"] == [32 // 2, D]          # gated MLP: colwise rows / 2
    assert shapes["layers.0.mlp.down.weight"] == [D, 32 // 2]          # rowwise columns / 2


def test_serving_does_not_cut_stacked_experts() -> None:
    program = capture(_export(), options=ProgramOptions(target_kind="cpu"))
    with pytest.raises(OptionError, match=r"experts' stacked weight layers\.0\.moe\.experts \[4, 16, 16\]"):
        tp_serving_program(program, 2)
