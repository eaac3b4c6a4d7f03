"""Tied parameters (GPT-2's lm_head.weight = transformer.wte.weight) are one tensor in eager PyTorch:
one storage, one gradient, one optimizer state. The traced step must treat them the same way."""
from __future__ import annotations

import boomfx
from boomfx.frontend.capture import capture
from boomfx.core.program import ProgramOptions
from boomfx.training.trace import tied_parameters
from conftest import make_model


def _unique_param_bytes() -> tuple[int, int]:
    model, _, _ = make_model("hf_gpt2", "cpu")
    params = list(model.parameters())                 # nn.Module deduplicates tied parameters
    return len(params), sum(p.numel() * p.element_size() for p in params)


def test_tied_parameters_are_found(exported) -> None:
    ep, _ = exported("hf_gpt2", "cpu")
    assert tied_parameters(ep) == [["lm_head.weight", "transformer.wte.weight"]]
    untied, _ = exported("gpt", "cpu")
    assert tied_parameters(untied) == []


def test_tied_parameters_get_one_gradient_and_one_optimizer_state(exported) -> None:
    ep, _ = exported("hf_gpt2", "cpu")
    n_params, param_bytes = _unique_param_bytes()
    program = capture(ep, options=ProgramOptions(train=True, optimizer="adamw"))
    roles = list(program.input_roles.values())
    assert roles.count("param") == n_params
    assert len(program.grad_nodes) == n_params
    report = boomfx.analyze(ep, device="cpu", train=True, batch=2, seq=8)
    # AdamW steady state: params + exp_avg + exp_avg_sq, one float32 `step` scalar per parameter, the
    # int64 input_ids and the traced scalar constants (attention's mask value)
    ids_bytes = 2 * 8 * 8
    constants = sum(getattr(program.gm, n.target).nbytes for n in program.graph.nodes if n.op == "get_attr")
    assert constants < 64
    assert report.memory.resident_bytes == 3 * param_bytes + 4 * n_params + ids_bytes + constants
    assert report.warnings == []


def test_tied_inference_counts_the_weight_once(exported) -> None:
    ep, _ = exported("hf_gpt2", "cpu")
    _, param_bytes = _unique_param_bytes()
    buffers = sum(t.numel() * t.element_size() for name, t in ep.state_dict.items()
                  if name not in ep.graph_signature.parameters)
    report = boomfx.analyze(ep, device="cpu", batch=2, seq=8)
    assert report.memory.resident_bytes == param_bytes + buffers + 2 * 8 * 8
