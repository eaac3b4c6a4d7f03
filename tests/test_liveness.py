"""Liveness peak vs the peak of live tensor storages in a real CPU run of the same graph."""
from __future__ import annotations

import pytest
import torch
from torch.export.graph_signature import InputKind

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.memory.live_bytes import measure_graph_live_bytes
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.liveness import Category, liveness_pass


def flat_args(ep: torch.export.ExportedProgram, user_inputs: tuple) -> list:
    args, users = [], iter(user_inputs)
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            # non-persistent buffers live in ep.constants
            args.append(ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target])
        else:
            args.append(next(users))
    return args


def user_inputs_for(name: str, batch: int, seq: int) -> tuple:
    if name == "mlp":
        return (torch.randn(batch, 64),)
    if name == "cnn":
        return (torch.randn(batch, 3, 16, 16),)
    return (torch.randint(0, 128, (batch, seq)),)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "llama", "hf_gpt2", "hf_bert"])
@pytest.mark.parametrize("batch,seq", [(2, 8), (5, 37), (3, 128)])
def test_inference_peak_matches_real_run(exported, name: str, batch: int, seq: int) -> None:
    ep, _ = exported(name, "cpu")
    # the graph as exported (the truth below runs it): not the eager module's attention (passes/eager_sdpa.py)
    program = capture(ep, options=ProgramOptions(python_locals=False))
    info = liveness_pass(program)
    bindings = resolve_bindings(program, {}, batch=batch, seq=seq if name not in ("mlp", "cnn") else None)
    predicted = info.peak(Evaluator(bindings)).live_bytes
    with torch.no_grad():
        measured = measure_graph_live_bytes(ep.graph_module, *flat_args(ep, user_inputs_for(name, batch, seq)))
    assert predicted == pytest.approx(measured.peak_bytes, rel=0.01)


def test_views_and_splits_share_storage(exported) -> None:
    """The qkv projection is split and viewed three ways; its storage is counted once."""
    ep, _ = exported("gpt", "meta")
    info = liveness_pass(capture(ep))
    creators = [iv.node for iv in info.intervals]
    assert not any(name.startswith(("split", "getitem", "view", "transpose")) for name in creators)
    assert len(creators) == len(set(creators))


def test_resident_inputs_and_categories(exported) -> None:
    ep, _ = exported("mlp", "meta")
    program = capture(ep)
    info = liveness_pass(program)
    ev = Evaluator(resolve_bindings(program, {}, batch=10))
    params = [iv for iv in info.intervals if iv.category is Category.PARAM]
    # fc1 64x256+256, fc2 256x256+256, out 256x10+10 fp32 parameters
    assert sum(ev(iv.nbytes) for iv in params) == 4 * (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10)
    assert all(iv.resident for iv in params)
    inputs = [iv for iv in info.intervals if iv.category is Category.INPUT]
    assert [ev(iv.nbytes) for iv in inputs] == [10 * 64 * 4]


# ----------------------------------------------------------------------------------------------------
# training graphs: the traced step (forward + backward + AdamW) run for real on CPU tensors
# ----------------------------------------------------------------------------------------------------

def _real_args(program, ep, bindings, vocab: int = 128) -> list:
    """Real tensors for each placeholder of a traced training graph, sized by ``bindings``."""
    from boomfx.core.program import ROLE_INPUT, ROLE_LABEL, ROLE_OPT_STATE, ROLE_PARAM, ROLE_BUFFER

    ev = Evaluator(bindings)
    args = []
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta["val"]
        shape = [ev(s.node.expr) if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
        role = program.input_roles[node.name]
        fqn = program.param_names.get(node.name)
        if role in (ROLE_PARAM, ROLE_BUFFER) and fqn in ep.state_dict:
            args.append(ep.state_dict[fqn].detach().clone())
        elif role == ROLE_OPT_STATE:
            args.append(torch.ones(shape, dtype=val.dtype) if val.ndim == 0 else torch.zeros(shape, dtype=val.dtype))
        elif role in (ROLE_INPUT, ROLE_LABEL) and not val.dtype.is_floating_point:
            args.append(torch.randint(0, vocab if role == ROLE_INPUT else 10, shape, dtype=val.dtype))
        else:
            args.append(torch.randn(shape, dtype=val.dtype))
    return args


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "hf_gpt2"])
def test_training_peak_matches_real_run(exported, name: str) -> None:
    from boomfx.training import trace as training
    from boomfx.frontend.capture import export_roles, program_from_traced, symbols_of
    from boomfx.core.program import ProgramOptions

    ep, _ = exported(name, "cpu")
    traced = training.build_training_program(ep, optimizer="adamw", fused_attention=False)
    program = program_from_traced(traced, symbols_of(ep, export_roles(ep)), ProgramOptions(train=True))
    info = liveness_pass(program)
    for batch, seq in [(2, 8), (3, 21)]:
        bindings = resolve_bindings(program, {}, batch=batch, seq=seq if name != "mlp" else None)
        predicted = info.peak(Evaluator(bindings))
        with torch.no_grad():
            measured = measure_graph_live_bytes(program.gm, *_real_args(program, ep, bindings))
        assert predicted.live_bytes == pytest.approx(measured.peak_bytes, rel=0.01)
        if name != "mlp":
            assert predicted.by_category.get(Category.ACT, 0) > 0      # saved activations at the peak
