"""Depth probes (boomfx/distributed/depth_probe.py): a plan built at two shallow depths of its stack, its numbers
carried on to the model's depth, against the same plan built at full depth; and the shallow programs against
exports of that depth."""
from __future__ import annotations

from dataclasses import replace

import pytest

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.core.devices import get_device
from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.depth_probe import ProbeDepths, carried_peak, phase_peaks, probe_depths
from boomfx.distributed.model_shape import model_shape
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.plan_search import ParallelSearch, SearchRequest
from boomfx.distributed.search import Plan
from boomfx.distributed.search_bounds import CarriedFootprint, ModelFootprint
from boomfx.frontend.capture import capture, resolve_bindings

from conftest import export_meta

H100 = get_device("h100-sxm")
LAYERS = 16
# bf16 autocast, as a search of a large model runs
TRAIN = ProgramOptions(train=True, target_kind="cuda", amp="bf16")


@pytest.fixture(scope="module")
def deep():
    return export_meta("llama", LAYERS)


def test_probe_depths_and_the_line_through_them() -> None:
    assert probe_depths(80, 1) == ProbeDepths(4, 6, 80)
    assert probe_depths(80, 2) == ProbeDepths(4, 6, 80)       # 2 and 3 layers per stage
    assert probe_depths(80, 4) == ProbeDepths(4, 8, 80)       # 1 and 2 per stage
    assert probe_depths(80, 16) == ProbeDepths(16, 32, 80)
    assert probe_depths(80, 40) is None                        # two probes cost as much as the model
    assert probe_depths(8, 1) is None and probe_depths(80, 3) is None
    depths = ProbeDepths(4, 6, 80)
    assert depths.carry(10.0, 14.0) == 10.0 + 2.0 * 76
    # each phase's peak carried on alone: the backward's overtakes the optimizer's between the probes and 80
    shallow, deeper = {"backward": 100, "optimizer": 150}, {"backward": 120, "optimizer": 155}
    assert carried_peak(shallow, deeper, depths) == 100 + 10 * 76
    assert phase_peaks([5, 9, 7, 3], ["a", "b", "c", "d"], {"a": "forward", "b": "forward", "c": "backward"}) == {
        "forward": 9, "backward": 7, "": 3}


def _numbers(program) -> tuple:
    report = Analysis(program, H100).evaluate(resolve_bindings(program, {}, 3, 40)).report
    return (report.time.total_ns, report.time.flops, report.time.bytes_moved, report.memory.peak_live_bytes,
            report.memory.total_device_bytes, len(report.kernels))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_synthesised_depth_prices_like_an_export_of_that_depth(deep, checkpoint: bool) -> None:
    options = replace(TRAIN, checkpoint=checkpoint)
    shallow = capture(deep, options=replace(options, stack_depth=6))
    assert model_shape(shallow).layers == 6
    assert _numbers(shallow) == _numbers(capture(export_meta("llama", 6), options=options))
    # the full depth is unchanged by having synthesised a shallow one from the same trace first
    assert _numbers(capture(deep, options=options)) == _numbers(capture(export_meta("llama", LAYERS), options=options))


def test_stack_depth_is_refused_outside_training(deep) -> None:
    with pytest.raises(OptionError, match="stack_depth"):
        capture(deep, options=ProgramOptions(stack_depth=6))
    with pytest.raises(OptionError, match="at least 4"):
        capture(deep, options=replace(TRAIN, stack_depth=3))


def _evaluate(ep, cfg: ParallelConfig, depth, batch: int) -> list[dict]:
    program = capture(ep, options=replace(TRAIN, stack_depth=depth))
    dist = DistributedAnalysis(program, cfg, H100, AnalyzeOptions(H100.name), replay_microbatches=cfg.pp > 1)
    bindings = resolve_bindings(program, {}, batch, 64)
    return dist.evaluate(bindings).report.parallel["classes"]


@pytest.mark.slow     # each plan built at 4, 6 and 16 layers (~10 s)
@pytest.mark.parametrize("degrees", [dict(dp_shard=4), dict(dp_replicate=2, dp_shard=2), dict(dp_shard=2, tp=2),
                                     dict(dp_shard=2, pp=2, microbatches=4)])
def test_carried_numbers_match_the_full_depth_build(deep, degrees: dict) -> None:
    """Step time (collectives, overlap and pipeline included) carries on exactly; the live-bytes peak too;
    the total (allocator reserve and memory outside it as the deeper probe has them) within 1%."""
    cfg = ParallelConfig(**degrees, nodes=1, gpus_per_node=4)
    depths = probe_depths(LAYERS, cfg.pp)
    assert depths is not None
    batch = 8 // (cfg.dp_replicate * cfg.dp_shard)
    full = _evaluate(deep, cfg, None, batch)
    low, high = _evaluate(deep, cfg, depths.shallow, batch), _evaluate(deep, cfg, depths.deep, batch)
    assert len(full) == len(low) == len(high)
    for f, s, d in zip(full, low, high):
        assert depths.carry(s["step_time_ns"], d["step_time_ns"]) == pytest.approx(f["step_time_ns"], rel=1e-3)
        assert depths.carry(s["peak_live_bytes"], d["peak_live_bytes"]) == pytest.approx(f["peak_live_bytes"], rel=1e-3)
        reserve = d["total_device_bytes"] - d["peak_live_bytes"]
        carried = depths.carry(s["peak_live_bytes"], d["peak_live_bytes"]) + reserve
        assert carried == pytest.approx(f["total_device_bytes"], rel=0.01)


@pytest.mark.slow     # two searches of the 16-layer model over 4 GPUs (~40 s)
def test_a_probed_search_lists_what_a_full_depth_search_lists(deep) -> None:
    def program_for(checkpoint: bool, depth=None):
        return capture(deep, options=replace(TRAIN, checkpoint=checkpoint, stack_depth=depth))

    rows = {}
    for probes in (True, False):
        request = SearchRequest(1, 4, 8, 64, top=4, depth_probes=probes)
        out = ParallelSearch(program_for, H100, request, AnalyzeOptions(H100.name)).run()
        rows[probes] = out.ranked
        assert out.evaluations["probe_builds" if probes else "rank_program_builds"] > 0
        assert ("rank_program_builds" in out.evaluations) is not probes
    assert [r.plan for r in rows[True]] == [r.plan for r in rows[False]]
    for probed, whole in zip(rows[True], rows[False]):
        depths = probe_depths(LAYERS, probed.plan.pp)
        assert probed.probed_from == (depths.shallow, depths.deep)
        assert whole.probed_from is None
        assert probed.step_ns == pytest.approx(whole.step_ns, rel=1e-3)
        assert probed.peak_bytes == pytest.approx(whole.peak_bytes, rel=0.01)



def test_the_search_reads_the_accumulated_step_liveness(deep) -> None:
    """Under gradient accumulation the live peak the search carries on from its probes (and prunes by) is
    the accumulated step's, the one ``evaluate`` reports: the later micro-batches hold every gradient, bytes
    that grow with depth (the first micro-batch's liveness would carry a total short by the gradients the
    probes lack)."""
    program = capture(deep, options=replace(TRAIN, stack_depth=6))
    for microbatches in (None, 2):
        cfg = ParallelConfig(dp_replicate=4, nodes=1, gpus_per_node=4, microbatches=microbatches)
        dist = DistributedAnalysis(program, cfg, H100, AnalyzeOptions(H100.name))
        bindings = resolve_bindings(program, {}, 4, 64)
        analysis, info = dist.analyses[0], dist.step_liveness()[0]
        ev = analysis.evaluator(dist.program_bindings(bindings))
        peak = max(phase_peaks(info.timeline(ev), info.order, analysis.program.phases).values())
        assert peak == dist.evaluate(bindings, memory_only=True).report.parallel["classes"][0]["peak_live_bytes"]
        first = max(analysis.liveness.timeline(ev))
        assert (peak > first) if microbatches else (peak == first)


@pytest.mark.slow     # the TP rank traced once, analysed at 4, 6 and 16 layers, per checkpointing setting (~15 s)
@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_tp_ranks_footprint_carried_from_its_probes_matches_the_full_depth_one(deep, checkpoint: bool) -> None:
    """``--search`` tightens a TP plan's floors with its TP rank's footprint, built at the two probe depths
    and carried on (``search_bounds.CarriedFootprint``): state, kernels, the optimizer and the activation
    peak equal the same rank's footprint built at the model's depth, and so do the floors."""
    def program_for(ckpt: bool, depth=None):
        return capture(deep, options=replace(TRAIN, checkpoint=ckpt, stack_depth=depth))

    found = {}
    for probes in (True, False):
        search = ParallelSearch(program_for, H100, SearchRequest(1, 4, 8, 64, depth_probes=probes),
                                AnalyzeOptions(H100.name))
        found[probes] = search.memory_footprint(Plan(1, 2, 2, 1, checkpoint=checkpoint))
        assert search.outcome.evaluations["tp_rank_analyses"] == (2 if probes else 1)
    carried, whole = found[True], found[False]
    assert isinstance(carried, CarriedFootprint) and type(whole) is ModelFootprint and whole.tp_local
    assert carried.layer_count() == whole.layer_count() == LAYERS
    assert carried.state_bytes() == whole.state_bytes()
    assert carried.optimizer_ns() == pytest.approx(whole.optimizer_ns(), rel=1e-9)
    for batch in (1, 2, 4):
        assert carried.activation_peak_bytes(batch) == whole.activation_peak_bytes(batch)
        assert carried.compute_ns(batch) == pytest.approx(whole.compute_ns(batch), rel=1e-9)
    # per layer (the pipeline floors read them): the deeper probe's layers, its template copy repeated
    assert carried.layer_state_bytes() == list(whole.layer_state_bytes())
    assert carried.layer_param_elems() == list(whole.layer_param_elems())
    assert carried.layer_saved_bytes(2) == whole.layer_saved_bytes(2)
    assert carried.layer_compute(2) == pytest.approx(whole.layer_compute(2), rel=1e-9)
    assert carried.end_compute(2) == pytest.approx(whole.end_compute(2), rel=1e-9)
    for plan in (Plan(1, 2, 2, 1, checkpoint=checkpoint), Plan(1, 1, 2, 2, microbatches=4, checkpoint=checkpoint),
                 Plan(2, 1, 2, 4, microbatches=4, checkpoint=checkpoint)):
        micro = 8 // plan.dp // plan.microbatches
        assert carried.lower_bound_bytes(plan, micro) == whole.lower_bound_bytes(plan, micro)
        assert carried.step_lower_bound_ns(plan, micro) == pytest.approx(whole.step_lower_bound_ns(plan, micro),
                                                                        rel=1e-9)
