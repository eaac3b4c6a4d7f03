"""Fused projections under tensor parallelism: ``colwise_packed`` (boomfx/distributed/tensor_parallel.py).

Phi-3's ``qkv_proj`` and ``gate_up_proj`` and GPT-2's ``c_attn`` stack the rows of several projections
in one weight, and the model slices the output apart (``qkv[..., :q]``, ``chunk(2)``,
``split(d, dim=2)``, or a ``view(b, t, 3, heads, head_dim)``). A plain column split would hand rank 0
all of q and rank 1 k and v; vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` give each
rank 1/tp of every part. The derived plan now does that, and the output projection beside it is
rowwise.

Truth: each rank's graph is run on real weights, one thread per rank, with the TP collectives done
across the threads (``tests/tp_lockstep.py``); the ranks' logits must equal the unsharded export's.
The rank weights are cut from this file's own description of each layout (q|k|v widths from the
config), and a contiguous cut of the same weight must *not* reproduce the model (the check can fail).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest
import torch

from boomfx.cli.main import main
from boomfx.core.program import ROLE_PARAM, ProgramOptions
from boomfx.distributed.model_shape import tp_plan
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.distributed.tensor_parallel import module_plan, shard_export
from boomfx.frontend.capture import capture
from layer_stack import export_stack
from tp_lockstep import run_ranks

D, HEADS = 32, 4
C10D = torch.ops._c10d_functional


class _FusedAttention(torch.nn.Module):
    """q|k|v rows stacked, the parts made a dimension by a view (``view(b, t, 3, heads, head_dim)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(D, 3 * D, bias=True)
        self.o_proj = torch.nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o_proj(y.transpose(1, 2).reshape(b, t, D))


class _SummedProjection(torch.nn.Module):
    """A fused projection whose output is reduced, not split into parts: no per-part bound exists."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(D, 3 * D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.qkv_proj(x).sum(-1, keepdim=True)


def _layout(parts: dict[str, tuple[int, Sequence[int]]], plan: dict[str, str], contiguous: bool = False):
    """fqn -> (dim, part sizes) for ``run_ranks``: the packed weights by ``parts`` (leaf -> (dim, sizes)),
    colwise ones on the output features, rowwise ones on the input features, rowwise biases whole.
    ``contiguous``: cut the packed weights as a plain column split would."""
    def layout(fqn: str, value: torch.Tensor) -> Optional[tuple[int, Sequence[int]]]:
        style = plan.get(fqn)
        if style is None or (style == "rowwise" and value.dim() == 1):
            return None
        module, _, kind = fqn.rpartition(".")
        leaf = module.rpartition(".")[2]
        if style == "colwise_packed":
            dim, sizes = parts[leaf]
            dim = 0 if kind == "bias" else dim
            return (dim, [value.shape[dim]]) if contiguous else (dim, sizes)
        conv1d = fqn.startswith("transformer.") and kind == "weight"  # GPT-2's Conv1D: [in, out]
        dim = (0 if style == "colwise" else 1) ^ int(conv1d)
        return dim, [value.shape[dim]]
    return layout


def _rank_outputs(ep: Any, tp: int, parts: dict, inputs: Sequence[torch.Tensor], contiguous: bool = False) -> list:
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    plan = module_plan(program, ParallelConfig(tp=tp))
    sharded = shard_export(ep, plan, tp)
    return run_ranks(sharded, ep, tp, _layout(parts, plan, contiguous), inputs)


def _logits(out: Any) -> torch.Tensor:
    """The first output: of a rank graph's flat outputs, or of the model's (a transformers output's logits)."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (list, tuple)) else out


PHI3_PARTS = {"qkv_proj": (0, [64, 64, 64]), "gate_up_proj": (0, [128, 128])}   # q, k, v of 4 heads x 16
GPT2_PARTS = {"c_attn": (1, [64, 64, 64])}                                       # Conv1D [in, 3 x 64]


@pytest.mark.parametrize("name,parts", [("phi3", PHI3_PARTS), ("gpt2", GPT2_PARTS)])
def test_every_rank_computes_the_unsharded_models_logits(zoo, name: str, parts: dict) -> None:
    ep, _ = zoo(name, "cpu")
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _logits(ep.module()(input_ids=ids))
    for tp in (2, 4):
        outs = _rank_outputs(ep, tp, parts, [ids])
        for out in outs:
            torch.testing.assert_close(_logits(out), want, rtol=1e-5, atol=1e-5)
    # cut as one contiguous block per rank (ColwiseParallel's split), the same graph computes garbage
    wrong = _logits(_rank_outputs(ep, 2, parts, [ids], contiguous=True)[0])
    assert (wrong - want).abs().max() > 1e-2


def test_a_view_that_makes_the_parts_a_dimension_divides_the_heads() -> None:
    ep = export_stack(_FusedAttention, D)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ep.module()(x)
    parts = {"qkv_proj": (0, [D, D, D])}
    for out in _rank_outputs(ep, 2, parts, [x]):
        torch.testing.assert_close(_logits(out), want, rtol=1e-5, atol=1e-5)


def test_phi3_plan_shapes_and_collectives_by_hand(zoo) -> None:
    # zoo Phi-3: hidden 64, 4 heads (and 4 KV heads) of 16, MLP 128 (gate|up: 256 rows), 2 layers
    _, path = zoo("phi3")
    program = capture(path, options=ProgramOptions(True, target_kind="cpu"))
    layer = "model.layers.0"
    assert {k: v for k, v in tp_plan(program).items() if k.startswith(layer + ".")} == {
        f"{layer}.self_attn.qkv_proj.weight": "colwise_packed", f"{layer}.self_attn.o_proj.weight": "rowwise",
        f"{layer}.mlp.gate_up_proj.weight": "colwise_packed", f"{layer}.mlp.down_proj.weight": "rowwise"}
    (rc,) = rank_programs(program, ParallelConfig(tp=2))
    local = rc.program
    shapes = {local.param_names[n.name]: tuple(n.meta["val"].shape) for n in local.graph.nodes
              if n.op == "placeholder" and local.input_roles.get(n.name) == ROLE_PARAM}
    assert shapes[f"{layer}.self_attn.qkv_proj.weight"] == (96, 64)      # (64 + 64 + 64) / 2 rows
    assert shapes[f"{layer}.mlp.gate_up_proj.weight"] == (128, 64)       # (128 + 128) / 2
    assert shapes[f"{layer}.self_attn.o_proj.weight"] == (64, 32)
    assert shapes[f"{layer}.mlp.down_proj.weight"] == (64, 64)
    reduces = [n for n in local.graph.nodes if n.op == "call_function" and n.target is C10D.all_reduce.default]
    by_phase = {phase: [tuple(n.args[0].meta["val"].shape[-1:]) for n in reduces if local.phase_of(n) == phase]
                for phase in ("forward", "backward")}
    # forward: o and down of 2 layers; backward: the input gradients of qkv and gate_up (one each), all [.., 64]
    assert by_phase == {"forward": [(64,)] * 4, "backward": [(64,)] * 4}
    whole = sum(n.meta["val"].numel() for n in program.graph.nodes
                if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM)
    split = sum(v[0] * v[1] for k, v in shapes.items() if len(v) == 2 and ".layers." in k)
    assert split * 2 == sum(n.meta["val"].numel() for n in program.graph.nodes if n.op == "placeholder"
                            and program.input_roles.get(n.name) == ROLE_PARAM and n.meta["val"].dim() == 2
                            and ".layers." in program.param_names[n.name]) < whole


def test_phi3_trains_with_tp_from_the_cli(zoo, capsys) -> None:
    _, path = zoo("phi3")
    code = main(["analyze", path, "--train", "--parallel", "tp=2", "--batch", "2", "--dim", "seq=16"])
    out = capsys.readouterr()
    assert code == 0, out.err


def test_a_packed_output_read_whole_is_refused_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "summed.pt2"
    torch.export.save(export_stack(_SummedProjection, D), str(path))
    code = main(["analyze", str(path), "--train", "--parallel", "tp=2", "--tp-plan", "layers.*.qkv_proj=colwise_packed",
                 "--batch", "2", "--dim", "seq=8"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert "the packed output of layers.0.qkv_proj is read other than split into its parts" in err[0], err


def test_phi3_serves_with_vllms_packed_split(zoo) -> None:
    """vLLM's QKVParallelLinear / MergedColumnParallelLinear: at --tensor-parallel-size 2 the rank holds half
    of every linear and of the vocabulary ends (norms and the rotary buffers whole), and 2 of 4 heads."""
    from boomfx.core.devices import get_device
    from boomfx.serving.serve import build_report, setup

    ep, _ = zoo("phi3")
    program = capture(ep, options=ProgramOptions(target_kind="cuda"))
    h100 = get_device("h100-sxm")
    tp1, tp2 = (setup(program, h100, db="none", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=256,
                      tensor_parallel_size=tp) for tp in (1, 2))
    linears = 2 * (192 * 64 + 64 * 64 + 256 * 64 + 64 * 128)   # 2 layers: qkv, o, gate_up, down
    ends = 2 * 256 * 64                                      # embedding and head, untied
    assert tp1.plan.weights_bytes - tp2.plan.weights_bytes == (linears + ends) // 2 * 4
    site = tp2.model.uniform_site()
    assert (site.q_heads, site.kv_heads) == (2, 2)
    assert tp2.plan.kv_bytes_per_token * 2 == tp1.plan.kv_bytes_per_token
    assert not any("TP=1" in w for w in build_report(tp2, h100, [], None).warnings)


@pytest.mark.slow  # export of a transformers model
def test_gpt_neox_per_head_qkv_is_a_plain_column_split() -> None:
    """GPT-NeoX interleaves q, k and v per head (``view(b, t, heads, 3 x head_dim)`` then ``chunk(3)``): a
    contiguous block of ``query_key_value``'s rows is whole heads, so it is colwise (not packed), its
    ``dense`` rowwise, ``dense_h_to_4h`` / ``dense_4h_to_h`` colwise / rowwise; the ranks reproduce the model."""
    transformers = pytest.importorskip("transformers")
    from torch.export import Dim

    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128, use_cache=False)
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 8))
    ep = torch.export.export(model, (), {"input_ids": ids}, strict=False,
                             dynamic_shapes={"input_ids": {0: Dim("batch", max=64), 1: Dim("seq", min=2, max=64)}})
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    layer = "gpt_neox.layers.0"
    assert {k: v for k, v in tp_plan(program).items() if k.startswith(layer + ".")} == {
        f"{layer}.attention.query_key_value.weight": "colwise", f"{layer}.attention.dense.weight": "rowwise",
        f"{layer}.mlp.dense_h_to_4h.weight": "colwise", f"{layer}.mlp.dense_4h_to_h.weight": "rowwise"}
    with torch.no_grad():
        want = model(input_ids=ids).logits
    for out in _rank_outputs(ep, 2, {}, [ids]):
        torch.testing.assert_close(_logits(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # export of a transformers model
def test_a_packed_multi_query_projection_is_refused_by_its_kv_heads(tmp_path, capsys) -> None:
    """GPT-BigCode's multi-query ``c_attn`` packs q (64) | k (16) | v (16): the derived plan packs it, and the
    KV heads read off it, (96 - 4 x 16) / (2 x 16) = 1, do not divide tp=2 (vLLM replicates such KV heads;
    a split would cut the head dimension): refused in one line before any rewrite."""
    transformers = pytest.importorskip("transformers")
    from torch.export import Dim

    torch.manual_seed(0)
    cfg = transformers.GPTBigCodeConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                        use_cache=False, eos_token_id=0, bos_token_id=0)
    ep = torch.export.export(transformers.GPTBigCodeForCausalLM(cfg).eval(), (), {"input_ids": torch.randint(0, 256, (2, 8))},
                             dynamic_shapes={"input_ids": {0: Dim("batch", max=64), 1: Dim("seq", min=2, max=64)}},
                             strict=False)
    path = tmp_path / "bigcode.pt2"
    torch.export.save(ep, str(path))
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    assert tp_plan(program)["transformer.h.0.attn.c_attn.weight"] == "colwise_packed"
    code = main(["analyze", str(path), "--train", "--parallel", "tp=2", "--batch", "2", "--dim", "seq=16"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and err == ["boomfx: error: --parallel: tp=2 does not divide the model's 1 key/value heads"], err
