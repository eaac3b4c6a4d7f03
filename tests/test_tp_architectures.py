"""The derived tensor-parallel plan across transformers architectures, checked by running the ranks.

For each architecture (tiny config, real weights, exported as users export), the plan derived from module names
is applied by ``tensor_parallel.shard_export`` and each of 2 ranks runs its graph on its slices of the weights,
one thread per rank with the collectives done across the threads (``tests/tp_lockstep.py``): every rank's logits
must equal the unsharded export's. Architectures whose split the walk cannot follow are refused in one line
naming the op (OLMo-2 normalises q over all heads: vLLM all-reduces that norm; not modelled).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.tensor_parallel import module_plan, shard_export
from boomfx.frontend.capture import capture
from layer_stack import export_stack
from tp_lockstep import plain_layout, run_ranks

V, D, H = 256, 64, 4
_DECODER = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=H,
                max_position_embeddings=128, use_cache=False)


def _config(T: Any, name: str) -> tuple[Any, Any]:
    """(model class, config) of a tiny model of architecture ``name``."""
    if name == "qwen2":
        return T.Qwen2ForCausalLM, T.Qwen2Config(**_DECODER, num_key_value_heads=2)
    if name == "gemma2":   # logit soft-capping, alternating sliding-window layers
        return T.Gemma2ForCausalLM, T.Gemma2Config(**_DECODER, num_key_value_heads=2, head_dim=16)
    if name == "olmo2":
        return T.Olmo2ForCausalLM, T.Olmo2Config(**_DECODER, num_key_value_heads=2)
    if name == "opt":
        return T.OPTForCausalLM, T.OPTConfig(vocab_size=V, hidden_size=D, ffn_dim=128, num_hidden_layers=2,
                                              num_attention_heads=H, max_position_embeddings=128,
                                              word_embed_proj_dim=D, use_cache=False)
    if name == "gptj":     # rotary by stack + flatten; fc_in / fc_out
        return T.GPTJForCausalLM, T.GPTJConfig(vocab_size=V, n_embd=D, n_layer=2, n_head=H, n_positions=128,
                                                rotary_dim=8, use_cache=False)
    if name == "starcoder2":
        return T.Starcoder2ForCausalLM, T.Starcoder2Config(**_DECODER, num_key_value_heads=2)
    if name == "falcon":   # FalconLinear: x @ weight.T (no nn.Linear); q heads grouped with their k/v head
        return T.FalconForCausalLM, T.FalconConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=H,
                                                  new_decoder_architecture=True, num_kv_heads=2, use_cache=False)
    if name == "bert":     # three projections named dense
        return T.BertForMaskedLM, T.BertConfig(vocab_size=V, hidden_size=D, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=H)
    raise KeyError(name)


def _export(name: str) -> tuple[torch.export.ExportedProgram, torch.Tensor]:
    T = pytest.importorskip("transformers")
    from torch.export import Dim

    cls, cfg = _config(T, name)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    ids = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(1))
    dims = {"input_ids": {0: Dim("batch", max=64), 1: Dim("seq", min=2, max=64)}}
    return torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes=dims, strict=False), ids


@pytest.mark.slow  # exports of transformers models
# projections split per layer: q, k, v, o and the MLP's (gate, up, down, or in, out)
@pytest.mark.parametrize("name,per_layer", [("qwen2", 7), ("gemma2", 7), ("opt", 6), ("gptj", 6), ("starcoder2", 6),
                                            ("bert", 6), ("falcon", 4)])
def test_every_rank_reproduces_the_model(name: str, per_layer: int) -> None:
    ep, ids = _export(name)
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    plan = module_plan(program, ParallelConfig(tp=2))
    split = {fqn for fqn in plan if fqn.endswith(".weight")}
    assert len(split) == 2 * per_layer                        # 2 layers
    assert sum(plan[f] == "rowwise" for f in split) == 2 * 2  # o and the MLP's output
    with torch.no_grad():
        want = ep.module()(input_ids=ids).logits
    for out in run_ranks(shard_export(ep, plan, 2), ep, 2, plain_layout(plan), [ids]):
        torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_norm_over_all_heads_is_refused_in_one_line() -> None:
    ep, _ = _export("olmo2")
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    with pytest.raises(OptionError, match=r"cannot split mean \(aten\.mean\.dim in model\.layers\.0\.self_attn\.q_norm\): "
                                          r"a reduction over the split dimension") as err:
        shard_export(ep, module_plan(program, ParallelConfig(tp=2)), 2)
    assert "\n" not in str(err.value)


class _TransposedLinear(torch.nn.Module):
    """A linear written as Falcon's ``FalconLinear`` is: ``x @ self.weight.T + self.bias``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class _TransposedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = _TransposedLinear(D, 2 * D), _TransposedLinear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_a_linear_written_as_a_matmul_by_the_transposed_weight_splits_like_a_linear() -> None:
    """``x @ w.T`` of a planned weight is rewritten as ``linear(x, w)``: up colwise (its bias split with it), down
    rowwise with its bias added once after the all-reduce; the ranks reproduce the model."""
    ep = export_stack(_TransposedMLP, D)
    program = capture(ep, options=ProgramOptions(True, target_kind="cpu"))
    plan = module_plan(program, ParallelConfig(tp=2))
    assert {k: v for k, v in plan.items() if k.startswith("layers.0.")} == {
        "layers.0.up.weight": "colwise", "layers.0.up.bias": "colwise", "layers.0.down.weight": "rowwise",
        "layers.0.down.bias": "rowwise"}
    sharded = shard_export(ep, plan, 2)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ep.module()(x)
    for out in run_ranks(sharded, ep, 2, plain_layout(plan), [x]):
        torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
