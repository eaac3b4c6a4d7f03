"""Tests for boomfx.training.trace: the traced training step computes what eager PyTorch computes.

Graphs are traced on fake tensors; only the equivalence checks run them on real CPU tensors
(``fused_attention=False`` keeps SDPA runnable on CPU).
"""
from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import sympy
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim, export

from models import GPT, MLP

from boomfx.training.trace import TracedProgram, build_inference_program, build_training_program

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# Small models
# ---------------------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return MLP(d_in=16, hidden=32, d_out=8)


def _gpt(layers: int = 2) -> nn.Module:
    return GPT(vocab=64, d=32, layers=layers, heads=4, max_seq=64)


# Kept local (examples/models.py's Llama differs where these tests look): attention through an explicit
# masked softmax (test_amp_bf16_policy checks _softmax stays fp32), torch's nn.RMSNorm (_fused_rms_norm),
# and rotary tables as two buffers (test_roles_adamw counts them).
class LlamaLayer(nn.Module):
    """RMSNorm, rotary embeddings, grouped-query attention with an explicit softmax, SwiGLU."""

    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1 = nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.w1 = nn.Linear(d, 2 * d, bias=False)
        self.w3 = nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2 * self.kv_heads, self.hd).transpose(1, 2).chunk(2, dim=1)
        q, k = (z * cos + _rotate_half(z) * sin for z in (q, k))
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / self.hd**0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rotate_half(z: torch.Tensor) -> torch.Tensor:
    a, b = z.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, kv_heads: int = 2, n_layers: int = 2,
                 max_t: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([LlamaLayer(d, heads, kv_heads) for _ in range(n_layers)])
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        freqs = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(max_t).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.embed(input_ids)
        cos, sin = self.cos[:t], self.sin[:t]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def _export_lm(model: nn.Module, batch: int = 2, seq: int = 8) -> torch.export.ExportedProgram:
    ids = torch.randint(0, 64, (batch, seq))
    dims = ({0: Dim("batch", max=64), 1: Dim("seq", min=2, max=64)},)
    return export(model, (ids,), dynamic_shapes=dims)


def _export_mlp(model: nn.Module) -> torch.export.ExportedProgram:
    return export(model, (torch.randn(4, 16),), dynamic_shapes={"x": {0: Dim("batch")}})


@pytest.fixture(scope="module")
def gpt() -> tuple[nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = _gpt()
    return model, _export_lm(model)


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = TinyLlama()
    return model, _export_lm(model)


# ---------------------------------------------------------------------------------------------
# Running a traced graph on real tensors
# ---------------------------------------------------------------------------------------------


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps the values of the named nodes (the gradients)."""

    def __init__(self, gm: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.kept: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.keep:
            self.kept[n.name] = out.clone()
        return out


def _adam_state_inputs(prog: TracedProgram, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Graph inputs for params / opt state, cloned from an eager model and optimizer."""
    params = dict(model.named_parameters())
    values: dict[str, Any] = {}
    by_fqn = {fqn: name for name, fqn in prog.param_names.items()}
    for fqn, p in params.items():
        name = by_fqn[fqn]
        values[name] = p.detach().clone()
        for key, st in opt.state[p].items():
            values[f"{key}_{name}"] = st.clone()
    return values


def _check_training_step(model: nn.Module, ep: torch.export.ExportedProgram, x: torch.Tensor,
                         loss_fn: Any, optimizer: str, **kwargs: Any) -> None:
    """One eager warm-up step creates optimizer state; then step 2 eager vs step 2 traced."""
    opt_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    opt_kwargs = {"lr": 1e-2, "momentum": 0.9} if optimizer == "sgd" else {"lr": 1e-2}
    prog = build_training_program(ep, optimizer=optimizer, fused_attention=False,
                                  optimizer_kwargs=opt_kwargs, **kwargs)
    eager = copy.deepcopy(model)
    opt = opt_cls(eager.parameters(), foreach=True, **opt_kwargs)
    loss_fn(eager(x)).backward()
    opt.step()
    opt.zero_grad()
    values = _adam_state_inputs(prog, eager, opt)
    buffers = dict(eager.named_buffers())
    args = []
    for name, role in prog.input_roles.items():
        if role in ("param", "opt_state"):
            args.append(values[name])
        elif role == "buffer":
            fqn = name[2:]  # export names buffers b_<fqn with _>
            args.append(next(b for k, b in buffers.items() if k.replace(".", "_") == fqn).clone())
        elif role == "input":
            args.append(x)
        else:
            raise AssertionError(f"unexpected role {role} of {name}")
    loss_fn(eager(x)).backward()
    rec = _Recorder(prog.gm, set(prog.grad_nodes))
    rec.run(*args)
    opt.step()
    for grad_node, fqn in prog.grad_nodes.items():
        torch.testing.assert_close(rec.kept[grad_node], dict(eager.named_parameters())[fqn].grad,
                                   rtol=1e-4, atol=1e-5)
    by_fqn = {fqn: name for name, fqn in prog.param_names.items()}
    for fqn, p in eager.named_parameters():
        torch.testing.assert_close(values[by_fqn[fqn]], p.detach(), rtol=1e-4, atol=1e-5)


def _mean_loss(out: torch.Tensor) -> torch.Tensor:
    return out.mean()


# ---------------------------------------------------------------------------------------------
# Equivalence with eager
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_mlp_step_matches_eager(optimizer: str) -> None:
    torch.manual_seed(0)
    model = _mlp()
    _check_training_step(model, _export_mlp(model), torch.randn(5, 16), _mean_loss, optimizer)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_gpt_step_matches_eager(gpt: Any, checkpoint: bool) -> None:
    model, ep = gpt
    ids = torch.randint(0, 64, (3, 12))
    _check_training_step(model, ep, ids, _mean_loss, "adamw", checkpoint=checkpoint, loss="mean")


def test_llama_step_matches_eager_with_cross_entropy(llama: Any) -> None:
    """loss="cross_entropy" adds a labels input; compare against eager cross-entropy."""
    model, ep = llama
    ids = torch.randint(0, 64, (2, 10))
    labels = torch.randint(0, 64, (2, 10))
    prog = build_training_program(ep, loss="cross_entropy", fused_attention=False)
    assert [n for n, r in prog.input_roles.items() if r == "label"] == ["labels"]
    eager = copy.deepcopy(model)
    F.cross_entropy(eager(ids).flatten(0, 1), labels.flatten()).backward()
    args = []
    params = dict(eager.named_parameters())
    for name, role in prog.input_roles.items():
        if role == "param":
            args.append(params[prog.param_names[name]].detach().clone())
        elif role == "buffer":
            args.append(getattr(eager, name[2:]).clone())
        elif role == "opt_state":
            base = name.split("_p_", 1)[1] if "_p_" in name else ""
            shape_of = {n: params[f].shape for n, f in prog.param_names.items()}
            zero = torch.zeros(()) if name.startswith("step_") else torch.zeros(shape_of["p_" + base])
            args.append(zero)
        elif role == "input":
            args.append(ids)
        else:
            args.append(labels)
    rec = _Recorder(prog.gm, set(prog.grad_nodes))
    rec.run(*args)
    for grad_node, fqn in prog.grad_nodes.items():
        torch.testing.assert_close(rec.kept[grad_node], params[fqn].grad, rtol=1e-4, atol=1e-5)


def test_inference_matches_eager(gpt: Any) -> None:
    model, ep = gpt
    prog = build_inference_program(ep, fused_attention=False)
    assert set(prog.phases.values()) == {"forward"}
    params = dict(model.named_parameters())
    ids = torch.randint(0, 64, (2, 9))
    args = [params[prog.param_names[n]] if r == "param" else ids for n, r in prog.input_roles.items()]
    with torch.no_grad():
        torch.testing.assert_close(prog.gm(*args)[0], model(ids))


# ---------------------------------------------------------------------------------------------
# Roles, symbols, module stacks
# ---------------------------------------------------------------------------------------------


def test_roles_adamw(llama: Any) -> None:
    model, ep = llama
    prog = build_training_program(ep, optimizer="adamw")
    n_params = len(list(model.parameters()))
    roles = Counter(prog.input_roles.values())
    # exp_avg + exp_avg_sq + step per parameter; the logits' cross-entropy adds next-token labels
    assert roles == {"param": n_params, "opt_state": 3 * n_params, "buffer": 2, "input": 1, "label": 1}
    assert sorted(prog.param_names.values()) == sorted(n for n, _ in model.named_parameters())
    assert sorted(prog.grad_nodes.values()) == sorted(prog.param_names.values())
    assert all(prog.phases[g] == "backward" for g in prog.grad_nodes)
    assert {"forward", "backward", "optimizer"} <= set(prog.phases.values())
    # the optimizer updates every parameter in place through foreach ops
    foreach_targets = {n.target for n in prog.gm.graph.nodes if prog.phases.get(n.name) == "optimizer"}
    assert aten._foreach_addcdiv_.ScalarList in foreach_targets


def test_roles_sgd_without_momentum_has_no_state() -> None:
    model = _mlp()
    prog = build_training_program(_export_mlp(model), optimizer="sgd")
    assert Counter(prog.input_roles.values()) == {"param": 6, "input": 1}


def _size_symbols(gm: fx.GraphModule) -> set[sympy.Symbol]:
    out: set[sympy.Symbol] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor):
                for s in v.shape:
                    if isinstance(s, torch.SymInt):
                        out |= s.node.expr.free_symbols
    return out


@pytest.mark.parametrize("kwargs", [{}, {"amp": "bf16"}, {"checkpoint": True}])
def test_symbols_are_the_exports(gpt: Any, kwargs: dict[str, Any]) -> None:
    ep = gpt[1]
    export_symbols = set(ep.range_constraints)
    prog = build_training_program(ep, **kwargs)
    used = _size_symbols(prog.gm)
    assert used == export_symbols  # batch and seq both appear, and nothing else
    assert prog.symbol_map == {s: s for s in export_symbols}


def test_static_export() -> None:
    model = _mlp()
    ep = export(model, (torch.randn(4, 16),))
    prog = build_training_program(ep)
    assert prog.symbol_map == {}
    assert _size_symbols(prog.gm) == set()


def test_meta_device_export() -> None:
    with torch.device("meta"):
        model = _gpt()
    prog = build_training_program(_export_lm(model.to("meta")), amp="bf16")
    assert len(prog.grad_nodes) == len(list(model.parameters()))


def test_module_stacks_on_forward_and_backward(gpt: Any) -> None:
    prog = build_training_program(gpt[1])
    nodes = [n for n in prog.gm.graph.nodes if n.op == "call_function"]
    for phase in ("forward", "backward"):
        in_phase = [n for n in nodes if prog.phases[n.name] == phase]
        with_stack = [n for n in in_phase if n.meta.get("nn_module_stack")]
        assert len(with_stack) >= 0.9 * len(in_phase), phase
    paths = {p for n in nodes for p, _ in n.meta.get("nn_module_stack", {}).values()}
    assert {"h.0", "h.1", "h.0.attn"} <= paths


# ---------------------------------------------------------------------------------------------
# AMP
# ---------------------------------------------------------------------------------------------


def _dtypes_of(prog: TracedProgram, targets: set[Any], phase: str = "forward") -> set[torch.dtype]:
    out = set()
    for node in prog.gm.graph.nodes:
        if node.target in targets and prog.phases.get(node.name) == phase:
            val = node.meta["val"]
            out.add((val[0] if isinstance(val, (list, tuple)) else val).dtype)
    return out


def test_amp_bf16_policy(llama: Any) -> None:
    prog = build_training_program(llama[1], amp="bf16")
    assert _dtypes_of(prog, {aten.mm.default, aten.bmm.default}) == {torch.bfloat16}
    assert _dtypes_of(prog, {aten._softmax.default}) == {torch.float32}
    assert _dtypes_of(prog, {aten._fused_rms_norm.default, aten.rsqrt.default, aten.mean.dim}) == {torch.float32}
    # fp32 master weights: each parameter is cast once (autocast's weight cache), in the forward
    casts = [n for n in prog.gm.graph.nodes if n.target == aten._to_copy.default
             and n.args[0].name in prog.param_names and prog.phases[n.name] == "forward"]
    matmul_weights = [n for n in prog.param_names if "norm" not in n and "embed" not in n]
    assert len(casts) == len(matmul_weights)
    # optimizer works on fp32 parameters and state
    assert all(prog.gm.graph.find_nodes(op="placeholder", target=p)[0].meta["val"].dtype == torch.float32
               for p in prog.param_names)


def test_amp_gpt_uses_bf16_flash_attention_and_fp32_layer_norm(gpt: Any) -> None:
    prog = build_inference_program(gpt[1], amp="bf16")
    assert _dtypes_of(prog, {aten._scaled_dot_product_flash_attention.default}) == {torch.bfloat16}
    assert _dtypes_of(prog, {aten.addmm.default}) == {torch.bfloat16}
    assert _dtypes_of(prog, {aten.native_layer_norm.default}) == {torch.float32}


def test_fp32_gpt_uses_efficient_attention(gpt: Any) -> None:
    prog = build_training_program(gpt[1])
    targets = Counter(n.target for n in prog.gm.graph.nodes)
    assert targets[aten._scaled_dot_product_efficient_attention.default] == 2
    assert targets[aten._scaled_dot_product_efficient_attention_backward.default] == 2


def test_fp16_adds_grad_scaler_kernels() -> None:
    prog = build_training_program(_export_mlp(_mlp()), amp="fp16")
    targets = {n.target for n in prog.gm.graph.nodes}
    assert aten._amp_foreach_non_finite_check_and_unscale_.default in targets
    assert aten._amp_update_scale_.default in targets


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------


def _saved_forward_values(prog: TracedProgram) -> int:
    """Forward tensors read after the forward phase: what autograd keeps alive across the boundary."""
    count = 0
    for node in prog.gm.graph.nodes:
        if prog.phases.get(node.name) != "forward" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if any(prog.phases.get(u.name) in ("backward", "recompute") for u in node.users):
            count += 1
    return count


def test_checkpoint_recomputes_layers_and_saves_less() -> None:
    ep = _export_lm(_gpt(layers=3))
    plain = build_training_program(ep)
    ckpt = build_training_program(ep, checkpoint=True)
    phases = Counter(ckpt.phases.values())
    assert phases["recompute"] > 0
    assert phases["forward"] + phases["recompute"] > Counter(plain.phases.values())["forward"]
    # every recomputed op belongs to a layer of the list, and every layer is recomputed
    recomputed_layers = {p for n in ckpt.gm.graph.nodes if ckpt.phases.get(n.name) == "recompute"
                         for p, _ in n.meta.get("nn_module_stack", {}).values() if p.count(".") == 1}
    assert recomputed_layers == {"h.0", "h.1", "h.2"}
    assert _saved_forward_values(ckpt) < _saved_forward_values(plain)


def test_checkpoint_without_layer_list_raises() -> None:
    with pytest.raises(ValueError, match="layer list"):
        build_training_program(_export_mlp(_mlp()), checkpoint=True)
