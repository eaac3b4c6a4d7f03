"""Gradient accumulation without pipelining (boomfx/distributed/accumulation.py, ``--microbatches`` with pp=1).

The memory of accumulated steps is checked against real gloo runs in test_distributed_memory.py (the
``ACCUMULATION`` configurations of tests/gloo_checks.py: DDP, FSDP2, DDP's bucket view, each rank's
profiler peak within 1%); here: the step's time is M forward/backward passes and one optimizer step of
the same micro-batch program, every micro-batch's collectives are counted, the later micro-batches hold
the gradients from their start, the search lists accumulation plans, and bad input is one line.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import distributed_predict as predict  # noqa: E402
import distributed_truth as truth  # noqa: E402

from boomfx.analysis.analysis import AnalyzeOptions  # noqa: E402
from boomfx.cli.main import main  # noqa: E402
from boomfx.core.devices import cpu_spec, get_device  # noqa: E402
from boomfx.distributed.accumulation import accumulating_liveness, forward_backward_ns  # noqa: E402
from boomfx.distributed.analysis import DistributedAnalysis  # noqa: E402
from boomfx.distributed.search import Plan, SearchSpace, enumerate_plans  # noqa: E402
from boomfx.distributed.step_time import class_steps  # noqa: E402
from boomfx.frontend.capture import resolve_bindings  # noqa: E402
from boomfx.passes.liveness import Category  # noqa: E402


def _dist(parallel: str, microbatches, device):
    cfg = truth.TruthConfig("llama", parallel, 2)
    program = predict.training_program(cfg)
    pc = replace(predict.parallel_config(cfg), microbatches=microbatches)
    return DistributedAnalysis(program, pc, device, AnalyzeOptions(device.name, db="none")), program


@pytest.mark.parametrize("parallel", ("ddp", "fsdp"))
@pytest.mark.parametrize("device", ("cpu", "h100-sxm"))
def test_step_is_m_passes_and_one_optimizer_step(parallel, device) -> None:
    """Batch 4 as 2 micro-batches: the step equals 2 x (one micro-batch's step up to its first optimizer op)
    + the rest of that step, from the schedule of the batch-2 step; its communication and collectives are
    twice one micro-batch's."""
    spec = cpu_spec() if device == "cpu" else get_device(device)
    one, program = _dist(parallel, None, spec)
    two, _ = _dist(parallel, 2, spec)
    micro = resolve_bindings(program, {}, 2, 32)
    step = class_steps(one, micro)[0].step
    fb = forward_backward_ns(step, one.analyses[0].program)
    assert 0 < fb < step.step_ns                          # an optimizer runs after the backward
    rep = two.evaluate(resolve_bindings(program, {}, 4, 32)).report.parallel
    row, cls = rep["time_by_class"][0], rep["classes"][0]
    assert rep["micro_batch"] == 2 and rep["batch_per_rank"] == 4 and rep["global_batch"] == 8
    assert cls["step_time_ns"] == pytest.approx(2 * fb + (step.step_ns - fb), rel=1e-9)
    assert row["accumulation"] == {"microbatches": 2, "forward_backward_ns": pytest.approx(fb),
                                   "optimizer_ns": pytest.approx(step.step_ns - fb)}
    single = one.evaluate(micro).report.parallel
    assert row["exposed_comm_ns"] == pytest.approx(2 * single["time_by_class"][0]["exposed_comm_ns"])
    assert len(cls["collectives"]) == 2 * len(single["classes"][0]["collectives"]) > 0
    assert len(row["collectives"]) == 2 * len(single["time_by_class"][0]["collectives"])


def test_later_micro_batches_hold_every_gradient_from_their_start() -> None:
    """Each gradient storage is alive from the first op to its end, plus a temporary where it was produced
    that ends where the backward last writes or views it; the peak rises by at most the gradients' bytes."""
    dist, program = _dist("ddp", None, cpu_spec())
    analysis = dist.analyses[0]
    info = analysis.liveness
    later = accumulating_liveness(info, analysis.program)
    grads = [iv for iv in info.intervals if iv.category == Category.GRAD and not iv.resident]
    assert grads
    ids = {iv.storage_id for iv in info.intervals}
    held = [iv for iv in later.intervals if iv.storage_id not in ids]
    assert sorted((iv.node, iv.end_step) for iv in held) == sorted((iv.node, iv.end_step) for iv in grads)
    assert all(iv.start_step == 0 for iv in held)
    new = {iv.storage_id: iv for iv in later.intervals}
    for iv in grads:
        assert iv.start_step <= new[iv.storage_id].end_step <= iv.end_step
    ev = analysis.evaluator(resolve_bindings(program, {}, 2, 32))
    grad_bytes = sum(ev(iv.nbytes) for iv in grads)
    first, then = max(info.timeline(ev)), max(later.timeline(ev))
    assert first < then <= first + grad_bytes


def test_search_enumerates_accumulation_and_describes_it() -> None:
    space = SearchSpace(nodes=1, gpus_per_node=4, global_batch=16, layers=4, heads=4, checkpoint=(False,))
    plans = enumerate_plans(space)
    accumulated = [p for p in plans if p.pp == 1 and p.microbatches > 1]
    assert {p.microbatches for p in accumulated if p.dp_shard == 4} == {2, 4}    # 4 sequences per rank
    assert Plan(1, 4, 1, 1, 2).describe() == "dp_shard=4 microbatches=2"
    assert Plan(1, 4, 1, 1, 2).program_key() == Plan(1, 4, 1, 1, 1).program_key()   # one build for both
    capped = enumerate_plans(replace(space, max_microbatches=2))
    assert max(p.microbatches for p in capped if p.pp == 1) == 2


def _bad(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_command_line(capsys) -> None:
    tiny = str(ROOT / "examples" / "llama_tiny.pt2")
    base = ["analyze", tiny, "--train", "--seq", "16", "--device", "h100-sxm", "--parallel", "dp_shard=2"]
    assert main(base + ["--batch", "4", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp_shard=2, 2 accumulated micro-batches" in out and "micro-batch 2" in out
    assert "does not divide the batch of 4" in _bad(capsys, *base, "--batch", "4", "--microbatches", "3")
    one = ["analyze", tiny, "--train", "--seq", "16", "--batch", "4", "--microbatches", "2"]
    assert "--microbatches needs --parallel" in _bad(capsys, *one)     # not silently ignored
    assert main(one + ["--parallel", "dp_shard=1"]) == 0               # one device, accumulating
    assert "single device, 2 accumulated micro-batches" in capsys.readouterr().out


def test_max_batch_walks_the_micro_batch() -> None:
    """``--max-batch`` under accumulation searches the micro-batch (``MicroBatchSearch``): micro-batch b is
    the step of batch ``b x M``."""
    from boomfx.distributed.analysis import MicroBatchSearch

    dist, program = _dist("fsdp", 2, get_device("h100-sxm"))
    walked = MicroBatchSearch(dist).evaluate(resolve_bindings(program, {}, 3, 32)).report.parallel
    direct = dist.evaluate(resolve_bindings(program, {}, 6, 32)).report.parallel
    assert walked["batch_per_rank"] == 6 and walked["micro_batch"] == 3
    assert walked["classes"][0]["step_time_ns"] == direct["classes"][0]["step_time_ns"]
    assert walked["classes"][0]["total_device_bytes"] == direct["classes"][0]["total_device_bytes"]
