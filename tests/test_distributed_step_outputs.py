"""Pipeline steps with priced sends, MFU / tokens per second, and the per-rank Chrome trace."""
from __future__ import annotations

import json

import pytest
import torch

from boomfx.core.devices import get_device
from boomfx.core.errors import OptionError
from boomfx.distributed.metrics import mfu, model_flops_per_token, step_metrics
from boomfx.distributed.pipeline_step import StageCompute, pipeline_step, stage_costs_from_point
from boomfx.kernels_db.collective_model import ClusterTopology, CollectiveGroup
from boomfx.kernels_db.collectives import price_collective
from boomfx.report.stream_trace import pipeline_trace_events, stream_trace_events, write_stream_trace
from boomfx.simulate.streams import COMPUTE, StreamOp, simulate_streams

H100 = get_device("h100-sxm")
F_NS, B_NS, OPT_NS = 1.0e6, 2.0e6, 0.3e6
# one micro-batch of 2 x 2048 tokens x 4096 hidden in bf16 crossing each stage boundary
BOUNDARY = 2 * 2048 * 4096 * 2


def test_gpipe_with_priced_sends_between_nodes():
    topo = ClusterTopology(4, 8)
    p, m = 4, 8
    step = pipeline_step("gpipe", [StageCompute(F_NS, B_NS, OPT_NS, BOUNDARY)] * p, m,
                         stage_ranks=[0, 8, 16, 24], topology=topo, device=H100)
    c = price_collective("send", BOUNDARY, CollectiveGroup((0, 8), topo), H100).time_ns
    assert step.send_ns == (c, c, c, 0.0)
    assert c > 0
    # GPipe, uniform stages: stage 0's forwards back to back, each later stage shifted by f + c; the last stage's
    # backwards start after its last forward and walk back shifted by b + c:
    # (m + p - 1)(f + b) + 2 (p - 1) c, then stage 0 (the last to finish) runs its optimizer step
    assert step.timeline.total_ns == pytest.approx((m + p - 1) * (F_NS + B_NS) + 2 * (p - 1) * c)
    assert step.total_ns == pytest.approx(step.timeline.total_ns + OPT_NS)


def test_stages_inside_a_node_send_over_nvlink_faster_than_across_nodes():
    stages = [StageCompute(F_NS, B_NS, 0.0, BOUNDARY)] * 2
    inside = pipeline_step("1f1b", stages, 4, [0, 1], ClusterTopology(1, 8), H100)
    across = pipeline_step("1f1b", stages, 4, [0, 8], ClusterTopology(2, 8), H100)
    assert 0 < inside.send_ns[0] < across.send_ns[0]
    assert inside.total_ns < across.total_ns


def test_free_sends_keep_the_textbook_bubble():
    step = pipeline_step("1f1b", [StageCompute(F_NS, B_NS, 0.0, 0)] * 4, 8, [0, 1, 2, 3], ClusterTopology(1, 8), H100)
    assert step.bubble_fraction == pytest.approx(3 / 11)       # (p - 1) / (m + p - 1)


def test_stage_costs_split_a_training_program_by_phase():
    from boomfx.analysis.analysis import Analysis
    from boomfx.core.program import ProgramOptions
    from boomfx.frontend.capture import capture
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    program = capture(model, torch.randn(4, 64), options=ProgramOptions(train=True, target_kind="cuda"))
    point = Analysis(program, H100).evaluate({})
    costs = stage_costs_from_point(point, boundary_bytes=4 * 8 * 4)
    assert costs.forward_ns > 0 and costs.backward_ns > 0 and costs.optimizer_ns > 0
    total = sum(s.end_ns - s.start_ns for s in point.timeline.spans)
    assert costs.forward_ns + costs.backward_ns + costs.optimizer_ns == pytest.approx(total)


def test_model_flops_per_token_hand_numbers():
    # 6 * 1e9 + 12 * 10 layers * 8 heads * 64 head_dim * 1000 tokens = 6e9 + 61,440,000
    assert model_flops_per_token(1e9, 10, 8, 64, 1000) == pytest.approx(6.06144e9)
    assert model_flops_per_token(1e9, 10, 8, 64, 1000, training=False) == pytest.approx(6.06144e9 / 3)


def test_model_flops_match_megatron_for_a_gpt_layer_stack():
    L, h, heads, s, B = 24, 2048, 16, 2048, 4
    n = 12 * L * h * h                        # attention 4 h^2 + MLP 8 h^2 per layer
    megatron = 72 * B * s * L * h * h * (1 + s / (6 * h))
    assert model_flops_per_token(n, L, heads, h // heads, s) * B * s == pytest.approx(megatron)


def test_mfu_and_tokens_per_second_hand_numbers():
    per_token = 6.06144e9
    # 8 sequences x 1000 tokens in 0.1 s on 8 GPUs: 10,000 tokens/s per GPU;
    # 6.06144e9 * 8000 / 0.1 s / 8 = 6.06144e13 FLOP/s per GPU over H100's 989.4e12 bf16 dense peak
    m = step_metrics(1e8, 8, 8, 1000, per_token, H100, torch.bfloat16)
    assert m.tokens_per_step == 8000 and m.tokens_per_s_per_gpu == pytest.approx(10_000.0)
    assert m.mfu == pytest.approx(6.06144e13 / 989.4e12)
    assert mfu(per_token * 8000, 1e8, 8, 989.4e12) == pytest.approx(m.mfu)
    with pytest.raises(OptionError):
        mfu(1.0, 0.0, 8, 1.0)


def test_metrics_carry_exposed_comm_and_bubble():
    ops = [StreamOp("a", COMPUTE, 10.0), StreamOp("ar", "comm:dp", 4.0, deps=("a",)),
           StreamOp("b", COMPUTE, 3.0), StreamOp("w", COMPUTE, 0.0, deps=("ar",))]
    streams = simulate_streams(ops)
    pipe = pipeline_step("1f1b", [StageCompute(1.0, 2.0, 0.0, 0)] * 2, 2, [0, 1], ClusterTopology(1, 2), H100)
    m = step_metrics(streams.total_ns, 1, 1, 1, 1.0, H100, streams=streams, pipeline=pipe.timeline)
    assert (m.exposed_comm_ns, m.hidden_comm_ns) == (1.0, 3.0)
    assert m.bubble_fraction == pytest.approx(1 / 3)            # (p - 1) / (m + p - 1) = 1 / 3


def test_trace_has_a_compute_and_a_comm_lane_per_rank(tmp_path):
    ops = []
    for rank in (0, 1):
        ops += [StreamOp("mm", COMPUTE, 2000.0, 500.0, rank=rank),
                StreamOp("ag", "comm:dp_shard", 3000.0, deps=("mm",), rank=rank, rendezvous="ag"),
                StreamOp("rs", "comm:tp", 1000.0, deps=("mm",), rank=rank, rendezvous="rs")]
    events = stream_trace_events(simulate_streams(ops))
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert lanes == {(pid, lane) for pid in (1, 2) for lane in ("host (issue)", COMPUTE, "comm:dp_shard", "comm:tp")}
    spans = [e for e in events if e["ph"] == "X" and e["name"] == "ag"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in spans] == [(1, 2, 2.5, 3.0), (2, 2, 2.5, 3.0)]
    path = tmp_path / "trace.json"
    write_stream_trace(str(path), events)
    assert len(json.loads(path.read_text())["traceEvents"]) == len(events)
    pipe = pipeline_step("gpipe", [StageCompute(1000.0, 2000.0, 0.0, 0)] * 2, 2, [0, 1], ClusterTopology(1, 2), H100)
    names = [e["name"] for e in pipeline_trace_events(pipe.timeline) if e["ph"] == "X"]
    assert sorted(names) == sorted(f"{k}{i}@v{s}" for k in "FB" for i in (0, 1) for s in (0, 1))


def test_each_reported_collective_names_its_groups_size():
    """dp_shard=4 x tp=2 on 8 ranks: the TP all-reduces run among 2 ranks and FSDP2's all-gathers and
    reduce-scatters among 4; each row of ``time_by_class`` says so, and its price is the one of a group that
    size (the model's, here: no database), which is what a measured row must match to be used."""
    from pathlib import Path

    import boomfx

    tiny = str(Path(__file__).resolve().parents[1] / "examples" / "llama_tiny.pt2")
    report = boomfx.analyze(tiny, train=True, device="h100-sxm", batch=2, seq=16, db="none",
                            parallel={"dp_shard": 4, "tp": 2})
    rows = report.parallel["time_by_class"][0]["collectives"]
    sizes = {(c["group"], c["op"]): c["group_size"] for c in rows}
    assert {g for g, _ in sizes} == {"tp", "dp_shard"}
    assert all(n == (2 if g == "tp" else 4) for (g, _), n in sizes.items())
    tp_reduce = next(c for c in rows if c["group"] == "tp" and c["op"] == "all_reduce")
    pair = CollectiveGroup((0, 1), ClusterTopology(1, 8))       # ranks 0 and 1 of one 8-GPU node
    expected = price_collective("all_reduce", tp_reduce["message_bytes"], pair, H100).time_ns
    assert tp_reduce["time_ns"] == pytest.approx(expected)
