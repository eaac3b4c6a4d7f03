"""Tensor parallelism (and TP x FSDP) per-rank programs against real gloo runs of DTensor TP.

The truth is ``benchmarks/distributed_truth.py``: ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` on each layer (Llama: q/k/v/gate/up colwise, o/down rowwise; GPT: fc colwise,
fc_out rowwise; its fused qkv stays replicated), then for TP x FSDP ``fully_shard`` of each layer
and the root over the data-parallel mesh dimension, AdamW steps on 2 (TP) or 4 (2 x 2) processes.
Each rank records its profiler peak above the step's start, its parameter and AdamW storages, its
local parameter shapes and every collective gloo ran. One spawn per world size (session-scoped).

The prediction is boomfx's per-rank program (boomfx/distributed/tensor_parallel.py), each compute
kernel's scratch measured on this CPU (benchmarks/distributed_predict.py).

GPT under TP x FSDP peaks while gloo's all-gather holds its output-sized temporary (the backward
prefetch of layer 0): without modelling it (``ShardSpec.all_gather_scratch``) the prediction was
-2.45%.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import distributed_predict as predict  # noqa: E402
import distributed_truth as truth  # noqa: E402
from gloo_checks import TP_TWO_RANKS, assert_peaks_match, rank_classes  # noqa: E402

from boomfx.cli.main import main  # noqa: E402
from boomfx.core.errors import OptionError  # noqa: E402
from boomfx.core.program import ProgramOptions  # noqa: E402
from boomfx.distributed.plan import ParallelConfig  # noqa: E402
from boomfx.distributed.ranks import rank_programs  # noqa: E402
from boomfx.frontend.capture import capture, resolve_bindings  # noqa: E402

TWO_RANKS = TP_TWO_RANKS
FOUR_RANKS = [truth.TruthConfig(model, "tp_fsdp", 4, timed_steps=0) for model in ("llama", "gpt")]
CONFIGS = TWO_RANKS + FOUR_RANKS
TINY = str(ROOT / "examples" / "llama_tiny.pt2")  # 2 layers, d 64, 4 heads, 2 key/value heads


@pytest.fixture(scope="session")
def tp_gloo_runs(two_rank_gloo_runs, four_rank_gloo_runs) -> dict[str, truth.ConfigTruth]:
    runs = {c.name: two_rank_gloo_runs[c.name] for c in TWO_RANKS}   # the shared 2-rank spawn
    runs.update({c.name: four_rank_gloo_runs[c.name] for c in FOUR_RANKS})  # the shared 4-rank spawn
    return runs


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_rank_peak_matches_gloo(cfg, tp_gloo_runs, tmp_path_factory) -> None:
    real = tp_gloo_runs[cfg.name]
    db = tmp_path_factory.getbasetemp() / "tp_cpu.db"  # one kernel database for the session
    pred = predict.predicted_rank_peaks(cfg, db=str(db), classes=rank_classes(cfg)[1])
    assert_peaks_match(cfg, pred, real)


def _placeholders(program, role: str) -> dict[str, torch.Tensor]:
    return {
        n.name: n.meta["val"]
        for n in program.graph.nodes
        if n.op == "placeholder" and program.input_roles.get(n.name) == role
    }


def _nbytes(vals) -> int:
    return sum(v.numel() * v.element_size() for v in vals)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_tp_local_parameters_and_adamw_state(cfg, tp_gloo_runs) -> None:
    """Every local parameter shape equals the real rank's; the planned weights are split (colwise:
    rows / 2, rowwise: columns / 2), all others whole (before FSDP); parameter and AdamW storages
    equal the real rank's start-of-step bytes."""
    program, (rc,) = rank_classes(cfg)
    real = tp_gloo_runs[cfg.name].ranks[0]
    local = {rc.program.param_names[n]: list(v.shape) for n, v in _placeholders(rc.program, "param").items()}
    full = {program.param_names[n]: list(v.shape) for n, v in _placeholders(program, "param").items()}
    assert local == {fqn: p["shape"] for fqn, p in real.local_params.items()}
    if cfg.parallel == "tp":
        styles = {f"{layer}.{m}.weight": s for layer in _layers(full) for m, s in truth.TP_PLANS[cfg.model].items()}
        styles.update({k[: -len("weight")] + "bias": s for k, s in styles.items()})
        for fqn, shape in full.items():
            expect = list(shape)
            style = styles.get(fqn)
            if style == "colwise":
                expect[0] //= 2
            elif style == "rowwise" and len(shape) == 2:
                expect[1] //= 2
            assert local[fqn] == expect, fqn
    if cfg.parallel in ("tp_vocab", "tp_sp"):  # vocabulary rows split: [256, 64] -> [128, 64] on each of 2 ranks
        assert local["embed.weight"] == local["lm_head.weight"] == [truth.VOCAB // 2, 64]
    params = _nbytes(_placeholders(rc.program, "param").values())
    assert params == real.start_param_bytes
    # AdamW: exp_avg + exp_avg_sq of each local parameter, plus one fp32 step scalar per parameter
    state = _nbytes(_placeholders(rc.program, "opt_state").values())
    assert state == real.start_optimizer_bytes == 2 * params + 4 * len(local)


@pytest.mark.parametrize("cfg", TWO_RANKS, ids=[c.name for c in TWO_RANKS])
def test_tp_gradient_shapes_are_the_real_ones(cfg, tp_gloo_runs) -> None:
    """Every gradient the program hands AdamW has the shape of the real rank's ``.grad``: its weight's
    local shape, except a vocabulary-parallel embedding's, which DTensor computes and keeps whole
    ([256, 64] on each rank for a [128, 64] weight)."""
    _, (rc,) = rank_classes(cfg)
    real = tp_gloo_runs[cfg.name].ranks[0].local_params
    by_name = {n.name: n for n in rc.program.graph.nodes}
    predicted = {fqn: list(by_name[name].meta["val"].shape) for name, fqn in rc.program.grad_nodes.items()}
    assert predicted == {fqn: p["grad_shape"] for fqn, p in real.items()}
    vocab_parallel = cfg.parallel in ("tp_vocab", "tp_sp")
    embed = "embed.weight" if "embed.weight" in real else "wte.weight"
    assert predicted[embed] == [truth.VOCAB, 64]
    assert real[embed]["shape"] == [truth.VOCAB // 2 if vocab_parallel else truth.VOCAB, 64]


def _layers(full: dict) -> set[str]:
    return {".".join(fqn.split(".")[:2]) for fqn in full if fqn.split(".")[1:2] and fqn.split(".")[1].isdigit()}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_collective_sizes_match_the_real_run(cfg, tp_gloo_runs) -> None:
    """The rank program's collectives in order against gloo's: TP all-reduces of [batch, seq, d]
    (rowwise outputs forward, colwise input gradients backward), FSDP's all-gathers of the flat
    shard and reduce-scatters (which gloo runs as an all_reduce of the whole [N x T] input)."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.distributed.analysis import collectives

    program, (rc,) = rank_classes(cfg)
    spec = cpu_spec()
    ev = Analysis(rc.program, spec, AnalyzeOptions(spec.name, db="none")).evaluator(
        resolve_bindings(program, {}, cfg.batch, cfg.seq)
    )
    gloo_name = {
        "all_gather_into_tensor_out": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "all_reduce",
        "all_reduce": "all_reduce",
    }
    predicted = [(gloo_name[c.op], c.input_bytes // 4) for c in collectives(rc.program, ev)]
    real = [(c["op"], c["numel"][0]) for c in tp_gloo_runs[cfg.name].ranks[0].collectives]
    tp_calls = [c for c in collectives(rc.program, ev) if c.group == "tp"]
    if cfg.parallel == "tp_sp":
        _check_sequence_parallel_collectives(cfg, predicted, real, tp_calls)
        return
    assert predicted == real
    # per layer: one forward per rowwise linear (llama: o, down; gpt: fc_out), one backward per
    # colwise linear (llama: q, k, v, gate, up; gpt: fc)
    styles = list(truth.TP_PLANS[cfg.model].values())
    layers = truth.MODEL_DIMS[cfg.model]["layers"]
    reduces = [c for c in tp_calls if c.op == "all_reduce"]
    # the vocabulary-parallel ends: the embedding's partial output all-reduced forward, the head's
    # input gradient backward (colwise), its [batch, seq, vocab / 2] logits all-gathered forward;
    # with loss parallel not gathered, and the loss's max, sum(exp) and picked log-probabilities
    # all-reduced instead ([batch x seq, 1] each)
    ends = 1 if cfg.parallel == "tp_vocab" else 0
    loss = 3 if cfg.loss_parallel else 0
    assert [c.phase for c in reduces].count("forward") == styles.count("rowwise") * layers + ends + loss
    assert [c.phase for c in reduces].count("backward") == styles.count("colwise") * layers + ends
    tokens = cfg.batch * cfg.seq
    assert [c.input_bytes for c in reduces if c.input_bytes != tokens * 64 * 4] == [tokens * 4] * loss
    gathers = [(c.phase, c.input_bytes) for c in tp_calls if c.op != "all_reduce"]
    assert gathers == ([("forward", tokens * (truth.VOCAB // 2) * 4)] if ends and not loss else [])


def _check_sequence_parallel_collectives(cfg, predicted, real, tp_calls) -> None:
    """Sequence parallelism: per layer, forward all-gathers of each norm's [batch, seq / 2, d] output
    and reduce-scatters of the o/down outputs (gloo runs each as an all_reduce of the whole
    [batch, seq, d]); backward the mirror image; the embedding reduce-scatters, the final norm's
    output and the logits are gathered. Not modelled: DTensor leaves the norm weights' gradients
    Partial and AdamW's foreach ops all-reduce them on each of their 3 reads (lerp, addcmul x 2),
    after backward: 3 x 5 norm weights all_reduces of [d] = 64, listed apart here."""
    d, layers, norms = 64, truth.MODEL_DIMS[cfg.model]["layers"], 2 * truth.MODEL_DIMS[cfg.model]["layers"] + 1
    unmodelled = [("all_reduce", d)] * (3 * norms)
    assert real[-len(unmodelled):] == unmodelled
    assert predicted == real[: -len(unmodelled)]
    full, local = cfg.batch * cfg.seq * d * 4, cfg.batch * cfg.seq // 2 * d * 4
    logits = cfg.batch * cfg.seq * (truth.VOCAB // 2) * 4
    by_kind = {}
    for c in tp_calls:
        by_kind.setdefault((c.op, c.phase), []).append(c.input_bytes)
    assert by_kind[("reduce_scatter_tensor", "forward")] == [full] * (1 + 2 * layers)  # embed, o, down
    assert by_kind[("all_gather_into_tensor", "forward")] == [local] * (2 * layers + 1) + ([] if cfg.loss_parallel else [logits])
    # loss parallel: the max, sum(exp) and picked log-probabilities of [batch x seq, 1] all-reduced
    assert by_kind.get(("all_reduce", "forward"), []) == [cfg.batch * cfg.seq * 4] * (3 if cfg.loss_parallel else 0)
    assert by_kind[("reduce_scatter_tensor", "backward")] == [full] * (1 + 2 * layers)
    assert by_kind[("all_gather_into_tensor", "backward")] == [local] * (2 * layers + 1)


class _HardCodedHeads(torch.nn.Module):
    """Attention whose views hard-code the head count (as GPT-2 and many models do): the rewrite
    must give each rank heads / tp of them."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class _Stack(torch.nn.Module):
    def __init__(self, block: type) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([block(), block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)


def _export(module: torch.nn.Module) -> torch.export.ExportedProgram:
    from torch.export import Dim

    x = torch.randn(2, 8, 32)
    return torch.export.export(module, (x,), dynamic_shapes={"x": {0: Dim("batch"), 1: Dim("seq")}})


def test_hard_coded_head_count_is_split() -> None:
    """view(b, t, 4, 8) becomes view(b, t, 2, 8) on each of 2 ranks: attention runs 2 heads, the
    colwise biases hold 16 of 32 entries, the rowwise bias all 32."""
    program = capture(_export(_Stack(_HardCodedHeads)), options=ProgramOptions(True, target_kind="cpu"))
    (rc,) = rank_programs(program, ParallelConfig(tp=2))
    shapes = {rc.program.param_names[n]: list(v.shape) for n, v in _placeholders(rc.program, "param").items()}
    assert shapes["layers.0.q.weight"] == [16, 32] and shapes["layers.0.q.bias"] == [16]
    assert shapes["layers.0.o.weight"] == [32, 16] and shapes["layers.0.o.bias"] == [32]
    sdpa = [n for n in rc.program.graph.nodes if "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)]
    assert sdpa and all(n.args[0].meta["val"].shape[1] == 2 for n in sdpa)


class _SplitReadByCumsum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.cumsum(self.up(x), dim=-1))


def test_an_op_without_a_split_rule_is_refused() -> None:
    program = capture(_export(_Stack(_SplitReadByCumsum)), options=ProgramOptions(True, target_kind="cpu"))
    cfg = ParallelConfig(tp=2, tp_plan=(("layers.0.up", "colwise"), ("layers.0.down", "rowwise")))
    with pytest.raises(OptionError, match=r"cannot split cumsum .*aten\.cumsum\.default.*no tensor-parallel rule"):
        rank_programs(program, cfg)


def test_a_split_sp_cannot_follow_says_what_to_do_instead() -> None:
    """The repository's GPT adds its learned position embedding (replicated over the sequence) to the
    sequence-split token embedding: sp is refused in one line that names tp alone as the way out."""
    program = capture(str(ROOT / "examples" / "gpt_tiny.pt2"), options=ProgramOptions(True, target_kind="cpu"))
    with pytest.raises(OptionError, match=r"a replicated operand .* spans the split dimension; try tp without sp "
                                          r"instead") as err:
        rank_programs(program, ParallelConfig.parse("tp=2,sp", vocab_parallel=True))
    assert "\n" not in str(err.value)
    assert rank_programs(program, ParallelConfig.parse("tp=2", vocab_parallel=True))   # tp alone splits it


def _bad(capsys, *argv: str) -> str:
    code = main(list(argv))
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_tensor_parallel_input(capsys) -> None:
    """(tp not dividing heads / key-value heads: tests/test_distributed_memory.py.) What the TP
    rewrite cannot do yet is one line, exit 2 through the CLI, an OptionError through the API."""
    base = ["analyze", TINY, "--train", "--batch", "2", "--seq", "16", "--device", "h100-sxm"]
    assert "a colwise (embedding-dimension) split of a token embedding is not built" in _bad(
        capsys, *base, "--parallel", "tp=2", "--tp-plan", "embed=colwise"
    )
    assert "--tp-plan torchtitan needs tp > 1" in _bad(capsys, *base, "--parallel", "dp_shard=2", "--tp-plan", "torchtitan")
    program, _ = rank_classes(TWO_RANKS[0])
    with pytest.raises(OptionError, match="sequence parallelism is built with torchtitan's plan"):
        rank_programs(program, ParallelConfig(tp=2, sp=True))
    with pytest.raises(OptionError, match="no linear of the model matches"):
        rank_programs(program, ParallelConfig(tp=2, tp_plan=(("nothing.*", "colwise"),)))


def test_tp_report_times_its_collectives_on_the_critical_path() -> None:
    """The stream schedule of a TP rank: each all-reduce's consumer waits for it (no compute to hide
    it behind in this chain), so almost all TP communication is exposed; the report lists all 14."""
    import boomfx

    report = boomfx.analyze(TINY, train=True, device="h100-sxm", batch=2, seq=16, parallel="tp=2")
    par = report.parallel
    (cls,) = par["classes"]
    assert cls["ranks"] == [0, 1] and par["global_batch"] == 2
    tp = [c for c in cls["collectives"] if c["group"] == "tp"]
    assert len(tp) == 14 and {c["input_bytes"] for c in tp} == {2 * 16 * 64 * 4}
    timing = par["time_by_class"][0]
    assert timing["exposed_comm_ns"] > 0.9 * (timing["exposed_comm_ns"] + timing["hidden_comm_ns"])


def test_torchtitan_preset_adds_the_vocabulary_parallel_ends() -> None:
    """``tp_plan="torchtitan"``: the derived layer plan plus embed rowwise and lm_head colwise; the
    tiny Llama (vocab 512, d 64) then issues 14 + 3 TP collectives with a mean loss (the embedding's
    forward all-reduce, the head's input-gradient all-reduce, the logits' all-gather of each rank's
    [2, 16, 512 / 2] fp32 = 32,768 B); with the default cross-entropy loss parallel replaces the
    all-gather by three [32, 1] all-reduces: 14 + 2 + 3."""
    import boomfx

    for loss, count, gathered in (("mean", 17, [2 * 16 * 256 * 4]), ("auto", 19, [])):
        report = boomfx.analyze(TINY, train=True, device="h100-sxm", batch=2, seq=16, loss=loss,
                                parallel={"tp": 2, "tp_plan": "torchtitan"})
        (cls,) = report.parallel["classes"]
        tp = [c for c in cls["collectives"] if c["group"] == "tp"]
        assert len(tp) == count
        assert [c["input_bytes"] for c in tp if c["op"].startswith("all_gather")] == gathered
        assert [c["input_bytes"] for c in tp].count(2 * 16 * 4) == (3 if loss == "auto" else 0)


def test_view_groups_follow_the_split() -> None:
    """A view maps runs of dims with equal size products; the split dim must lead its run (then the
    run's first non-unit output dim carries it), else each rank's slice is not one block."""
    import sympy

    from boomfx.distributed.tensor_parallel import _group

    b, t = sympy.symbols("b t", positive=True, integer=True)
    i = sympy.Integer
    # [b, t, 64] -> [b, t, 4, 16]: the 64 (heads x head_dim) becomes heads
    assert _group([b, t, i(64)], [b, t, i(4), i(16)], 2) == ([2], [2, 3])
    # [b, t, 4, 16] -> [b, t, 64]: heads lead the merged run
    assert _group([b, t, i(4), i(16)], [b, t, i(64)], 2) == ([2, 3], [2])
    # splitting head_dim, or merging the batch into the split dim, cannot stay one block per rank
    assert _group([b, t, i(4), i(16)], [b, t, i(64)], 3)[0] is None
    assert _group([b, i(8), t], [b * i(8), t], 1)[0] is None
    # [b * t, 64] -> [b, t, 64]: the last dim is its own run
    assert _group([b * t, i(64)], [b, t, i(64)], 1) == ([1], [2])


@pytest.mark.slow  # export of a transformers model
def test_gpt2_conv1d_mlp_is_split_on_its_in_out_dimensions() -> None:
    """transformers' GPT-2 keeps Conv1D weights as [in, out] (``addmm(bias, x, weight)``): the
    derived plan splits ``mlp.c_fc`` colwise on dim 1 (and its bias) and ``mlp.c_proj`` rowwise on
    dim 0 (its bias whole); the fused ``attn.c_attn`` ([64, 3 x 64]) is packed colwise (each rank 1/2
    of q, k and v: 96 columns, and of its bias) and the attention's ``c_proj`` rowwise. Per layer: two
    forward all-reduces (each c_proj's partial output) and two backward all-reduces (the input
    gradients of c_attn and c_fc), each [batch, seq, 64] fp32."""
    transformers = pytest.importorskip("transformers")
    from torch.export import Dim

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=idx, use_cache=False).logits

    idx = torch.randint(0, 256, (2, 16))
    ep = torch.export.export(Logits(), (idx,), dynamic_shapes={"idx": {0: Dim("batch"), 1: Dim("seq", max=64)}})
    program = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu"))
    (rc,) = rank_programs(program, ParallelConfig(tp=2))
    local = {rc.program.param_names[n]: list(v.shape) for n, v in _placeholders(rc.program, "param").items()}
    full = {program.param_names[n]: list(v.shape) for n, v in _placeholders(program, "param").items()}
    for layer in ("m.transformer.h.0", "m.transformer.h.1"):
        assert local[f"{layer}.mlp.c_fc.weight"] == [64, 128] and local[f"{layer}.mlp.c_fc.bias"] == [128]
        assert local[f"{layer}.mlp.c_proj.weight"] == [128, 64] and local[f"{layer}.mlp.c_proj.bias"] == [64]
        assert local[f"{layer}.attn.c_attn.weight"] == [64, 96] and local[f"{layer}.attn.c_attn.bias"] == [96]
        assert local[f"{layer}.attn.c_proj.weight"] == [32, 64] and local[f"{layer}.attn.c_proj.bias"] == [64]
    split = {f"m.transformer.h.{i}.{m}" for i in (0, 1) for m in ("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
                                                                 "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight")}
    assert {k: v for k, v in local.items() if k not in split} == {k: v for k, v in full.items() if k not in split}
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.distributed.analysis import collectives

    spec = cpu_spec()
    ev = Analysis(rc.program, spec, AnalyzeOptions(spec.name, db="none")).evaluator(
        resolve_bindings(program, {}, 2, 16)
    )
    calls = [(c.op, c.phase, c.input_bytes) for c in collectives(rc.program, ev)]
    assert calls == [("all_reduce", "forward", 2 * 16 * 64 * 4)] * 4 + [("all_reduce", "backward", 2 * 16 * 64 * 4)] * 4


def test_sequence_parallel_splits_the_residual_stream() -> None:
    """Under ``sp`` the residual stream between blocks holds seq / 2 positions per rank: every
    forward residual add of the tiny Llama (2 layers x 2, [2, 16, 64] without sp) is [2, 8, 64],
    and every reduce-scatter's output too; the logits are gathered back to [2, 16, 512] (a mean loss:
    no loss parallel)."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import PHASE_FORWARD

    program = capture(TINY, options=ProgramOptions(True, target_kind="cpu", loss="mean"))
    (rc,) = rank_programs(program, ParallelConfig(tp=2, sp=True, vocab_parallel=True))
    spec = cpu_spec()
    ev = Analysis(rc.program, spec, AnalyzeOptions(spec.name, db="none")).evaluator(
        resolve_bindings(program, {}, 2, 16)
    )

    def shape(n):
        return [int(ev(s.node.expr if isinstance(s, torch.SymInt) else s)) for s in n.meta["val"].shape]

    fwd = [n for n in rc.program.graph.nodes if n.op == "call_function" and rc.program.phases.get(n.name) == PHASE_FORWARD]
    residual = [shape(n) for n in fwd if n.target is torch.ops.aten.add.Tensor and len(n.meta["val"].shape) == 3
                and all(isinstance(a, torch.fx.Node) and len(a.meta["val"].shape) == 3 for a in n.args)]
    assert len(residual) >= 4 and all(s == [2, 8, 64] for s in residual), residual
    scattered = [shape(n) for n in fwd if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert scattered == [[2, 8, 64]] * 5  # the embedding, then o and down of each layer
    assert shape(next(n for n in reversed(fwd) if n.target is torch.ops.aten.cat.default)) == [2, 16, 512]


LOSS_PAIR = (TWO_RANKS[-3], TWO_RANKS[-2])  # cross-entropy on gathered logits, then with loss parallel


def test_loss_parallel_saves_what_the_real_run_saves(tp_gloo_runs, tmp_path_factory) -> None:
    """Loss parallel keeps [tokens, vocab / 2] logits and log-probabilities instead of the gathered
    [tokens, vocab] ones: the predicted saving equals the real runs' within 5%."""
    db = str(tmp_path_factory.getbasetemp() / "tp_cpu.db")
    gathered, split = (predict.predicted_rank_peaks(c, db=db, classes=rank_classes(c)[1])[0] for c in LOSS_PAIR)
    real_gathered, real_split = (tp_gloo_runs[c.name].ranks[0].peak_bytes for c in LOSS_PAIR)
    saved, real_saved = gathered - split, real_gathered - real_split
    tokens = LOSS_PAIR[0].batch * LOSS_PAIR[0].seq
    assert real_saved >= tokens * truth.VOCAB * 4 // 2   # at least one fp32 [tokens, vocab / 2] tensor
    assert abs(saved - real_saved) <= 0.05 * real_saved, (saved, real_saved)


def test_loss_parallel_is_torchtitans_default_with_its_plan() -> None:
    """``--tp-plan torchtitan`` with a cross-entropy loss: the logits are not gathered and the loss's
    max is all-reduced; with a mean loss (or ``loss_parallel=False``) the logits are gathered."""
    import dataclasses

    def reduce_ops(program) -> list[str]:
        return [n.args[1] for n in program.graph.nodes if n.op == "call_function" and "all_reduce" in str(n.target)]

    def gathers(program) -> int:
        return sum("all_gather" in str(n.target) for n in program.graph.nodes if n.op == "call_function")

    ce = LOSS_PAIR[0]
    program, _ = rank_classes(ce)
    (default,) = rank_programs(program, ParallelConfig(tp=2, vocab_parallel=True, backend="gloo"))
    assert "max" in reduce_ops(default.program) and gathers(default.program) == 0
    (off,) = rank_programs(program, ParallelConfig(tp=2, vocab_parallel=True, loss_parallel=False, backend="gloo"))
    assert "max" not in reduce_ops(off.program) and gathers(off.program) == 1
    mean, _ = rank_classes(dataclasses.replace(ce, loss="mean"))
    (plain,) = rank_programs(mean, ParallelConfig(tp=2, vocab_parallel=True, backend="gloo"))
    assert "max" not in reduce_ops(plain.program) and gathers(plain.program) == 1
    with pytest.raises(OptionError, match="--loss-parallel true needs a cross-entropy loss"):
        rank_programs(mean, ParallelConfig(tp=2, vocab_parallel=True, loss_parallel=True))


def test_bad_loss_parallel_input(capsys) -> None:
    base = ["analyze", TINY, "--train", "--batch", "2", "--seq", "16", "--device", "h100-sxm"]
    assert "--loss-parallel true needs a vocabulary-parallel head (--tp-plan torchtitan)" in _bad(
        capsys, *base, "--parallel", "tp=2", "--loss-parallel", "true")
    assert "--loss-parallel true needs a cross-entropy loss" in _bad(
        capsys, *base, "--parallel", "tp=2", "--tp-plan", "torchtitan", "--loss-parallel", "true", "--loss", "mean")
