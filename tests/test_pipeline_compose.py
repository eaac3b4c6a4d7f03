"""Pipeline stages replayed from a three-micro-batch template (boomfx/distributed/pipeline_compose.py)
against the stage programs built with every micro-batch: the same memory to the byte (live peak,
resident, the caching-allocator replay's allocated and reserved peaks), the same collectives, and the
same step up to the one kernel the replay scales instead of pricing (the last stage's
``_merge_outputs`` concatenation of M chunks, priced as the template's three times M / 3)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.pipeline_compose import TEMPLATE_MICROBATCHES, composable
from boomfx.distributed.plan import ParallelConfig
from boomfx.frontend.capture import capture, resolve_bindings
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

MEMORY = ("peak_live_bytes", "resident_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
          "total_device_bytes", "fits")
DEVICE = get_device("h100-sxm")     # a CUDA target: the allocator replay runs


@pytest.fixture(scope="module")
def llama2():
    return {ckpt: capture(str(EXAMPLES / "llama_tiny.pt2"), options=ProgramOptions(True, checkpoint=ckpt,
                                                                                  target_kind="cuda"))
            for ckpt in (False, True)}


@pytest.fixture(scope="module")
def llama4():
    import sys
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import distributed_predict as predict
    import distributed_truth as truth

    exported = predict.export(truth.TruthConfig("llama4", "pp", 4))
    return capture(exported, options=ProgramOptions(True, target_kind="cuda"))


def _merge_ns(point_report, stage_program) -> float:
    """Device time of the last stage's _merge_outputs cat in a report (0 elsewhere)."""
    from boomfx.distributed.pipeline_stages import META_LAYOUT

    merge = stage_program.gm.meta[META_LAYOUT].merge
    return sum(k.time_ns for k in point_report.kernels if k.node == merge)


def _collectives(cls: dict) -> Counter:
    return Counter((c["op"], c["group"], c["input_bytes"], c["phase"]) for c in cls["collectives"])


def _compare(program, cfg: ParallelConfig, batch: int, seq: int) -> None:
    bindings = resolve_bindings(program, {}, batch, seq)
    whole = DistributedAnalysis(program, cfg, DEVICE)
    replayed = DistributedAnalysis(program, cfg, DEVICE, replay_microbatches=True)
    assert replayed.replayed and not whole.replayed
    point_w, point_r = whole.evaluate(bindings), replayed.evaluate(bindings)
    w, r = point_w.report.parallel, point_r.report.parallel
    # the shown (worst) rank: what its peak holds, by category
    assert point_r.report.memory.by_category_bytes == point_w.report.memory.by_category_bytes
    for cw, cr in zip(w["classes"], r["classes"], strict=True):
        assert {k: cr[k] for k in MEMORY} == {k: cw[k] for k in MEMORY}
        assert _collectives(cr) == _collectives(cw)
    # the step: every kernel counted as often as it runs; only the merge differs (priced at 3 chunks, scaled)
    micro = whole.program_bindings(bindings)
    last_w = whole.analyses[-1].evaluate(micro).report
    last_r = replayed.analyses[-1].evaluate(micro).report
    scaled = _merge_ns(last_r, replayed.classes[-1].program) * cfg.num_microbatches / TEMPLATE_MICROBATCHES
    slack = abs(scaled - _merge_ns(last_w, whole.classes[-1].program)) * 1.000001 + 1e-6
    for cw, cr in zip(w["classes"], r["classes"]):
        assert abs(cr["step_time_ns"] - cw["step_time_ns"]) <= slack
    assert abs(r["time_by_class"][0]["pipeline_step_ns"] - w["time_by_class"][0]["pipeline_step_ns"]) <= slack
    assert abs(r["time_by_class"][0]["bubble_fraction"] - w["time_by_class"][0]["bubble_fraction"]) < 1e-3


@pytest.mark.parametrize("schedule, m", [("gpipe", 4), ("gpipe", 7), ("1f1b", 4), ("1f1b", 6)])
def test_replayed_stages_equal_built_ones(llama2, schedule: str, m: int) -> None:
    _compare(llama2[False], ParallelConfig(pp=2, microbatches=m, pp_schedule=schedule), 2 * m, 64)


@pytest.mark.parametrize("degrees", [dict(tp=2), dict(dp_shard=2), dict(dp_replicate=2),
                                     dict(dp_shard=2, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32"),
                                     dict(dp_shard=2, fsdp_wrap="root")])
def test_replayed_stages_with_tensor_or_data_parallelism_equal_built_ones(llama2, degrees) -> None:
    _compare(llama2[False], ParallelConfig(pp=2, microbatches=5, **degrees), 10, 64)


def test_replayed_checkpointed_stages_equal_built_ones(llama2) -> None:
    _compare(llama2[True], ParallelConfig(pp=2, microbatches=6), 12, 64)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_four_stages_whose_warm_up_outlasts_the_template(llama4, schedule: str) -> None:
    # stage 0 of 1F1B warms up with 3 forwards: the template (3 micro-batches) runs all its forwards
    # first, the 8-micro-batch step does not; send releases follow the 8-micro-batch schedule
    _compare(llama4, ParallelConfig(pp=4, microbatches=8, pp_schedule=schedule), 16, 32)


def test_what_is_not_replayed_is_built_whole(llama2) -> None:
    assert not composable(ParallelConfig(pp=2, microbatches=TEMPLATE_MICROBATCHES))
    assert not composable(ParallelConfig(pp=2, microbatches=4, pp_schedule="interleaved_1f1b"))
    dist = DistributedAnalysis(llama2[False], ParallelConfig(pp=2, microbatches=3), DEVICE, replay_microbatches=True)
    assert not dist.replayed
    assert all(rc.program.gm.meta["boomfx.pp_layout"].microbatches == 3 for rc in dist.classes)


def test_receive_buffers_are_one_per_micro_batch(llama2) -> None:
    # PipelineStage allocates a receive buffer per micro-batch (they share one fake value in the program)
    from boomfx.distributed.pipeline_stages import ROLE_COMM_BUFFER
    from boomfx.passes.liveness import _compute_nbytes

    by_m = {}
    for m in (2, 4):
        dist = DistributedAnalysis(llama2[False], ParallelConfig(pp=2, microbatches=m), DEVICE)
        report = dist.evaluate(resolve_bindings(llama2[False], {}, 2 * m, 64), memory_only=True).report.parallel
        program = dist.classes[1].program
        buffers = [n for n in program.graph.nodes if program.input_roles.get(n.name) == ROLE_COMM_BUFFER]
        assert len(buffers) == m
        ev = dist.analyses[1].evaluator(dist.program_bindings(resolve_bindings(llama2[False], {}, 2 * m, 64)))
        by_m[m] = report["classes"][1]["resident_bytes"], int(ev(_compute_nbytes(buffers[0].meta["val"])))
    (r2, per_buffer), (r4, _) = by_m[2], by_m[4]
    assert per_buffer > 0 and r4 - r2 == 2 * per_buffer
