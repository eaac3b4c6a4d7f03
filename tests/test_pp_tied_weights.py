"""Pipeline parallelism of a model whose embedding and head share one weight: each end stage holds a copy
(parameter, gradient, AdamW state), accumulates its own reader's share of the gradient, and all-reduces it
over the end stages' group before AdamW (boomfx/distributed/pp_tied_weights.py). The real runs (GPT-2's
tie on gloo, with FSDP and TP too) are in tests/test_distributed_pp.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.distributed.mesh_groups import PP_TIED_GROUP, mesh_groups
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.frontend.capture import capture
from boomfx.kernels_db.collective_model import ClusterTopology

aten = torch.ops.aten


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


def _tied_reductions(program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and n.args[2:3] == (PP_TIED_GROUP,)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_end_stage_holds_the_tied_weight_and_reduces_its_gradient(schedule) -> None:
    """Stage 0 reads the weight in the embedding, stage 1 in the head: both hold it and its AdamW state, the
    gradient each accumulates is its own reader's ([vocab, d]: the embedding's dense backward, the head's
    transposed matmul), and each all-reduces it once, in place, over ``PP_TIED_GROUP`` after its last
    backward; the untied model has no such reduction and the head's weight on stage 1 only."""
    tied = rank_programs(_program(tied=True), ParallelConfig(pp=2, microbatches=2, pp_schedule=schedule))
    untied = rank_programs(_program(tied=False), ParallelConfig(pp=2, microbatches=2, pp_schedule=schedule))
    assert [rc.ranks for rc in tied] == [(0,), (1,)]
    for stage, (rc, plain) in enumerate(zip(tied, untied)):
        program = rc.program
        assert "embed.weight" in program.param_names.values()
        states = [n for n in program.graph.nodes if n.op == "placeholder" and n.name.endswith("p_embed_weight")
                  and program.input_roles.get(n.name) == "opt_state"]
        assert len(states) == 3    # exp_avg, exp_avg_sq, step
        share = next(n for n in program.graph.nodes if program.grad_nodes.get(n.name) == "embed.weight")
        assert share.target is (aten.embedding_dense_backward.default if stage == 0 else aten.t.default)
        assert list(share.meta["val"].shape) == [64, 16]
        (reduce,) = _tied_reductions(program)
        assert reduce.target is torch.ops._c10d_functional.all_reduce_.default and reduce.args[:2] == (share, "sum")
        assert program.phase_of(reduce) == "optimizer"
        assert not _tied_reductions(plain.program)
        # the same resident bytes as the untied model (its head weight has the embedding's shape)
        assert _resident(program) == _resident(plain.program)
    assert "head.weight" in untied[1].program.param_names.values()


def _resident(program) -> int:
    return sum(int(n.meta["val"].nbytes) for n in program.graph.nodes
               if n.op == "placeholder" and program.input_roles.get(n.name) in ("param", "opt_state"))


def test_the_tied_group_is_the_first_and_last_stage_of_the_ranks_pp_group() -> None:
    """On a (pp=4, dp_shard=2) mesh rank 1 (stage 0, shard 1) shares the tied weight with rank 7 (stage 3,
    shard 1); with pp=1 the group is the rank alone."""
    groups = mesh_groups({"pp": 4, "dp_shard": 2}, 1, ClusterTopology(1, 8))
    assert groups[PP_TIED_GROUP].ranks == (1, 7) and groups["pp"].ranks == (1, 3, 5, 7)
    assert mesh_groups({"dp_shard": 8}, 3, ClusterTopology(1, 8))[PP_TIED_GROUP].ranks == (3,)


def test_a_tie_across_stages_under_a_vocabulary_parallel_plan_is_refused() -> None:
    """torch's DTensor leaves a vocabulary-parallel embedding's gradient replicated ([vocab, d]) and the
    colwise head's sharded ([vocab / tp, d]): the real sum needs a redistribution, refused by name."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import distributed_predict as predict
    import distributed_truth as truth

    cfg = truth.TruthConfig("gpt_tied", "pp_tp_vocab", 4, timed_steps=0)
    with pytest.raises(OptionError, match=r"wte\.weight is tied across stages and the TP plan splits the vocabulary"):
        rank_programs(predict.training_program(cfg), predict.parallel_config(cfg))


def test_the_untied_stack_is_cut_into_two_stages() -> None:
    """The same model untied: two stage classes (the check does not refuse weights one stage reads)."""
    classes = rank_programs(_program(tied=False), ParallelConfig(pp=2, microbatches=2))
    assert [rc.ranks for rc in classes] == [(0,), (1,)]


def test_the_report_names_the_tied_weights_reduction(tmp_path, capsys) -> None:
    """``analyze --parallel pp=2`` of the tied stack saved to a file (the tie restored from its shared
    record) says which ranks hold the weight and what they all-reduce: the [64, 16] fp32 gradient."""
    from boomfx.cli.main import main

    torch.manual_seed(0)
    ep = torch.export.export(_TiedStack(), (), {"input_ids": torch.randint(0, 64, (4, 8))}, strict=False)
    path = tmp_path / "tied.pt2"
    torch.export.save(ep, str(path))
    assert main(["analyze", str(path), "--train", "--parallel", "pp=2", "--microbatches", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ranks 0,1 hold a copy each and all-reduce its gradient (4.00 KiB per rank)" in out


class _FrozenReuse(torch.nn.Module):
    """The embedding's weight read again by the head under ``no_grad``-like detach: stage 1 reads it, but its
    gradient comes from the embedding alone."""

    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x @ self.embed.weight.detach().t()


def test_a_weight_read_by_two_stages_with_one_gradient_is_refused_by_name() -> None:
    """Only the first stage's read has a gradient: the last stage's copy would step without one (AdamW
    would read a gradient that stage never makes), so the plan is refused naming the weight."""
    torch.manual_seed(0)
    dims = {"input_ids": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=64)}}
    ep = torch.export.export(_FrozenReuse(), (), {"input_ids": torch.randint(0, 64, (4, 8))}, dynamic_shapes=dims,
                             strict=False)
    program = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu"))
    with pytest.raises(OptionError, match=r"parameter embed\.weight is read by stages 0, 1 but its gradient"):
        rank_programs(program, ParallelConfig(pp=2, microbatches=2))
