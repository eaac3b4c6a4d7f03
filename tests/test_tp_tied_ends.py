"""Tensor parallelism on a model whose token embedding and output head share one weight (GPT-2,
Gemma, small Llamas and Qwens): the vocabulary-parallel ends split that one weight's rows.

The export reads a tie under one name (``head.weight``, for both the lookup and the head) while the
program merges it under another (``embed.weight``); planned by the program's name only, the walk
left the weight read whole: no vocabulary split, no embedding all-reduce, no logits all-gather, and
``sp`` then split nothing (the report still said TP with vocabulary-parallel ends). Megatron's shared
embedding and vLLM's tied ``ParallelLMHead`` split both ends on the vocabulary rows, as here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_zoo import TiedLM  # noqa: E402

from boomfx.core.errors import OptionError  # noqa: E402
from boomfx.core.program import ROLE_PARAM, ProgramOptions  # noqa: E402
from boomfx.distributed.plan import ParallelConfig  # noqa: E402
from boomfx.distributed.ranks import rank_programs  # noqa: E402
from boomfx.frontend.capture import capture  # noqa: E402

VOCAB, D, BATCH, SEQ = 256, 64, 2, 8


def _tied_export() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    model = TiedLM(VOCAB, D).eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    dims = {"input_ids": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=64)}}
    return torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes=dims, strict=False)


@pytest.fixture(scope="module")
def tied_program():
    return capture(_tied_export(), options=ProgramOptions(True, "adamw", target_kind="cpu", loss="mean"))


def _params(program) -> dict[str, list[int]]:
    return {program.param_names[n.name]: list(n.meta["val"].shape) for n in program.graph.nodes
            if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM}


def test_tied_embedding_and_head_split_their_vocabulary_rows(tied_program) -> None:
    """tp=2, torchtitan's ends: the one tied weight holds 256 / 2 = 128 rows on each rank; the
    replicated ``mix`` stays [64, 64]. Collectives at batch 2, seq 8, fp32: the lookup's partial
    [2, 8, 64] output all-reduced (4,096 B), the head's local logits [2, 8, 128] all-gathered
    (8,192 B in), and in backward the head's input gradient [2, 8, 64] all-reduced (4,096 B); before
    the fix there were none and the weight held all 256 rows where it was read."""
    import boomfx

    (rc,) = rank_programs(tied_program, ParallelConfig(tp=2, vocab_parallel=True))
    assert _params(rc.program) == {"embed.weight": [VOCAB // 2, D], "mix.weight": [D, D], "mix.bias": [D]}
    report = boomfx.analyze(_tied_export(), train=True, device="h100-sxm", batch=BATCH, seq=SEQ,
                            parallel={"tp": 2, "tp_plan": "torchtitan"}, loss="mean")
    (cls,) = report.parallel["classes"]
    got = sorted((c["op"], c["phase"], c["input_bytes"]) for c in cls["collectives"] if c["group"] == "tp")
    assert got == sorted([
        ("all_reduce", "forward", BATCH * SEQ * D * 4),
        ("all_gather_into_tensor", "forward", BATCH * SEQ * (VOCAB // 2) * 4),
        ("all_reduce", "backward", BATCH * SEQ * D * 4),
    ])
    # AdamW: exp_avg + exp_avg_sq of each local parameter (fp32), plus one fp32 step scalar per parameter
    state = sum(n.meta["val"].numel() * 4 for n in rc.program.graph.nodes
                if n.op == "placeholder" and rc.program.input_roles.get(n.name) == "opt_state")
    assert state == 2 * 4 * (VOCAB // 2 * D + D * D + D) + 4 * 3


def test_tied_ends_under_sequence_parallelism(tied_program) -> None:
    """``sp`` with a tied head: the lookup's partial output is reduce-scattered on the sequence
    ([2, 8, 64] in), and the head (colwise) all-gathers its seq-split input [2, 8 / 2, 64] once; the
    replicated ``mix`` cannot read a seq-split value, so the walk refuses it by name (before the fix
    the embedding was never split, nothing was sequence-split and ``sp`` was silently plain TP)."""
    with pytest.raises(OptionError, match=r"cannot split linear .*a replicated linear reads a split input"):
        rank_programs(tied_program, ParallelConfig(tp=2, sp=True, vocab_parallel=True))


def test_tied_weights_planned_two_ways_are_refused(tied_program) -> None:
    from boomfx.distributed.tensor_parallel import _plan_over_ties
    from boomfx.frontend.ties import find_ties

    ep = tied_program.export
    (group,) = find_ties(ep)
    assert sorted(group) == ["embed.weight", "head.weight"]
    with pytest.raises(OptionError, match="are planned differently"):
        _plan_over_ties(ep, {"embed.weight": "rowwise", "head.weight": "colwise"})
    assert _plan_over_ties(ep, {"embed.weight": "colwise"}) == {"embed.weight": "colwise", "head.weight": "colwise"}


def test_serving_splits_the_tied_ends() -> None:
    """``serve --tensor-parallel-size 2`` on a tied model: vLLM's VocabParallelEmbedding and tied
    ParallelLMHead. The rank's forward holds 128 of the 256 rows, all-reduces the lookup's partial
    output and all-gathers the logits (before the fix the walk refused the tie and serving fell back
    to TP=1 step times). The export is on the CPU, as people export: the walk's split weights are
    then made fake CPU tensors like the rest (before: a device-mismatch traceback)."""
    from boomfx.serving.tensor_parallel import _COLLECTIVES, tp_serving_program

    program = capture(_tied_export(), options=ProgramOptions(target_kind="cpu"))
    rank = tp_serving_program(program, 2)
    weights = [list(n.meta["val"].shape) for n in rank.graph.nodes
               if n.op == "placeholder" and rank.input_roles.get(n.name) == ROLE_PARAM]
    assert [VOCAB // 2, D] in weights and [VOCAB, D] not in weights
    assert sorted(_COLLECTIVES[n.target] for n in rank.graph.nodes if n.target in _COLLECTIVES) == [
        "all_gather", "all_reduce"]
