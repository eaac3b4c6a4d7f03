"""Per-rank programs against real multi-process training steps on gloo (CPU).

The truth is ``benchmarks/distributed_truth.py``: 2 or 4 processes on 127.0.0.1 run real AdamW steps
of a Llama-style (GQA) and a GPT-2-style model under DDP, FSDP2 (``fully_shard`` per layer and the
root, reshard after forward on and off) and HSDP, and record each rank's profiler peak above the
step's start, its parameter and optimizer-state storages, local shard shapes and the collectives
gloo ran. All configurations of one world size share one spawn (session-scoped), so the whole file
pays for two spawns.

The prediction is boomfx's per-rank program for the same configuration (boomfx.distributed), each
compute kernel's scratch measured on this CPU as tests/test_cpu_memory_accuracy.py does.

Tensor parallelism and TP x FSDP: tests/test_distributed_tp.py; pipeline parallelism:
tests/test_distributed_pp.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import distributed_predict as predict  # noqa: E402
import distributed_truth as truth  # noqa: E402
from gloo_checks import (BUCKET_VIEW, MEMORY_FOUR_RANKS, MEMORY_TWO_RANKS, MIXED_PRECISION,  # noqa: E402
                         assert_peaks_match, rank_classes, resident_bytes)

from boomfx.cli.main import main  # noqa: E402
from boomfx.distributed.fsdp import local_shard_shape, padded_shard_shape  # noqa: E402

TWO_RANKS, FOUR_RANKS = MEMORY_TWO_RANKS, MEMORY_FOUR_RANKS
CONFIGS = TWO_RANKS + FOUR_RANKS


@pytest.fixture(scope="session")
def gloo_runs(two_rank_gloo_runs, four_rank_gloo_runs) -> dict[str, truth.ConfigTruth]:
    """Every configuration's real run, by name (from the shared 2- and 4-rank spawns)."""
    return {c.name: (two_rank_gloo_runs if c.world == 2 else four_rank_gloo_runs)[c.name] for c in CONFIGS}


@pytest.fixture(scope="session")
def predicted(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, list[int]] = {}
    db = str(tmp_path_factory.mktemp("distdb") / "cpu.db")

    def get(cfg: truth.TruthConfig) -> list[int]:
        if cfg.name not in cache:
            cache[cfg.name] = predict.predicted_rank_peaks(cfg, db=db, classes=rank_classes(cfg)[1])
        return cache[cfg.name]

    return get


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_rank_peak_matches_gloo(cfg: truth.TruthConfig, gloo_runs, predicted) -> None:
    real = gloo_runs[cfg.name]
    pred = predicted(cfg)
    assert_peaks_match(cfg, pred, real)




@pytest.mark.parametrize("model", ("llama", "gpt"))
def test_bucket_view_frees_each_gradient_at_its_copy(model, gloo_runs, predicted) -> None:
    """With ``gradient_as_bucket_view`` each gradient is copied into the resident bucket when ready and
    freed there (``.grad`` is the bucket's view), so the step holds the bucket but no gradient:

    - the bucket holds every gradient: its bytes are the parameters' fp32 bytes (sum of numel x 4), and
      gloo all-reduced exactly that many elements;
    - in the liveness no storage is a gradient, and the storage each copy reads ends at that copy (in
      the default program the same storage is held by ``.grad`` to the optimizer's last op);
    - at seq 8 the peak is the optimizer step, where the default holds every gradient on top of the
      bucket: the real run's peak drops by exactly the gradient bytes, and so does the prediction."""
    from boomfx.frontend.capture import resolve_bindings
    from boomfx.passes.evaluate import Evaluator
    from boomfx.passes.liveness import Category, _compute_nbytes, step_liveness_pass

    default, view = (c for c in BUCKET_VIEW if c.model == model)
    program, (rc,) = rank_classes(view)
    _, (rc_default,) = rank_classes(default)
    grad_bytes = sum(
        math.prod(n.meta["val"].shape) * 4
        for n in program.graph.nodes
        if n.op == "placeholder" and program.input_roles.get(n.name) == "param"
    )
    assert resident_bytes(rc.program, "comm_buffer") == resident_bytes(rc_default.program, "comm_buffer") == grad_bytes
    for rank in gloo_runs[view.name].ranks:
        assert [c["numel"] for c in rank.collectives if c["op"] == "all_reduce"] == [[grad_bytes // 4]]

    copies = [n for n in rc.program.graph.nodes if n.target is torch.ops.aten.mul.Scalar_out]
    assert len(copies) == len(rc.program.grad_nodes) == len(program.grad_nodes)
    for prog, held_to_optimizer_end in ((rc.program, False), (rc_default.program, True)):
        info = step_liveness_pass(prog)
        ev = Evaluator(resolve_bindings(prog, {}, view.batch, view.seq))
        step_of = {name: i for i, name in enumerate(info.order)}
        ends = {}
        for iv in info.intervals:
            if not iv.resident:
                ends.setdefault(iv.end_step, []).append(int(ev(iv.nbytes)))
        grads = [iv for iv in info.intervals if iv.category == Category.GRAD and not iv.resident]
        if held_to_optimizer_end:
            assert sum(int(ev(iv.nbytes)) for iv in grads) == grad_bytes
            last_opt = max(i for i, name in enumerate(info.order) if prog.phases.get(name) == "optimizer")
            assert {iv.end_step for iv in grads} == {last_opt}
        else:
            assert grads == []
            for c in copies:   # a storage of the gradient's size ends at its copy
                assert int(ev(_compute_nbytes(c.args[0].meta["val"]))) in ends.get(step_of[c.name], [])

    real_drop = [d.peak_bytes - v.peak_bytes for d, v in zip(gloo_runs[default.name].ranks, gloo_runs[view.name].ranks)]
    predicted_drop = [d - v for d, v in zip(predicted(default), predicted(view))]
    assert real_drop == predicted_drop == [grad_bytes] * 2


def test_gradient_as_bucket_view_on_the_command_line(capsys, tmp_path) -> None:
    """``--gradient-as-bucket-view`` reaches the DDP rewrite from ``analyze --parallel`` (the same rank peak as
    the Python API's option, below the default's) and from ``--search`` (its request carries it)."""
    import json

    import boomfx
    from boomfx.cli.main import build_parser
    from boomfx.distributed.search_cli import search_request

    tiny = str(ROOT / "examples" / "llama_tiny.pt2")
    out = tmp_path / "r.json"
    base = ["analyze", tiny, "--train", "--batch", "2", "--seq", "16", "--device", "h100-sxm"]
    assert main(base + ["--parallel", "dp_replicate=2", "--gradient-as-bucket-view", "--json", str(out)]) == 0
    capsys.readouterr()
    parallel = json.loads(out.read_text())["parallel"]
    assert parallel["config"]["gradient_as_bucket_view"] is True
    api = boomfx.analyze(tiny, train=True, device="h100-sxm", batch=2, seq=16,
                         parallel={"dp_replicate": 2, "gradient_as_bucket_view": True})
    default = boomfx.analyze(tiny, train=True, device="h100-sxm", batch=2, seq=16, parallel="dp_replicate=2")
    peaks = [r.parallel["classes"][0]["peak_live_bytes"] for r in (api, default)]
    assert parallel["classes"][0]["peak_live_bytes"] == peaks[0] < peaks[1]
    args = build_parser().parse_args(base[:2] + ["--train", "--search", "--nodes", "1", "--gpus-per-node", "2",
                                                 "--global-batch", "4", "--gradient-as-bucket-view"])
    assert search_request(args, {}).config_options["gradient_as_bucket_view"] is True


def test_truth_counts_a_free_on_a_thread_without_the_profiler() -> None:
    """gloo's worker thread frees a collective's tensors when it drops the last reference to the Work,
    outside the profiler's thread state: the profiler records no free. Here a plain thread frees a
    1 MiB block, then the step allocates another 1 MiB: the live peak is one block (1,048,576 B), not the
    two that the events' sizes sum to when the first free has no event."""
    import threading

    block_bytes = 1 << 20

    def step() -> None:
        held = [torch.empty(block_bytes, dtype=torch.uint8)]
        freer = threading.Thread(target=held.clear)
        freer.start()
        freer.join()
        torch.empty(block_bytes, dtype=torch.uint8)

    peaks, _ = truth._profiled_steps(step)
    assert peaks == [block_bytes] * truth.MEASURED_STEPS


@pytest.mark.parametrize(
    "cfg", [c for c in TWO_RANKS if c.parallel == "fsdp" and c.reshard_after_forward], ids=lambda c: c.name
)
def test_fsdp_holds_one_nth_of_params_and_adamw_state(cfg, gloo_runs) -> None:
    """The rank's parameter storages (padded shards) and AdamW state (unpadded local shards) equal the
    real rank's, and are 1/N of the model's (the models' dims divide by 2: no padding here)."""
    program, classes = rank_classes(cfg)
    (rc,) = classes
    real = gloo_runs[cfg.name].ranks[0]
    full_params = resident_bytes(program, "param")
    assert resident_bytes(rc.program, "param") == real.start_param_bytes == full_params // 2
    # AdamW: exp_avg + exp_avg_sq per parameter (2x the shard) + one fp32 step scalar per parameter
    steps = sum(1 for n in program.graph.nodes if n.op == "placeholder" and n.name.startswith("step_"))
    assert (
        resident_bytes(rc.program, "opt_state") == real.start_optimizer_bytes == 2 * full_params // 2 + 4 * steps
    )
    for fqn, local in real.local_params.items():
        assert local["shape"] == local_shard_shape(_full_shape(program, fqn), 2, 0)


def _full_shape(program, fqn: str) -> list[int]:
    name = next(n for n, f in program.param_names.items() if f == fqn)
    node = next(n for n in program.graph.nodes if n.name == name)
    return list(node.meta["val"].shape)


def test_fsdp_padding_and_rank_classes() -> None:
    """FSDP2 pads dim 0 to ceil(d0/N) rows and torch.chunk gives the last ranks fewer: a [10, 256]
    head over 4 ranks is stored as [3, 256] on every rank, held as 3, 3, 3, 1 rows, so rank 3 is its
    own class (the other weights divide by 4)."""
    assert padded_shard_shape([10, 256], 4) == [3, 256]
    assert [local_shard_shape([10, 256], 4, r)[0] for r in range(4)] == [
        len(c) for c in torch.arange(10).chunk(4)
    ]
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_model
    from boomfx.frontend.capture import capture
    from boomfx.distributed.plan import ParallelConfig
    from boomfx.distributed.ranks import rank_programs
    from boomfx.core.program import ProgramOptions

    model, inputs, dims = make_model("mlp", "meta")
    program = capture(torch.export.export(model, inputs, dynamic_shapes=dims), options=ProgramOptions(True))
    classes = rank_programs(program, ParallelConfig(dp_shard=4))
    assert sorted(rc.ranks for rc in classes) == [(0, 1, 2), (3,)]
    # the optimizer state of out.weight: 2 x rows x 256 x 4 B per rank
    for rc in classes:
        rows = 1 if rc.ranks == (3,) else 3
        state = [
            n for n in rc.program.graph.nodes if n.op == "placeholder" and n.name == "exp_avg_p_out_weight"
        ]
        assert list(state[0].meta["val"].shape) == [rows, 256]


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.model == "llama"], ids=lambda c: c.name)
def test_collective_sizes_match_the_real_run(cfg, gloo_runs) -> None:
    """Every collective the rank program issues, in order, against what gloo ran: all-gather inputs
    (the rank's flat shard), reduce-scatter inputs (gloo runs them as an all_reduce of the whole
    [N x T] input, so that is the size it records), DDP's bucket all-reduce, HSDP's replica all-reduce."""
    from boomfx.distributed.analysis import collectives
    from boomfx.passes.evaluate import Evaluator

    _, classes = rank_classes(cfg)
    predicted_calls = []
    for c in collectives(classes[0].program, Evaluator({})):
        gloo_op = {
            "all_gather_into_tensor_out": "all_gather",
            "reduce_scatter_tensor": "all_reduce",
            "all_reduce_": "all_reduce",
        }[c.op]
        itemsize = getattr(torch, c.dtype).itemsize
        predicted_calls.append((gloo_op, c.dtype, c.input_bytes // itemsize))
    # the profiler's dtype names for gloo's tensors
    dtypes = {"float": "float32", "c10::BFloat16": "bfloat16", "c10::Half": "float16"}
    real = [(c["op"], dtypes[c["dtype"]], c["numel"][0]) for c in gloo_runs[cfg.name].ranks[0].collectives]
    # gradient accumulation: the program is one micro-batch's, the real step runs it cfg.accumulation times
    assert sorted(predicted_calls * cfg.accumulation) == sorted(real)
    first = real[: len(real) // cfg.accumulation]
    assert [op for op, *_ in predicted_calls] == [op for op, *_ in first] or cfg.parallel == "hsdp"


def _bad(capsys, *argv: str) -> str:
    code = main(list(argv))
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_parallel_input(capsys) -> None:
    tiny = str(ROOT / "examples" / "llama_tiny.pt2")  # 2 layers, 4 heads, 2 key/value heads
    base = ["analyze", tiny, "--train", "--batch", "2", "--seq", "16", "--device", "h100-sxm"]
    # 2 x 2 = 4 ranks on 1 node of 8 GPUs
    assert "= 4 ranks, but the world is 1 node(s) x 8 GPUs = 8" in _bad(
        capsys, *base, "--parallel", "dp_shard=2,tp=2", "--gpus-per-node", "8"
    )
    assert "is not one of" in _bad(capsys, *base, "--parallel", "fsdp=2")
    assert "needs --train" in _bad(
        capsys, "analyze", tiny, "--batch", "2", "--seq", "16", "--parallel", "dp_shard=2"
    )
    # tp=4 divides the 4 heads but not the 2 key/value heads
    assert "tp=4 does not divide the model's 2 key/value heads" in _bad(capsys, *base, "--parallel", "tp=4")
    assert "tp=3 does not divide the model's 4 attention heads" in _bad(capsys, *base, "--parallel", "tp=3")
    assert "pp=4 stages but the model has 2 layers" in _bad(capsys, *base, "--parallel", "pp=4")
    assert "--rank 5" in _bad(capsys, *base, "--parallel", "dp_shard=2", "--rank", "5")


def test_parallel_report_and_max_batch(capsys) -> None:
    """The worst rank's report carries every class; the global batch is batch x data-parallel degree;
    per-rank memory shrinks with the shard degree by exactly the sharded resident bytes."""
    import boomfx

    tiny = str(ROOT / "examples" / "llama_tiny.pt2")
    one = boomfx.analyze(tiny, train=True, device="h100-sxm", batch=2, seq=16)
    four = boomfx.analyze(tiny, train=True, device="h100-sxm", batch=2, seq=16, parallel="dp_shard=4")
    par = four.parallel
    assert par["world"] == 4 and par["global_batch"] == 8 and par["batch_per_rank"] == 2
    assert [c["ranks"] for c in par["classes"]] == [[0, 1, 2, 3]]
    # FSDP2 stores each parameter as ceil(d0 / 4) rows: the sum over llama_tiny's fp32 weights
    from boomfx.frontend.capture import capture
    from boomfx.core.program import ProgramOptions

    program = capture(tiny, options=ProgramOptions(False))
    shapes = [
        list(n.meta["val"].shape)
        for n in program.graph.nodes
        if n.op == "placeholder" and program.input_roles.get(n.name) == "param"
    ]
    padded = sum(-(-s[0] // 4) * math.prod(s[1:]) * 4 for s in shapes)
    full = sum(math.prod(s) * 4 for s in shapes)
    # the same unsharded remainder on both (the optimizer's 0-d constant, a get_attr: 4 B)
    extra = one.memory.by_category_bytes["parameter"] - full
    assert 0 <= extra <= 4
    assert four.memory.by_category_bytes["parameter"] == padded + extra
    assert par["classes"][0]["peak_live_bytes"] == four.memory.peak_live_bytes


def test_mixed_precision_casts_a_tensor_once_per_module() -> None:
    """FSDP casts a unit's floating inputs once, at its pre-forward, and every op of the unit reads that
    copy: in the bf16-parameter trace each fp32 tensor is cast at most once per module. Llama's rotary
    tables (fp32 buffers, read by q * cos, rotate(q) * sin, k * cos, rotate(k) * sin) get one bf16 copy
    each per layer, not one per product (which held twice the copies to the layer's backward)."""
    from collections import Counter

    from boomfx.core.layers import module_path
    from boomfx.core.program import PHASE_FORWARD, ProgramOptions
    from boomfx.distributed.mixed_precision import MixedPrecision, compute_program
    from boomfx.frontend.capture import capture

    program = capture(str(ROOT / "examples" / "llama_tiny.pt2"), options=ProgramOptions(True))
    bf16 = compute_program(program, MixedPrecision(torch.float32, torch.bfloat16, torch.float32))
    casts = [n for n in bf16.graph.nodes
             if n.target is torch.ops.aten._to_copy.default and bf16.phase_of(n) == PHASE_FORWARD
             and n.meta["val"].dtype == torch.bfloat16 and n.args[0].meta["val"].dtype == torch.float32]
    per_module = Counter((n.args[0].name, module_path(n)) for n in casts)
    assert per_module and max(per_module.values()) == 1
    # the rotary tables: cos and sin, each cast once in each of the 2 layers
    trig = {n.name for n in bf16.graph.nodes if n.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default)}
    tables = Counter(src for src, _ in per_module if src in trig)
    assert sorted(tables.values()) == [2, 2]
