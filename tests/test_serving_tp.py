"""Tensor-parallel serving (boomfx/serving/tensor_parallel.py): the rank's own program, checked by hand.

examples/llama_tiny.pt2: vocab 512, d 64, 2 layers, 4 query heads and 2 KV heads of 16, MLP 176, float32,
untied embedding and head. At ``--tensor-parallel-size 2`` vLLM's rank holds half of every linear, half of
the vocabulary of the embedding and of the head, and whole norms; it all-reduces after the embedding and
after o and down of every layer, and all-gathers the sampled tokens' logits.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.kernels_db.collective_model import ClusterTopology, CollectiveGroup
from boomfx.kernels_db.collectives import price_collective
from boomfx.serving.serve import setup
from boomfx.serving.steps import Step

ROOT = Path(__file__).resolve().parents[1]
H100 = get_device("h100-sxm")
VOCAB, D, LAYERS, MLP, F32 = 512, 64, 2, 176, 4


def _setup(tp: int) -> Any:
    program = capture(str(ROOT / "examples" / "llama_tiny.pt2"), options=ProgramOptions(target_kind="cuda"))
    return setup(program, H100, db="none", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=256,
                 tensor_parallel_size=tp)


@pytest.fixture(scope="module")
def tp1() -> Any:
    return _setup(1)


@pytest.fixture(scope="module")
def tp2() -> Any:
    return _setup(2)


def test_the_rank_holds_its_shards_and_whole_norms(tp1: Any, tp2: Any) -> None:
    # per layer: q 64x64 + k, v 32x64 + o 64x64 + gate, up 176x64 + down 64x176, split in two; norms whole
    linears = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 176 * 64
    norms = (2 * LAYERS + 1) * D
    ends = 2 * VOCAB * D                      # embedding and head, each split on the vocabulary
    assert tp1.plan.weights_bytes == (LAYERS * linears + norms + ends) * F32
    assert tp2.plan.weights_bytes == (LAYERS * linears // 2 + norms + ends // 2) * F32
    # its attention: 2 query heads and 1 KV head per rank (KV bytes per token halve with them)
    site = tp2.model.uniform_site()
    assert (site.q_heads, site.kv_heads) == (2, 1) == (4 // 2, tp2.kv.kv_heads_per_rank)
    assert tp2.plan.kv_bytes_per_token * 2 == tp1.plan.kv_bytes_per_token == 2 * LAYERS * 2 * 16 * F32
    # the report still describes the whole model
    assert not any("priced at TP=1" in w for w in _warnings(tp2))


def _warnings(s: Any) -> list[str]:
    from boomfx.serving.serve import build_report
    return build_report(s, H100, [], None).warnings


def _matmul_flops(s: Any, tokens: int) -> float:
    point = s.analysis.evaluate(s.model.bindings(1, tokens))
    nodes = {n.name: n for n in s.model.program.graph.nodes}
    return sum(k.flops for k in point.report.kernels
               if getattr(nodes[k.node].target, "overloadpacket", None) is torch.ops.aten.linear)


def test_every_projection_does_half_the_work(tp1: Any, tp2: Any) -> None:
    # the rank's linears are the whole model's cut in two (the head included): exactly half the FLOPs
    assert _matmul_flops(tp2, 48) == _matmul_flops(tp1, 48) / 2 > 0


@pytest.mark.parametrize("batch", [1, 8])
def test_communication_is_the_collectives_vllm_issues(tp2: Any, batch: int) -> None:
    group = CollectiveGroup((0, 1), ClusterTopology(1, 2))
    # 1 (embedding) + 2 per layer all-reduces of [tokens, d]; one all-gather of the logits [batch, vocab]
    expected = (1 + 2 * LAYERS) * price_collective("all_reduce", batch * D * F32, group, H100).time_ns
    expected += price_collective("all_gather", batch * VOCAB * F32, group, H100).time_ns
    pricer = tp2.pricer()
    step = pricer.step_time(Step((40,) * batch))
    assert step.parts["tp_communication"].device_ns == pytest.approx(expected, rel=1e-12)
    # and nothing of it is priced a second time among the kernels
    assert step.total_ns >= sum(p.device_ns for p in step.parts.values())


def test_a_model_the_walk_cannot_split_keeps_tp1_step_times_and_says_why(tp1: Any) -> None:
    # 2 KV heads on 4 ranks: vLLM replicates them; the sharding walk refuses, the report warns
    tp4 = _setup(4)
    assert tp4.collectives is None and "2" in tp4.tp_not_split
    assert tp4.kv.kv_heads_per_rank == 1
    assert any("priced at TP=1" in w for w in _warnings(tp4))
    step = tp4.pricer().step_time(Step((40,)))
    assert "tp_communication" not in step.parts
    # the whole model's kernels (only attention reads the rank's one KV head)
    whole = tp1.pricer().step_time(Step((40,)))
    assert step.parts["token_wise"].device_ns == pytest.approx(whole.parts["token_wise"].device_ns, rel=1e-12)
