"""Pipeline parallelism refuses a weight the forwards of two stages read (a tied embedding and
head) by its name; before, the cut went on to the backward and refused with "2 gradients cross into
its backward (add_34, t_18)", which names no weight."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.frontend.capture import capture


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class _TiedStack(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, tied: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _program(tied: bool):
    torch.manual_seed(0)
    dims = {"input_ids": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=64)}}
    ep = torch.export.export(_TiedStack(tied=tied), (), {"input_ids": torch.randint(0, 64, (4, 8))},
                             dynamic_shapes=dims, strict=False)
    return capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu"))


def test_tied_embedding_across_stages_is_refused_by_name() -> None:
    with pytest.raises(OptionError, match=r"parameter embed\.weight is used by stages 0 and 1 \(tied weights"):
        rank_programs(_program(tied=True), ParallelConfig(pp=2, microbatches=2))


def test_the_untied_stack_is_cut_into_two_stages() -> None:
    """The same model untied: two stage classes (the check does not refuse weights one stage reads)."""
    classes = rank_programs(_program(tied=False), ParallelConfig(pp=2, microbatches=2))
    assert [rc.ranks for rc in classes] == [(0,), (1,)]
