"""A fused attention projection (Phi-3's ``qkv_proj``: q, k and v rows stacked in one weight) is
not split by the derived TP plan, since a contiguous block of its rows would give one rank all of q
and another k and v. The ``o_proj`` after it, planned rowwise by name, then reads a replicated
input: refused in one line naming the module, never split alone (which would double-count its
partial sums)."""

from __future__ import annotations

import pytest
import torch

from boomfx.cli.main import main
from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.distributed.model_shape import tp_plan
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.frontend.capture import capture
from layer_stack import export_stack

D, HEADS = 32, 4


class _FusedAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(D, 3 * D, bias=False)
        self.o_proj = torch.nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o_proj(y.transpose(1, 2).reshape(b, t, D))


def _export() -> torch.export.ExportedProgram:
    return export_stack(_FusedAttention, D)


def test_the_fused_projection_stays_out_of_the_plan_and_its_output_projection_is_refused() -> None:
    program = capture(_export(), options=ProgramOptions(True, "adamw", target_kind="cpu"))
    assert tp_plan(program) == {f"layers.{i}.o_proj.weight": "rowwise" for i in range(2)}
    with pytest.raises(OptionError, match=r"cannot split linear_1 \(aten\.linear\.default in layers\.0\.o_proj\): "
                                          r"a rowwise linear reads a replicated input"):
        rank_programs(program, ParallelConfig(tp=2))


def test_the_cli_says_it_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "fused.pt2"
    torch.export.save(_export(), str(path))
    code = main(["analyze", str(path), "--train", "--parallel", "tp=2", "--batch", "2", "--dim", "seq=8"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "qkv_proj or gate_up_proj" in err[0], err
