"""Pipeline-parallel stage programs against real ``torch.distributed.pipelining`` steps on gloo (CPU).

The truth is ``benchmarks/distributed_truth.py``: 2 processes run real AdamW steps of a Llama-style
and a GPT-2-style model (2 layers, one per stage) with ``Schedule1F1B`` and ``ScheduleGPipe`` over 4
micro-batches of a batch of 4, and record each rank's profiler peak above the step's start, its
parameter and AdamW storages and the sends/receives gloo ran. The 2-rank configurations share one
spawn with the tensor-parallel ones (``conftest.two_rank_gloo_runs``), the 4-rank ones another
(``conftest.four_rank_gloo_runs``).

The prediction is boomfx's per-stage program (boomfx/distributed/pipeline_stages.py), each compute
kernel's scratch measured on this CPU as tests/test_distributed_memory.py does.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import distributed_predict as predict  # noqa: E402
import distributed_truth as truth  # noqa: E402
from gloo_checks import PP_FSDP_INTERLEAVED, PP_FSDP_INTERLEAVED_RESHARDING, PP_FSDP_MIXED_PRECISION, PP_FSDP_RESHARD, PP_FSDP_WRAP_ROOT, PP_TIED, PP_TIED_FOUR_RANKS, PP_TP_VOCAB, PP_TWO_RANKS, assert_peaks_match, rank_classes, resident_bytes  # noqa: E402

from boomfx.cli.main import main  # noqa: E402
from boomfx.distributed.pipeline_stages import END, send_releases, stage_layer_ranges  # noqa: E402

CONFIGS = PP_TWO_RANKS


@pytest.fixture(scope="session")
def pp_runs(two_rank_gloo_runs) -> dict[str, truth.ConfigTruth]:
    return {c.name: two_rank_gloo_runs[c.name] for c in CONFIGS}   # the shared 2-rank spawn


@pytest.fixture(scope="session")
def pp_predicted(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, list[int]] = {}
    db = str(tmp_path_factory.mktemp("ppdb") / "cpu.db")

    def get(cfg: truth.TruthConfig) -> list[int]:
        if cfg.name not in cache:
            cache[cfg.name] = predict.predicted_rank_peaks(cfg, db=db, classes=rank_classes(cfg)[1])
        return cache[cfg.name]

    return get


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_stage_peak_matches_gloo(cfg, pp_runs, pp_predicted) -> None:
    real = pp_runs[cfg.name]
    pred = pp_predicted(cfg)
    assert_peaks_match(cfg, pred, real)




@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.schedule == "1f1b"], ids=lambda c: c.name)
def test_stage_parameters_and_adamw_state(cfg, pp_runs) -> None:
    """Each stage holds exactly the parameters (and AdamW state) of its module as the real stage does,
    and the stages together hold the model's: nothing lost, nothing duplicated."""
    program, classes = rank_classes(cfg)
    assert [rc.ranks for rc in classes] == [(0,), (1,)]
    real = pp_runs[cfg.name].ranks
    for rc in classes:
        (rank,) = rc.ranks
        assert resident_bytes(rc.program, "param") == real[rank].start_param_bytes
        # AdamW: exp_avg + exp_avg_sq of the stage's own parameters (2x) and one 4 B fp32 step scalar each
        n_params = len(rc.program.param_names)
        assert (
            resident_bytes(rc.program, "opt_state")
            == real[rank].start_optimizer_bytes
            == 2 * real[rank].start_param_bytes + 4 * n_params
        )
    # a tied weight (GPT-2's wte = lm_head) is held by both end stages: counted twice, once per stage
    tied = {"wte.weight"} if truth.MODEL_DIMS[cfg.model].get("tied") else set()
    tied_bytes = sum(int(n.meta["val"].nbytes) for n in program.graph.nodes
                     if program.param_names.get(n.name) in tied and program.input_roles.get(n.name) == "param")
    assert sum(resident_bytes(rc.program, "param") for rc in classes) == resident_bytes(program, "param") + tied_bytes
    # the real stages' parameter names are the model's, split as stage_layer_ranges says
    (lo0, hi0), (lo1, hi1) = stage_layer_ranges(2, 2)
    assert (lo0, hi0, lo1, hi1) == (0, 1, 1, 2)
    names = [set(rc.program.param_names.values()) for rc in classes]
    assert names[0] & names[1] == tied and names[0] | names[1] == set(program.param_names.values()) - {None}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_send_recv_sizes_match_the_real_run(cfg, pp_runs) -> None:
    """Every send and receive of each stage program, in order, against what gloo ran (element counts:
    one [micro-batch, seq, d] fp32 activation or gradient: batch 4 over 4 micro-batches, 1 x 32 x 64 = 2048
    elements; over 2, 4096)."""
    from boomfx.distributed.p2p import is_p2p
    from boomfx.passes.evaluate import Evaluator
    from boomfx.passes.liveness import _compute_nbytes
    from boomfx.distributed.pipeline_stages import micro_bindings
    from boomfx.frontend.capture import resolve_bindings

    program, classes = rank_classes(cfg)
    ev = Evaluator(micro_bindings(program, predict.parallel_config(cfg),
                                  resolve_bindings(program, {}, cfg.batch, cfg.seq)))
    for rc in classes:
        calls = [
            ("send" if n.target.__name__.startswith("send") else "recv", int(ev(_compute_nbytes(n.args[0].meta["val"]))) // 4)
            for n in rc.program.graph.nodes
            if is_p2p(n)
        ]
        real = [(c["op"], c["numel"][0]) for c in pp_runs[cfg.name].ranks[rc.ranks[0]].collectives
                if c["op"] in ("send", "recv")]   # a tied weight's all-reduce: test_tied_weight_...
        micro = cfg.batch // cfg.microbatches
        assert sorted(calls) == sorted(real) and all(n == micro * 32 * 64 for _, n in calls)
        if cfg.schedule == "gpipe":  # 1F1B fuses a send with the next receive into one batch
            assert [op for op, _ in calls] == [op for op, _ in real]


@pytest.mark.parametrize("cfg", PP_TIED, ids=[c.name for c in PP_TIED])
def test_tied_weight_gradient_is_all_reduced_between_the_end_stages(cfg, pp_runs) -> None:
    """GPT-2's tied ``wte``/``lm_head`` weight cut into two stages: each stage's program ends its pipeline with
    one all-reduce of the weight's whole gradient ([vocab, d] fp32) over the end stages' group, after its
    sends and receives and before AdamW reads the gradient, as the real step runs it; each stage's
    share is its own reader's (the embedding's backward on the first, the head's on the last)."""
    from boomfx.distributed.mesh_groups import PP_TIED_GROUP

    program, classes = rank_classes(cfg)
    vocab, d = truth.MODEL_DIMS[cfg.model]["vocab"], truth.MODEL_DIMS[cfg.model]["d"]
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME[c.op], c.input_bytes // 4) for c in calls]
        (rank,) = rc.ranks
        assert predicted == [(c["op"], c["numel"][0]) for c in pp_runs[cfg.name].ranks[rank].collectives]
        assert predicted[-1] == ("all_reduce", vocab * d) and [op for op, _ in predicted].count("all_reduce") == 1
        nodes = list(rc.program.graph.nodes)
        (reduce,) = [n for n in nodes if n.op == "call_function" and n.args[2:3] == (PP_TIED_GROUP,)]
        share = next(name for name, fqn in rc.program.grad_nodes.items() if fqn == "wte.weight")
        assert next(n for n in nodes if n.name == share).target is (
            torch.ops.aten.embedding_dense_backward.default if rank == 0 else torch.ops.aten.t.default)
        # after every pass, and AdamW's foreach ops read the reduced gradient
        assert nodes.index(reduce) > max(nodes.index(n) for n in nodes if n.op == "call_function"
                                          and rc.program.phase_of(n) in ("forward", "backward"))
        (waited,) = reduce.users
        assert waited.target is torch.ops._c10d_functional.wait_tensor.default
        assert any(n.target is torch.ops.aten._foreach_lerp_.Scalar for n in waited.users)


@pytest.mark.parametrize("cfg", PP_TIED_FOUR_RANKS, ids=[c.name for c in PP_TIED_FOUR_RANKS])
def test_tied_weight_under_pp_fsdp_and_pp_tp_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes,
                                                           tmp_path_factory) -> None:
    """The tied GPT's (stage, shard) and (stage, TP rank) peaks and collectives against the real run: under
    FSDP each end stage all-reduces its shard of the gradient ([vocab / 2, d]) after the reduce-scatters;
    under TP the weight is replicated on the TP ranks and the whole gradient is all-reduced."""
    real = four_rank_gloo_runs[cfg.name]
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    program, classes = pp_tp_classes(cfg)
    assert_peaks_match(cfg, predict.predicted_rank_peaks(cfg, db=str(db), classes=classes), real)
    vocab, d = truth.MODEL_DIMS[cfg.model]["vocab"], truth.MODEL_DIMS[cfg.model]["d"]
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME.get(c.op, c.op), c.input_bytes // 4) for c in calls]
        assert predicted[-1] == ("all_reduce", vocab * d // (2 if cfg.parallel == "pp_fsdp" else 1))
        for rank in rc.ranks:
            assert predicted == [(c["op"], c["numel"][0]) for c in real.ranks[rank].collectives]


def test_1f1b_send_references_by_hand() -> None:
    """Schedule1F1B's local lists on stage 0 of 2 with 4 micro-batches (order F0 F1 B0 F2 B1 F3 B2 B3):
    ``send_work`` keeps F0's output until the 1B1F loop ends (after B2, index 6); ``fwd_sends`` drops F1's
    at F2 (index 3) and F2's at F3 (index 5); F3's is kept until the schedule returns."""
    order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert send_releases("1f1b", order, 0, 2, 4) == {("F", 0): 6, ("F", 1): 3, ("F", 2): 5, ("F", 3): END}
    # the last stage sends gradients: each is kept by bwd_sends through the next backward
    last = [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert send_releases("1f1b", last, 1, 2, 4) == {("B", 0): 3, ("B", 1): 5, ("B", 2): 7, ("B", 3): END}
    assert set(send_releases("gpipe", order, 0, 2, 4).values()) == {END}


def _bad(capsys, *argv: str) -> str:
    code = main(list(argv))
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_pipeline_input(capsys) -> None:
    tiny = str(ROOT / "examples" / "llama_tiny.pt2")  # 2 layers
    base = ["analyze", tiny, "--train", "--batch", "2", "--seq", "16", "--device", "h100-sxm"]
    assert "pp=4 stages but the model has 2 layers" in _bad(capsys, *base, "--parallel", "pp=4")
    assert "--microbatches 3 does not divide the batch of 2" in _bad(
        capsys, *base, "--parallel", "pp=2", "--microbatches", "3"
    )
    assert "needs at least pp=2 micro-batches" in _bad(
        capsys, *base, "--parallel", "pp=2", "--microbatches", "1"
    )
    assert "pp=2 x 4 stages per rank = 8 stages but the model has 2 layers" in _bad(
        capsys, *base, "--parallel", "pp=2,dp_shard=2", "--pp-schedule", "interleaved_1f1b", "--microbatches", "2",
        "--pp-stages-per-rank", "4"
    )
    assert "DistributedDataParallel fails under ScheduleInterleaved1F1B" in _bad(
        capsys, *base, "--parallel", "pp=2,dp_replicate=2", "--pp-schedule", "interleaved_1f1b", "--microbatches", "2"
    )
    assert "interleaved_1f1b" in _bad(
        capsys, *base, "--parallel", "pp=2", "--pp-schedule", "interleaved_1f1b", "--microbatches", "2"
    )
    # pipeline options where nothing would read them: refused, not ignored
    assert "--pp-schedule: needs pipeline stages (pp > 1" in _bad(
        capsys, *base, "--parallel", "dp_shard=2", "--pp-schedule", "gpipe")
    assert "--pp-schedule, --pp-stages-per-rank: needs pipeline stages" in _bad(
        capsys, *base, "--parallel", "dp_shard=2", "--pp-schedule", "interleaved_1f1b", "--pp-stages-per-rank", "2")
    assert "--pp-schedule, --reshard-after-forward: needs --parallel (or --search)" in _bad(
        capsys, *base, "--pp-schedule", "gpipe", "--reshard-after-forward", "true")
    assert "--nodes: needs --parallel" in _bad(capsys, *base, "--nodes", "2")


def test_pipeline_report_has_every_stage() -> None:
    """The API's report lists both stages as rank classes with the micro-batch; each stage's step is
    reported, and the worst rank is one of them."""
    import boomfx

    tiny = str(ROOT / "examples" / "llama_tiny.pt2")
    report = boomfx.analyze(tiny, train=True, device="h100-sxm", batch=4, seq=16, parallel={"pp": 2, "microbatches": 2})
    par = report.parallel
    assert [c["ranks"] for c in par["classes"]] == [[0], [1]]
    assert par["batch_per_rank"] == 4 and par["micro_batch"] == 2 and par["global_batch"] == 4
    assert par["worst_rank"] in (0, 1)
    assert all(c["step_time_ns"] > 0 for c in par["classes"])
    # stage 0 under 1F1B with M=2: F0 F1 B0 B1, each handing on one [2, 16, 64] fp32 activation
    # (2 x 16 x 64 x 4 = 8,192 B) and receiving its gradient
    sends = [(c["op"], c["group"], c["input_bytes"], c["phase"]) for c in par["classes"][0]["collectives"]]
    assert sends == [("send", "pp", 8192, "forward")] * 2 + [("recv_", "pp", 8192, "backward")] * 2
    # the pipeline step: the last stage to finish ends it; the stages idle part of it (the bubble)
    rows = par["time_by_class"]
    assert rows[0]["pipeline_step_ns"] == max(c["step_time_ns"] for c in par["classes"])
    assert 0 < rows[0]["bubble_fraction"] < 1
    assert [r["step_time_ns"] for r in rows] == [c["step_time_ns"] for c in par["classes"]]


def test_pipeline_stages_on_an_oversubscribed_cpu_host_share_its_cores(monkeypatch) -> None:
    """pp=2 x dp_shard=2 is 4 one-thread gloo ranks: on a 2-core host every stage's passes and sends take
    twice their price (processor sharing, ``cpu_core_sharing``'s base), on 64 cores their own."""
    import boomfx.distributed.rank_schedule as rank_schedule
    from boomfx.analysis.analysis import AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import ProgramOptions
    from boomfx.distributed.analysis import DistributedAnalysis
    from boomfx.distributed.pipeline_time import pipeline_run
    from boomfx.distributed.plan import ParallelConfig
    from boomfx.distributed.step_time import class_steps
    from boomfx.frontend.capture import capture, resolve_bindings

    program = capture(str(ROOT / "examples" / "llama_tiny.pt2"), options=ProgramOptions(True))
    spec = cpu_spec()
    dist = DistributedAnalysis(program, ParallelConfig(pp=2, dp_shard=2, microbatches=2, backend="gloo"), spec,
                               AnalyzeOptions(spec.name, db="none"))
    bindings = dist.program_bindings(resolve_bindings(program, {}, 4, 16))
    points = [a.evaluate(bindings) for a in dist.analyses]
    busy, sends = {}, {}
    for cores in (64, 2):
        monkeypatch.setattr(rank_schedule, "host_cores", lambda cores=cores: cores)
        run = pipeline_run(dist, points, bindings, class_steps(dist, bindings, points=points))
        busy[cores], sends[cores] = run.timeline.busy_ns, run.send_ns
    assert all(b > 0 for b in busy[64])
    assert busy[2] == pytest.approx(tuple(2 * b for b in busy[64]))
    assert sends[64][0] > 0 and sends[2] == pytest.approx(tuple(2 * s for s in sends[64]))   # gloo's threads too


def test_max_batch_walks_micro_batches() -> None:
    """``--max-batch`` with pp searches the micro-batch: micro-batch 3 of M=2 is the batch of 6, the
    same stage memory as evaluating batch 6 directly; a batch M does not divide is refused."""
    from boomfx.core.devices import get_device
    from boomfx.core.errors import OptionError
    from boomfx.core.program import ProgramOptions
    from boomfx.distributed.analysis import DistributedAnalysis, MicroBatchSearch
    from boomfx.distributed.plan import ParallelConfig
    from boomfx.frontend.capture import capture, resolve_bindings

    program = capture(str(ROOT / "examples" / "llama_tiny.pt2"), options=ProgramOptions(True))
    dist = DistributedAnalysis(program, ParallelConfig(pp=2, microbatches=2), get_device("h100-sxm"))
    direct = dist.evaluate(resolve_bindings(program, {}, 6, 16), memory_only=True).report.parallel
    searched = MicroBatchSearch(dist).evaluate(resolve_bindings(program, {}, 3, 16), memory_only=True)
    assert searched.report.parallel["classes"] == direct["classes"]
    assert searched.report.parallel["batch_per_rank"] == 6 and direct["micro_batch"] == 3
    with pytest.raises(OptionError, match="does not divide the batch of 5"):
        dist.evaluate(resolve_bindings(program, {}, 5, 16), memory_only=True)


# -- pipeline x tensor parallelism (4 ranks: pp=2 x tp=2) -------------------------------------------
PP_TP = [truth.TruthConfig(model, "pp_tp", 4, timed_steps=0) for model in ("llama", "gpt")]
PP_DDP = [truth.TruthConfig(model, "pp_ddp", 4, timed_steps=0) for model in ("llama", "gpt")]
# DDP's gradient_as_bucket_view: at seq 8 the optimizer step, where the default holds every gradient, is the peak
PP_DDP += [truth.TruthConfig(model, "pp_ddp", 4, seq=8, gradient_as_bucket_view=True, timed_steps=0)
           for model in ("llama", "gpt")]


@pytest.fixture(scope="session")
def pp_tp_classes():
    cache: dict[str, tuple] = {}

    def get(cfg: truth.TruthConfig):
        if cfg.name not in cache:
            cache[cfg.name] = rank_classes(cfg)
        return cache[cfg.name]

    return get


@pytest.mark.parametrize("cfg", PP_TP + PP_DDP, ids=[c.name for c in PP_TP + PP_DDP])
def test_pp_tp_and_pp_ddp_rank_peak_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes, tmp_path_factory) -> None:
    """Each (stage, TP or DP rank) of a real ``PipelineStage`` whose layers are ``parallelize_module``d
    over the stage's TP group, or whose module is ``DistributedDataParallel`` over its dp group
    (mesh pp x tp / pp x dp, pp outer as torchtitan lays it out: ranks 0, 1 run stage 0)."""
    real = four_rank_gloo_runs[cfg.name]
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    pred = predict.predicted_rank_peaks(cfg, db=str(db), classes=pp_tp_classes(cfg)[1])
    assert_peaks_match(cfg, pred, real)


@pytest.mark.parametrize("cfg", PP_TP, ids=[c.name for c in PP_TP])
def test_pp_tp_stage_holds_its_tp_shard(cfg, four_rank_gloo_runs, pp_tp_classes) -> None:
    """One class per stage, both TP ranks of it alike; each stage holds the TP-local shapes of its own
    layers (the real stage's, which renumbers its layers from 0), and the stages together hold
    exactly the TP rank's parameters of the whole model (nothing lost or duplicated)."""
    from boomfx.distributed.tensor_parallel import tp_rank_program

    program, classes = pp_tp_classes(cfg)
    assert [rc.ranks for rc in classes] == [(0, 1), (2, 3)]
    real = four_rank_gloo_runs[cfg.name].ranks
    for rc in classes:
        shapes = sorted(list(n.meta["val"].shape) for n in rc.program.graph.nodes
                        if n.op == "placeholder" and rc.program.input_roles.get(n.name) == "param")
        for rank in rc.ranks:
            assert shapes == sorted(p["shape"] for p in real[rank].local_params.values())
            assert resident_bytes(rc.program, "param") == real[rank].start_param_bytes
            assert resident_bytes(rc.program, "opt_state") == real[rank].start_optimizer_bytes
    tp_only = tp_rank_program(program, predict.parallel_config(cfg))
    assert sum(resident_bytes(rc.program, "param") for rc in classes) == resident_bytes(tp_only, "param")
    # and TP really split them: half of each planned projection per rank (a smaller total than the model's)
    assert resident_bytes(tp_only, "param") < resident_bytes(program, "param")


@pytest.mark.parametrize("cfg", PP_TP, ids=[c.name for c in PP_TP])
def test_pp_tp_collective_sizes_match_the_real_run(cfg, four_rank_gloo_runs, pp_tp_classes) -> None:
    """Each stage's TP all-reduces and pipeline sends/receives against what gloo ran on each of its
    ranks. By hand, per micro-batch ([1, 32, 64] fp32 = 2048 elements each): one forward all-reduce per
    rowwise linear (llama: o, down; gpt: fc_out), one backward per colwise linear (llama: q, k, v, gate,
    up; gpt: fc), for the stage's one layer; x 4 micro-batches; 4 sends and 4 receives per stage."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.distributed.analysis import collectives
    from boomfx.distributed.p2p import is_p2p
    from boomfx.distributed.pipeline_stages import micro_bindings
    from boomfx.frontend.capture import resolve_bindings
    from boomfx.passes.evaluate import Evaluator
    from boomfx.passes.liveness import _compute_nbytes

    program, classes = pp_tp_classes(cfg)
    pcfg = predict.parallel_config(cfg)
    bindings = micro_bindings(program, pcfg, resolve_bindings(program, {}, cfg.batch, cfg.seq))
    spec = cpu_spec()
    styles = list(truth.TP_PLANS[cfg.model].values())
    for rc in classes:
        ev = Evaluator(bindings)
        reduces = [(c.phase, c.input_bytes // 4) for c in
                   collectives(rc.program, Analysis(rc.program, spec, AnalyzeOptions(spec.name, db="none"))
                               .evaluator(bindings))
                   if c.op == "all_reduce"]
        assert [p for p, _ in reduces].count("forward") == styles.count("rowwise") * cfg.microbatches
        assert [p for p, _ in reduces].count("backward") == styles.count("colwise") * cfg.microbatches
        p2p = [("send" if n.target.__name__.startswith("send") else "recv",
                int(ev(_compute_nbytes(n.args[0].meta["val"]))) // 4)
               for n in rc.program.graph.nodes if is_p2p(n)]
        assert len(p2p) == 2 * cfg.microbatches
        predicted = sorted([("all_reduce", n) for _, n in reduces] + p2p)
        assert {n for _, n in predicted} == {1 * 32 * 64}
        for rank in rc.ranks:
            real = sorted((c["op"], c["numel"][0]) for c in four_rank_gloo_runs[cfg.name].ranks[rank].collectives)
            assert predicted == real


@pytest.mark.parametrize("cfg", PP_TP_VOCAB, ids=[c.name for c in PP_TP_VOCAB])
def test_pp_with_torchtitan_tp_plan_rank_peak_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes,
                                                         tmp_path_factory) -> None:
    """pp=2 x tp=2 with torchtitan's plan on each stage module: the first stage's embedding
    vocabulary-parallel (its weight gradient the whole table, as DTensor leaves it), the last stage's
    head colwise with its logits gathered or, under loss parallel, kept split into the parallel
    cross-entropy; with sp the residual stream crosses the stage boundary split on the sequence."""
    real = four_rank_gloo_runs[cfg.name]
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    pred = predict.predicted_rank_peaks(cfg, db=str(db), classes=pp_tp_classes(cfg)[1])
    assert_peaks_match(cfg, pred, real)


@pytest.mark.parametrize("cfg", PP_TP_VOCAB, ids=[c.name for c in PP_TP_VOCAB])
def test_pp_with_torchtitan_tp_plan_stages_hold_the_vocabulary_shards(cfg, four_rank_gloo_runs,
                                                                       pp_tp_classes) -> None:
    """Each stage's parameters are the real stage's TP-local ones (the embedding's and head's
    vocab / 2 rows included); the first stage's embedding gradient is [vocab, d], twice its weight."""
    program, classes = pp_tp_classes(cfg)
    assert [rc.ranks for rc in classes] == [(0, 1), (2, 3)]
    real = four_rank_gloo_runs[cfg.name].ranks
    d = truth.MODEL_DIMS[cfg.model]["d"]
    for rc in classes:
        shapes = sorted(list(n.meta["val"].shape) for n in rc.program.graph.nodes
                        if n.op == "placeholder" and rc.program.input_roles.get(n.name) == "param")
        assert [truth.VOCAB // 2, d] in shapes
        for rank in rc.ranks:
            assert shapes == sorted(p["shape"] for p in real[rank].local_params.values())
            assert resident_bytes(rc.program, "param") == real[rank].start_param_bytes
    first = classes[0].program
    embed = [n for n in first.graph.nodes if first.grad_nodes.get(n.name) in ("embed.weight", "wte.weight")]
    assert embed and all(list(n.meta["val"].shape) == [truth.VOCAB, d] for n in embed)
    # DTensor's: the real stage's embedding .grad is the whole table, every other gradient its weight's shape
    for rank in classes[0].ranks:
        grads = {name: p["grad_shape"] for name, p in real[rank].local_params.items()}
        embed_name = "embed.weight" if "embed.weight" in grads else "wte.weight"
        assert grads[embed_name] == [truth.VOCAB, d]
        assert all(g == real[rank].local_params[name]["shape"] for name, g in grads.items() if name != embed_name)


@pytest.mark.parametrize("cfg", [c for c in PP_TP_VOCAB if c.parallel == "pp_tp_sp"],
                         ids=[c.name for c in PP_TP_VOCAB if c.parallel == "pp_tp_sp"])
def test_pp_with_sequence_parallel_sends_the_sequence_shard(cfg, four_rank_gloo_runs, pp_tp_classes) -> None:
    """Under sp the stage boundary carries each TP rank's half of the sequence: per micro-batch one
    [1, seq / 2, d] send (forward) and receive (backward) on stage 0, the reverse on stage 1, as
    gloo ran them."""
    from boomfx.distributed.p2p import is_p2p
    from boomfx.distributed.pipeline_stages import micro_bindings
    from boomfx.frontend.capture import resolve_bindings
    from boomfx.passes.evaluate import Evaluator
    from boomfx.passes.liveness import _compute_nbytes

    program, classes = pp_tp_classes(cfg)
    ev = Evaluator(micro_bindings(program, predict.parallel_config(cfg),
                                  resolve_bindings(program, {}, cfg.batch, cfg.seq)))
    numel = cfg.batch // cfg.microbatches * cfg.seq // 2 * truth.MODEL_DIMS[cfg.model]["d"]
    for rc in classes:
        predicted = sorted(("send" if n.target.__name__.startswith("send") else "recv",
                            int(ev(_compute_nbytes(n.args[0].meta["val"]))) // 4)
                           for n in rc.program.graph.nodes if is_p2p(n))
        assert predicted == sorted([("send", numel), ("recv", numel)] * cfg.microbatches)
        for rank in rc.ranks:
            real = sorted((c["op"], c["numel"][0]) for c in four_rank_gloo_runs[cfg.name].ranks[rank].collectives
                          if c["op"] in ("send", "recv"))
            assert predicted == real


@pytest.mark.parametrize("cfg", PP_DDP, ids=[c.name for c in PP_DDP])
def test_pp_ddp_all_reduces_once_after_the_last_backward(cfg, four_rank_gloo_runs, pp_tp_classes) -> None:
    """``PipelineStage`` runs every backward but the last under ``no_sync``: each stage all-reduces its
    one DDP bucket (all its parameters, under 25 MiB) once, in its last backward, of exactly the
    stage's parameter count, in the place gloo ran it (stage 1: before that backward's gradient
    send); the bucket is resident (a comm buffer placeholder)."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.distributed.analysis import collectives
    from boomfx.distributed.pipeline_stages import micro_bindings
    from boomfx.frontend.capture import resolve_bindings

    program, classes = pp_tp_classes(cfg)
    assert [rc.ranks for rc in classes] == [(0, 1), (2, 3)]
    bindings = micro_bindings(program, predict.parallel_config(cfg),
                              resolve_bindings(program, {}, cfg.batch, cfg.seq))
    spec = cpu_spec()
    for rc in classes:
        calls = collectives(rc.program, Analysis(rc.program, spec, AnalyzeOptions(spec.name, db="none"))
                            .evaluator(bindings))
        reduces = [c for c in calls if c.op.startswith("all_reduce")]
        stage_params = resident_bytes(rc.program, "param") // 4  # fp32
        assert [(c.group, c.input_bytes // 4) for c in reduces] == [("dp_replicate", stage_params)]
        # in the last backward, before that backward's send of the input gradient (stage 1) if any
        after = len(calls) - 1 - calls.index(reduces[0])
        assert reduces[0].phase == "backward" and after == (1 if rc.ranks[0] >= 2 else 0)
        buckets = [n.meta["val"] for n in rc.program.graph.nodes
                   if n.op == "placeholder" and rc.program.input_roles.get(n.name) == "comm_buffer"
                   and n.name.startswith("ddp_bucket")]
        assert [b.numel() for b in buckets] == [stage_params]  # resident, as DDP's reducer allocates it
        if cfg.gradient_as_bucket_view:  # scale_grads (after the last backward) divides .grad = the bucket's view
            scaled = [n for n in rc.program.graph.nodes if n.target is torch.ops.aten.div_.Scalar]
            assert len(scaled) == len(rc.program.grad_nodes) > 0
            assert all(n.args[0].target is torch.ops.aten.mul.Scalar_out for n in scaled)
        predicted = sorted(("all_reduce" if c.op.startswith("all_reduce") else c.op.rstrip("_"),
                            c.input_bytes // 4) for c in calls)
        for rank in rc.ranks:
            real = four_rank_gloo_runs[cfg.name].ranks[rank]
            assert sorted((c["op"], c["numel"][0]) for c in real.collectives) == predicted
            assert real.collectives[-1 - after] == {"op": "all_reduce", "dtype": "float", "numel": [stage_params]}
            assert resident_bytes(rc.program, "param") == real.start_param_bytes


GLOO_NAME = {"all_gather_into_tensor_out": "all_gather", "reduce_scatter_tensor": "all_reduce",
             "all_reduce_": "all_reduce", "send": "send", "recv_": "recv"}  # gloo runs reduce-scatter as all_reduce


def class_collectives(cfg: truth.TruthConfig, program, classes) -> list:
    """(rank class, its collectives in program order) at ``cfg``'s micro-batch bindings."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.distributed.analysis import collectives
    from boomfx.distributed.pipeline_stages import micro_bindings
    from boomfx.frontend.capture import resolve_bindings

    bindings = micro_bindings(program, predict.parallel_config(cfg),
                              resolve_bindings(program, {}, cfg.batch, cfg.seq))
    spec = cpu_spec()
    return [(rc, collectives(rc.program, Analysis(rc.program, spec, AnalyzeOptions(spec.name, db="none"))
                             .evaluator(bindings))) for rc in classes]


# -- pipeline x FSDP (4 ranks: pp=2 x dp_shard=2) ---------------------------------------------------
PP_FSDP = [truth.TruthConfig(model, "pp_fsdp", 4, reshard_after_forward=False, timed_steps=0)
           for model in ("llama", "gpt")]


@pytest.mark.parametrize("cfg", PP_FSDP + PP_FSDP_MIXED_PRECISION,
                         ids=[c.name for c in PP_FSDP + PP_FSDP_MIXED_PRECISION])
def test_pp_fsdp_rank_peak_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes, tmp_path_factory) -> None:
    """Each (stage, shard) of a real ``PipelineStage`` whose layers and stage module are ``fully_shard``ed
    over the stage's dp group (``reshard_after_forward=False``, as torchtitan runs pp): parameters
    gathered once and kept through the micro-batches, gradients accumulated unsharded. With
    torchtitan's ``MixedPrecisionPolicy(bf16, fp32)`` the stages compute in bf16 from fp32 shards and
    the gradients accumulate in fp32 (``unsharded_accumulated_grad``); with bf16 reduction in ``.grad``."""
    real = four_rank_gloo_runs[cfg.name]
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    pred = predict.predicted_rank_peaks(cfg, db=str(db), classes=pp_tp_classes(cfg)[1])
    assert_peaks_match(cfg, pred, real)


@pytest.mark.parametrize("cfg", PP_FSDP, ids=[c.name for c in PP_FSDP])
def test_pp_fsdp_stage_holds_half_its_parameters_and_adamw_state(cfg, four_rank_gloo_runs, pp_tp_classes) -> None:
    """Each shard of a stage holds the real run's local shapes and storages, and exactly half of the
    pp-alone stage's parameters and AdamW moments (every dim 0 of these models is even: no padding);
    the step scalars are one 4 B fp32 per parameter either way."""
    from boomfx.distributed.pipeline_stages import stage_programs
    from boomfx.distributed.plan import ParallelConfig

    program, classes = pp_tp_classes(cfg)
    assert [rc.ranks for rc in classes] == [(0, 1), (2, 3)]
    real = four_rank_gloo_runs[cfg.name].ranks
    alone = stage_programs(program, ParallelConfig(pp=2, microbatches=cfg.microbatches))
    for rc, stage in zip(classes, alone):
        shapes = sorted(list(n.meta["val"].shape) for n in rc.program.graph.nodes
                        if n.op == "placeholder" and rc.program.input_roles.get(n.name) == "param")
        n_params = len(shapes)
        assert 2 * resident_bytes(rc.program, "param") == resident_bytes(stage.program, "param")
        assert 2 * (resident_bytes(rc.program, "opt_state") - 4 * n_params) == resident_bytes(stage.program, "opt_state") - 4 * n_params
        for rank in rc.ranks:
            assert shapes == sorted(p["shape"] for p in real[rank].local_params.values())
            assert resident_bytes(rc.program, "param") == real[rank].start_param_bytes
            assert resident_bytes(rc.program, "opt_state") == real[rank].start_optimizer_bytes


@pytest.mark.parametrize("cfg", PP_FSDP, ids=[c.name for c in PP_FSDP])
def test_pp_fsdp_collectives_match_the_real_run(cfg, four_rank_gloo_runs, pp_tp_classes) -> None:
    """Every collective of each (stage, shard) program, in order, against what gloo ran: per unit (the
    stage module as root, then its layer) one all-gather of the rank's flat shard in the first
    forward; the 4 micro-batches' sends and receives; after the last backward one reduce-scatter per
    unit, root first (gloo: an all_reduce of the whole [2 x T] input, twice the shard)."""
    program, classes = pp_tp_classes(cfg)
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME[c.op], c.input_bytes // 4) for c in calls]
        gathers = [n for op, n in predicted if op == "all_gather"]
        reduces = [n for op, n in predicted if op == "all_reduce"]
        assert len(gathers) == 2 and reduces == [2 * g for g in gathers]
        assert sum(gathers) * 4 == resident_bytes(rc.program, "param")  # the shards, gathered once each
        assert [op for op, _ in predicted].count("send") == cfg.microbatches
        assert [op for op, _ in predicted][-2:] == ["all_reduce", "all_reduce"]
        for rank in rc.ranks:
            assert predicted == [(c["op"], c["numel"][0]) for c in four_rank_gloo_runs[cfg.name].ranks[rank].collectives]


@pytest.mark.parametrize("cfg", PP_FSDP_MIXED_PRECISION, ids=[c.name for c in PP_FSDP_MIXED_PRECISION])
def test_pp_fsdp_mixed_precision_collectives_and_dtypes(cfg, four_rank_gloo_runs, pp_tp_classes) -> None:
    """Every collective of each (stage, shard) in order, with its dtype, against the real run: the fp32
    shards all-gathered once in bf16 (half their bytes), bf16 sends of activations and gradients,
    one reduce-scatter per unit in the reduce dtype after the last backward; the resident shards and
    AdamW state stay fp32; with fp32 reduction the accumulators are fp32 copies of the first
    micro-batch's bf16 gradients, one per parameter, each later micro-batch added into them."""
    program, classes = pp_tp_classes(cfg)
    gloo_dtype = {"bfloat16": "c10::BFloat16", "float32": "float"}
    size = {"bfloat16": 2, "float32": 4}
    aten = torch.ops.aten
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME[c.op], gloo_dtype[c.dtype], c.input_bytes // size[c.dtype]) for c in calls]
        gathers = [(d, n) for op, d, n in predicted if op == "all_gather"]
        reduces = [(d, n) for op, d, n in predicted if op == "all_reduce"]
        assert [d for d, _ in gathers] == ["c10::BFloat16"] * 2
        assert reduces == [(gloo_dtype[cfg.reduce_dtype], 2 * n) for _, n in gathers]
        assert sum(n for _, n in gathers) * 4 == resident_bytes(rc.program, "param")  # fp32 shards
        assert all(d == "c10::BFloat16" for op, d, _ in predicted if op in ("send", "recv"))
        for rank in rc.ranks:
            run = four_rank_gloo_runs[cfg.name].ranks[rank]
            assert predicted == [(c["op"], c["dtype"], c["numel"][0]) for c in run.collectives]
            assert resident_bytes(rc.program, "param") == run.start_param_bytes
            assert resident_bytes(rc.program, "opt_state") == run.start_optimizer_bytes
        nodes = list(rc.program.graph.nodes)
        accumulators = [n for n in nodes if n.target is aten._to_copy.default and n.args[0].op != "placeholder"
                        and n.meta["val"].dtype == torch.float32 and n.args[0].meta["val"].dtype == torch.bfloat16
                        and any(u.target is aten.add_.Tensor for u in n.users)]
        n_params = sum(1 for n in nodes if n.op == "placeholder" and rc.program.input_roles.get(n.name) == "param")
        if cfg.reduce_dtype == "float32":
            assert len(accumulators) == n_params
            for acc in accumulators:   # micro-batches 2..4 added into the fp32 copy of the first
                adds = [u for u in acc.users if u.target is aten.add_.Tensor]
                assert len(adds) == cfg.microbatches - 1
                assert all(a.args[1].meta["val"].dtype == torch.bfloat16 for a in adds)
        else:
            assert accumulators == []


@pytest.mark.parametrize("cfg", PP_FSDP_RESHARD, ids=[c.name for c in PP_FSDP_RESHARD])
def test_pp_fsdp_resharding_after_forward_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes,
                                                      tmp_path_factory) -> None:
    """``fully_shard`` with ``reshard_after_forward=True`` on each stage layer under GPipe and 1F1B: every
    rank's peak within 1% of the gloo run's, and its collectives in order, with their dtypes and sizes.
    Hand count of the all-gathers: the root once; each layer at the stage's first action and at every
    action that follows a forward (a forward reshards, a backward leaves the layer gathered)."""
    from boomfx.simulate.pipeline import FORWARD, stage_orders

    real = four_rank_gloo_runs[cfg.name]
    program, classes = pp_tp_classes(cfg)
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    assert_peaks_match(cfg, predict.predicted_rank_peaks(cfg, db=str(db), classes=classes), real)
    size = {"bfloat16": 2, "float32": 4}
    gloo_dtype = {"bfloat16": "c10::BFloat16", "float32": "float"}
    for stage, (rc, calls) in enumerate(class_collectives(cfg, program, classes)):
        predicted = [(GLOO_NAME[c.op], gloo_dtype[c.dtype], c.input_bytes // size[c.dtype]) for c in calls]
        for rank in rc.ranks:
            assert predicted == [(c["op"], c["dtype"], c["numel"][0]) for c in real.ranks[rank].collectives]
        actions = stage_orders("gpipe" if cfg.schedule == "gpipe" else "1f1b", 2, cfg.microbatches)[stage]
        gathering = sum(1 for i, a in enumerate(actions) if i == 0 or actions[i - 1].kind == FORWARD)
        lo, hi = truth.stage_layer_ranges(len(truth.layer_list(truth.build_model(cfg.model))), 2)[stage]
        assert [op for op, _, _ in predicted].count("all_gather") == 1 + (hi - lo) * gathering


@pytest.mark.parametrize("cfg", PP_FSDP_INTERLEAVED, ids=[c.name for c in PP_FSDP_INTERLEAVED])
def test_interleaved_pp_fsdp_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes, tmp_path_factory) -> None:
    """``ScheduleInterleaved1F1B`` over ``fully_shard``ed chunks (each chunk's layer and the chunk module):
    the runtime's UNSHARD actions all-gather every unit of both chunks before the first action (the
    second chunk's flat buffers live until its first forward), each chunk reduce-scatters after its own
    last backward. Each (pipeline rank, shard) class: peak within 1% of the real run's, its FSDP
    collectives in order with their sizes, and the same sends and receives (the runtime posts its
    receives ahead of the actions that read them, so their order interleaves differently here)."""
    real = four_rank_gloo_runs[cfg.name]
    program, classes = pp_tp_classes(cfg)
    assert [rc.ranks for rc in classes] == [(0, 1), (2, 3)]
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    assert_peaks_match(cfg, predict.predicted_rank_peaks(cfg, db=str(db), classes=classes), real)
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME[c.op], c.input_bytes // 4) for c in calls]
        gathers = [i for i, (op, _) in enumerate(predicted) if op == "all_gather"]
        assert gathers == list(range(len(gathers))) and len(gathers) >= 2   # all issued up front
        fsdp = [c for c in predicted if c[0] not in ("send", "recv")]
        assert [op for op, _ in fsdp] == ["all_gather"] * len(gathers) + ["all_reduce"] * len(gathers)
        for rank in rc.ranks:
            ran = [(c["op"], c["numel"][0]) for c in real.ranks[rank].collectives]
            real_fsdp = [c for c in ran if c[0] not in ("send", "recv")]
            # gloo runs queued collectives on its two worker threads and the profiler stamps each when a
            # thread starts it, so two all-gathers issued back to back can swap places in the real list
            # (seen: 24,992 and 8,256 elements): every all-gather before any all-reduce, as predicted,
            # and the same sizes in each phase
            assert [op for op, _ in real_fsdp] == [op for op, _ in fsdp]
            phases = lambda seq: (Counter(seq[: len(gathers)]), Counter(seq[len(gathers):]))  # noqa: E731
            assert phases(real_fsdp) == phases(fsdp)
            assert Counter(predicted) == Counter(ran)
            assert resident_bytes(rc.program, "param") == real.ranks[rank].start_param_bytes
            assert resident_bytes(rc.program, "opt_state") == real.ranks[rank].start_optimizer_bytes


def _runs_sorted(seq: list) -> list:
    """``seq`` with each run of one op's consecutive entries sorted: gloo's two worker threads may start two
    collectives issued back to back in either order (the profiler stamps each when a thread starts it)."""
    out, run = [], []
    for item in seq + [(None, 0)]:
        if run and item[0] != run[0][0]:
            out += sorted(run)
            run = []
        run.append(item)
    return out


@pytest.mark.parametrize("cfg", PP_FSDP_INTERLEAVED_RESHARDING, ids=[c.name for c in PP_FSDP_INTERLEAVED_RESHARDING])
def test_interleaved_pp_fsdp_resharding_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes, tmp_path_factory) -> None:
    """``ScheduleInterleaved1F1B`` over ``fully_shard``ed chunks whose layers reshard after each forward (their
    hooks gather them again at the chunk's next action). Each (pipeline rank, shard) class: peak within 1% of the real run's, its FSDP collectives in the real
    order with their sizes, the same sends and receives, and more all-gathers than units."""
    real = four_rank_gloo_runs[cfg.name]
    program, classes = pp_tp_classes(cfg)
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    assert_peaks_match(cfg, predict.predicted_rank_peaks(cfg, db=str(db), classes=classes), real)
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME[c.op], c.input_bytes // 4) for c in calls]
        fsdp = [c for c in predicted if c[0] not in ("send", "recv")]
        units = sum(1 for op, _ in fsdp if op == "all_reduce")
        assert sum(1 for op, _ in fsdp if op == "all_gather") > units
        for rank in rc.ranks:
            ran = [(c["op"], c["numel"][0]) for c in real.ranks[rank].collectives]
            assert _runs_sorted([c for c in ran if c[0] not in ("send", "recv")]) == _runs_sorted(fsdp)
            assert Counter(predicted) == Counter(ran)


@pytest.mark.parametrize("cfg", PP_FSDP_WRAP_ROOT, ids=[c.name for c in PP_FSDP_WRAP_ROOT])
def test_pp_fsdp_wrapping_whole_stages_matches_gloo(cfg, four_rank_gloo_runs, pp_tp_classes, tmp_path_factory) -> None:
    """``fully_shard`` on each stage (or chunk) module only: every rank's peak within 1% of the real run's, its
    FSDP collectives in the real order, one reduce-scatter per stage or chunk holding all its parameters,
    and (GPipe, 1F1B) one all-gather of them a step even with ``reshard_after_forward=True``: the stage
    module is FSDP's root, which fully_shard's default never reshards after forward."""
    real = four_rank_gloo_runs[cfg.name]
    program, classes = pp_tp_classes(cfg)
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    assert_peaks_match(cfg, predict.predicted_rank_peaks(cfg, db=str(db), classes=classes), real)
    chunks = cfg.stages_per_rank if cfg.schedule == "interleaved_1f1b" else 1
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME[c.op], c.input_bytes // 4) for c in calls]
        fsdp = [c for c in predicted if c[0] not in ("send", "recv")]
        reduces = [n for op, n in fsdp if op == "all_reduce"]
        assert len(reduces) == chunks and sum(reduces) * 2 == resident_bytes(rc.program, "param")   # [2 x T] each
        if chunks == 1:
            assert [op for op, _ in fsdp] == ["all_gather", "all_reduce"]
        for rank in rc.ranks:
            ran = [(c["op"], c["numel"][0]) for c in real.ranks[rank].collectives]
            assert _runs_sorted([c for c in ran if c[0] not in ("send", "recv")]) == _runs_sorted(fsdp)
            assert Counter(predicted) == Counter(ran)


# -- pipeline x HSDP (8 ranks: pp=2 x dp_replicate=2 x dp_shard=2) -----------------------------------
PP_HSDP = [truth.TruthConfig("llama", "pp_hsdp", 8, reshard_after_forward=False, timed_steps=0),
           truth.TruthConfig("gpt", "pp_hsdp", 8, reshard_after_forward=False, timed_steps=0,
                             param_dtype="bfloat16", reduce_dtype="float32")]


@pytest.fixture(scope="module")
def eight_rank_gloo_runs():
    """The 8-rank gloo truth runs of pp x HSDP, in one spawn."""
    return {r.config.name: r for r in truth.run_configs(PP_HSDP)}


@pytest.mark.parametrize("cfg", PP_HSDP, ids=[c.name for c in PP_HSDP])
def test_pp_hsdp_rank_peak_and_collectives_match_gloo(cfg, eight_rank_gloo_runs, pp_tp_classes,
                                                      tmp_path_factory) -> None:
    """Stages ``fully_shard``ed over a 2-D (replicate, shard) mesh: each (stage, shard) class's peak
    within 1% of all its ranks' real peaks, and its collectives in order against theirs: the shard
    group's all-gathers, the sends, then per unit a reduce-scatter over the shard group followed by
    an all-reduce of the shard over the replicas, in the reduce dtype."""
    real = eight_rank_gloo_runs[cfg.name]
    program, classes = pp_tp_classes(cfg)
    assert [rc.ranks for rc in classes] == [(0, 1, 2, 3), (4, 5, 6, 7)]   # a stage's shards hold equal shapes
    db = tmp_path_factory.getbasetemp() / "pp_tp_cpu.db"
    assert_peaks_match(cfg, predict.predicted_rank_peaks(cfg, db=str(db), classes=classes), real)
    size = {"bfloat16": 2, "float32": 4}
    for rc, calls in class_collectives(cfg, program, classes):
        predicted = [(GLOO_NAME[c.op], c.input_bytes // size[c.dtype]) for c in calls]
        groups = [c.group for c in calls if c.op in ("reduce_scatter_tensor", "all_reduce_")]
        assert groups == ["dp_shard", "dp_replicate"] * 2   # per unit (root, layer)
        for rank in rc.ranks:
            assert predicted == [(c["op"], c["numel"][0]) for c in real.ranks[rank].collectives]
            assert resident_bytes(rc.program, "param") == real.ranks[rank].start_param_bytes


def test_pp_fsdp_tp_composes() -> None:
    """pp x dp_shard x tp (no truth run): TP first, then stages, then FSDP over each stage's TP-local
    parameters: every shard holds half its pp x tp stage's parameters, and its all-gathers cover them."""
    from boomfx.core.program import ProgramOptions
    from boomfx.distributed.plan import ParallelConfig
    from boomfx.distributed.ranks import rank_programs
    from boomfx.frontend.capture import capture

    program = capture(str(ROOT / "examples" / "llama_tiny.pt2"), options=ProgramOptions(True))
    pp_tp = rank_programs(program, ParallelConfig(pp=2, tp=2, microbatches=2))
    full = rank_programs(program, ParallelConfig(pp=2, tp=2, dp_shard=2, microbatches=2,
                                                 reshard_after_forward=False))
    # mesh pp x dp_shard x tp (pp outer, tp inner): stage 0 is ranks 0-3
    assert [rc.ranks for rc in full] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for rc, stage in zip(full, pp_tp):
        assert 2 * resident_bytes(rc.program, "param") == resident_bytes(stage.program, "param")
        gathered = [n for n in rc.program.graph.nodes
                    if n.op == "call_function" and n.target is torch.ops._c10d_functional.all_gather_into_tensor_out.default]
        assert sum(n.args[0].meta["val"].numel() * 4 for n in gathered) == resident_bytes(rc.program, "param")


def test_reshard_after_forward_follows_torchtitans_default_policy() -> None:
    """Not given, ``reshard_after_forward`` is torchtitan's "default" policy: on without pipeline
    parallelism, off with it; the pipeline program built without the option is the one built with
    ``False`` (same nodes, same all-gathers); an explicit ``True`` gathers the layer again (here 2
    micro-batches of 1F1B: both forwards and the first backward), with every schedule."""
    from boomfx.core.program import ProgramOptions
    from boomfx.distributed.plan import ParallelConfig
    from boomfx.distributed.ranks import rank_programs
    from boomfx.frontend.capture import capture

    assert ParallelConfig(dp_shard=2).reshards_after_forward is True
    assert ParallelConfig(pp=2, dp_shard=2, microbatches=2).reshards_after_forward is False
    assert ParallelConfig(pp=2, dp_shard=2, microbatches=2, reshard_after_forward=True).not_modelled() is None
    assert ParallelConfig(pp=2, dp_shard=2, microbatches=2, reshard_after_forward=True,
                          pp_schedule="interleaved_1f1b", pp_stages_per_rank=4).not_modelled() is None
    program = capture(str(ROOT / "examples" / "llama_tiny.pt2"), options=ProgramOptions(True))
    default = rank_programs(program, ParallelConfig(pp=2, dp_shard=2, microbatches=2))
    given = rank_programs(program, ParallelConfig(pp=2, dp_shard=2, microbatches=2, reshard_after_forward=False))
    assert [rc.ranks for rc in default] == [rc.ranks for rc in given]
    for a, b in zip(default, given):
        assert [(n.op, str(n.target)) for n in a.program.graph.nodes] == [(n.op, str(n.target)) for n in b.program.graph.nodes]
    gather = torch.ops._c10d_functional.all_gather_into_tensor_out.default
    resharding = rank_programs(program, ParallelConfig(pp=2, dp_shard=2, microbatches=2, reshard_after_forward=True))
    for a, b in zip(resharding, given):   # one layer per stage: 3 gathers of it instead of 1
        count = [sum(1 for n in rc.program.graph.nodes if n.target is gather) for rc in (a, b)]
        assert count[0] == count[1] + 2


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (2, 2, 3), (4, 4, 4), (3, 6, 2)])
def test_interleaved_order_is_torchs(pp, m, v) -> None:
    """Each rank's forwards and backwards (chunk, micro-batch) in the order torch's own
    ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` lists them (its idle slots dropped)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from boomfx.simulate.pipeline import stage_orders

    schedule = object.__new__(ScheduleInterleaved1F1B)  # the order needs no stages or process group
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = v, pp, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    ours = stage_orders("interleaved", pp, m, v)
    for rank in range(pp):
        theirs = [("F" if a.computation_type == _ComputationType.FORWARD else "B", a.microbatch_index, a.stage_index)
                  for a in schedule._calculate_single_rank_operations(rank) if a is not None]
        assert [(p.kind, p.microbatch, p.virtual_stage) for p in ours[rank]] == theirs


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (2, 4, 4), (4, 8, 5), (3, 6, 3), (2, 2, 6)])
def test_fsdp_unshard_reshard_is_torchs_lowering(pp, m, v) -> None:
    """The chunks torch's runtime reshards and all-gathers before each pass (``_add_unshard_reshard`` on
    ``ScheduleInterleaved1F1B``'s own order), against ``unshard_reshard`` on boomfx's order: up to 3 chunks
    are each gathered once a step (before the first pass); more cycle through 3 at a time."""
    from torch.distributed.pipelining.schedules import (
        RESHARD, UNSHARD, ScheduleInterleaved1F1B, _add_unshard_reshard)

    from boomfx.simulate.pipeline import stage_orders, unshard_reshard

    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = v, pp, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    for rank, order in enumerate(stage_orders("interleaved", pp, m, v)):
        theirs, evict, fetch = [], [], []
        for a in _add_unshard_reshard(schedule._calculate_single_rank_operations(rank)):
            if a.computation_type == RESHARD:
                evict.append(a.stage_index)
            elif a.computation_type == UNSHARD:
                fetch.append(a.stage_index)
            else:
                theirs.append((tuple(sorted(evict)), tuple(fetch)))
                evict, fetch = [], []
        ours = unshard_reshard(order)
        assert ours == theirs
        assert (v <= 3) == (sum(len(f) for _, f in ours) == v)   # up to 3: each gathered once a step


@pytest.mark.parametrize("wrap,reshard", [("layers", False), ("layers", True), ("root", False)])
def test_interleaved_fsdp_with_four_chunks_gathers_as_torchs_lowering(wrap, reshard) -> None:
    """4 chunks per rank (pp=2, 8 layers): each chunk's units are all-gathered once per UNSHARD torch's
    ``_add_unshard_reshard`` issues for it (the runtime keeps 3 chunks gathered), plus, when the layers
    reshard after forward, once per action that finds them sharded; one reduce-scatter per unit.
    (Real gloo runs: benchmarks/results/distributed_gloo.md, rows llama8-...-v4; their per-step peaks vary
    with the async re-gathers' timing, so no test compares them.)"""
    from torch.distributed.pipelining.schedules import (
        FORWARD, FULL_BACKWARD, RESHARD, UNSHARD, ScheduleInterleaved1F1B, _add_unshard_reshard)

    cfg = truth.TruthConfig("llama8", "pp_fsdp", 4, schedule="interleaved_1f1b", reshard_after_forward=reshard,
                            stages_per_rank=4, fsdp_wrap=wrap)
    program, classes = rank_classes(cfg)
    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = 4, 2, cfg.microbatches
    schedule.number_of_rounds, schedule.microbatches_per_round = 2, 2
    gather = torch.ops._c10d_functional.all_gather_into_tensor_out.default
    reduce = torch.ops._c10d_functional.reduce_scatter_tensor.default
    def units(k: int) -> int:
        """FSDP units holding parameters in virtual stage k: its layer, and its chunk module where that
        holds the embedding (stage 0) or the final norm and head (stage 7); with wrap root, the module."""
        return 1 if wrap == "root" else 1 + (k in (0, 7))

    for rc in classes:
        s = rc.ranks[0] // 2
        unshards = [a.stage_index for a in _add_unshard_reshard(schedule._calculate_single_rank_operations(s))
                    if a.computation_type == UNSHARD]
        assert len(unshards) > 4                                  # chunks come back
        gathers = sum(1 for n in rc.program.graph.nodes if n.target is gather)
        assert sum(1 for n in rc.program.graph.nodes if n.target is reduce) == sum(units(k) for k in range(s, 8, 2))
        if not reshard:
            assert gathers == sum(units(k) for k in unshards)
            continue
        # the layer also reshards after each forward, and its hooks gather it at the chunk's next action
        # (a backward leaves it gathered); the chunk module, FSDP's root, does not (seen on gloo)
        layer_sharded, expected = {k: True for k in range(8)}, 0
        for a in _add_unshard_reshard(schedule._calculate_single_rank_operations(s)):
            k = a.stage_index
            if a.computation_type == UNSHARD:
                expected += units(k) - 1 + layer_sharded[k]
                layer_sharded[k] = False
            elif a.computation_type == RESHARD:
                layer_sharded[k] = True
            elif a.computation_type in (FORWARD, FULL_BACKWARD):
                expected += layer_sharded[k]
                layer_sharded[k] = a.computation_type == FORWARD
        assert gathers == expected > sum(units(k) for k in unshards)


def test_interleaved_ranks_hold_their_chunks() -> None:
    """Rank s holds chunks s and s + pp (layers.0 and layers.2 on rank 0 of pp=2 over 4 layers), every
    parameter once, and one receive buffer per micro-batch of each chunk that receives."""
    cfg = truth.TruthConfig("llama4", "pp", 2, schedule="interleaved_1f1b", microbatches=4)
    program, classes = rank_classes(cfg)
    assert "layers.0, layers.2" in classes[0].description and "layers.1, layers.3" in classes[1].description
    held = [set(rc.program.param_names.values()) for rc in classes]
    assert not held[0] & held[1]
    assert held[0] | held[1] == {f for n, f in program.param_names.items()
                                 if program.input_roles.get(n) == "param"}
    assert sum(resident_bytes(rc.program, "param") for rc in classes) == resident_bytes(program, "param")
    buffers = [sorted(n.name for n in rc.program.graph.nodes if n.name.startswith("pp_recv")) for rc in classes]
    # rank 0: chunk 0 receives gradients only, chunk 2 both; rank 1: chunk 1 both, chunk 3 activations only
    assert len(buffers[0]) == 4 * 3 and len(buffers[1]) == 4 * 3


def test_an_interleaved_stages_chunks_are_one_block_class() -> None:
    """Rank 0's two chunks (layers.0 and layers.2, each one forward and backward per micro-batch: 868
    nodes) are equal up to node order: the block pass merges them into one class, node for node. Their
    near-identical micro-batch copies sent label-only VF2 into backtracking that gave up after seconds;
    colour refinement with individualisation maps them in a fraction of that."""
    from torch.utils._pytree import tree_leaves

    from boomfx.passes.blocks import block_pass

    cfg = truth.TruthConfig("llama4", "pp", 2, schedule="interleaved_1f1b", microbatches=4)
    stage = rank_classes(cfg)[1][0].program
    info = block_pass(stage)
    assert [(c.name, c.instances) for c in info.classes] == [("layers.*", ("layers.0", "layers.2"))]
    by_name = {n.name: n for n in stage.graph.nodes}
    first, second = info.classes[0].nodes
    assert len(first) == len(second) == 868
    assert [by_name[n].target for n in first] == [by_name[n].target for n in second]
    shapes = lambda nodes: [[tuple(t.shape) for t in tree_leaves(by_name[n].meta["val"])] for n in nodes]  # noqa: E731
    assert shapes(first) == shapes(second)


def test_pipeline_sends_are_priced_by_the_databases_measured_rows(tmp_path) -> None:
    """A stage's send is a ``send_recv`` of its boundary activation: with a measured row for that size in
    ``--db`` (what ``kernels collect --collectives`` stores) the pipeline uses it, not the model, and each
    added microsecond of it lands on the step (1F1B, M=2, 2 stages: F0's send and B1's gradient back are on
    the critical path, and the stages' passes are the same either way)."""
    from boomfx.analysis.analysis import AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import ProgramOptions
    from boomfx.distributed.analysis import DistributedAnalysis
    from boomfx.distributed.plan import ParallelConfig
    from boomfx.frontend.capture import capture, resolve_bindings
    from boomfx.kernels_db.collective_import import CollectiveRow, record_of
    from boomfx.kernels_db.measure import current_fingerprint
    from boomfx.kernels_db.store import Store

    program = capture(str(ROOT / "examples" / "llama_tiny.pt2"), options=ProgramOptions(True))
    spec = cpu_spec()
    cfg = ParallelConfig(pp=2, microbatches=2, backend="gloo")
    bindings = resolve_bindings(program, {}, 4, 16)
    rows = {}
    for name, send_ns in (("none", None), ("fast", 1.0e5), ("slow", 6.0e5)):
        db = "none"
        if send_ns is not None:
            db = str(tmp_path / f"{name}.sqlite")
            row = CollectiveRow("send_recv", 8192, 2, 2, "float32", send_ns, send_ns, send_ns, 40)
            with Store(db) as store:   # one [2, 16, 64] fp32 activation per micro-batch (8,192 B)
                store.put_many([record_of(row, current_fingerprint(torch.device("cpu")), "measured:gloo", "gloo")])
        dist = DistributedAnalysis(program, cfg, spec, AnalyzeOptions(spec.name, db=db))
        rows[name] = dist.evaluate(bindings).report.parallel["time_by_class"][0]
    assert rows["none"]["send_source"] == "model" and rows["none"]["send_bytes"] == 8192
    for name, send_ns in (("fast", 1.0e5), ("slow", 6.0e5)):
        assert (rows[name]["send_source"], rows[name]["send_ns"]) == ("measured", send_ns)
    assert rows["slow"]["pipeline_step_ns"] - rows["fast"]["pipeline_step_ns"] == pytest.approx(2 * 5.0e5, rel=0.05)
