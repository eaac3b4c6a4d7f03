"""The distributed report carries the step simulated on compute and communication streams
(boomfx/distributed/step_time.py wired into DistributedAnalysis.evaluate)."""
from __future__ import annotations

from pathlib import Path

import pytest

import boomfx

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt_tiny.pt2")


@pytest.mark.parametrize("parallel, ops", [("dp_shard=8", {"all_gather", "reduce_scatter"}),
                                           ("dp_replicate=8", {"all_reduce"})])
def test_parallel_report_has_the_stream_step_and_priced_collectives(parallel: str, ops: set) -> None:
    report = boomfx.analyze(GPT, device="h100-sxm", train=True, batch=4, seq=32, parallel=parallel)
    (cls,), (row,) = report.parallel["classes"], report.parallel["time_by_class"]
    assert cls["step_time_ns"] == row["step_time_ns"] > 0
    assert {c["op"] for c in row["collectives"]} == ops
    assert all(c["source"] == "model" and c["time_ns"] > 0 for c in row["collectives"])
    # what communication adds to the step is never more than the collectives' own time
    assert 0 <= row["comm_cost_ns"] <= sum(c["time_ns"] for c in row["collectives"]) + 1e-6
    assert row["exposed_comm_ns"] >= 0 and row["hidden_comm_ns"] >= 0
