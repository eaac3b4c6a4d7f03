"""Tied parameters (GPT-2's lm_head.weight = transformer.wte.weight) are one tensor in eager PyTorch:
one storage, one gradient, one optimizer state. The traced step must treat them the same way."""
from __future__ import annotations

import boomfx
from boomfx.analysis.analysis import NOMINAL_CPU_WARNING
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
    program = capture(ep, options=ProgramOptions(train=True, optimizer="adamw", target_kind="cpu"))
    roles = list(program.input_roles.values())
    assert roles.count("param") == n_params
    assert len(program.grad_nodes) == n_params
    report = boomfx.analyze(ep, device="cpu", train=True, batch=2, seq=8)
    # AdamW steady state: params + exp_avg + exp_avg_sq, one float32 `step` scalar per parameter, the
    # int64 input_ids, the int64 next-token labels of the default cross-entropy, and the traced scalar
    # constants (attention's mask value)
    ids_bytes = 2 * (2 * 8 * 8)
    constants = sum(getattr(program.gm, n.target).nbytes for n in program.graph.nodes if n.op == "get_attr")
    assert constants < 64
    assert report.memory.resident_bytes == 3 * param_bytes + 4 * n_params + ids_bytes + constants
    assert [w for w in report.warnings if w != NOMINAL_CPU_WARNING] == []   # nothing about the tied weights


def test_tied_inference_counts_the_weight_once(exported) -> None:
    ep, _ = exported("hf_gpt2", "cpu")
    _, param_bytes = _unique_param_bytes()
    buffers = sum(t.numel() * t.element_size() for name, t in ep.state_dict.items()
                  if name not in ep.graph_signature.parameters)
    report = boomfx.analyze(ep, device="cpu", batch=2, seq=8)
    assert report.memory.resident_bytes == param_bytes + buffers + 2 * 8 * 8


# --- .pt2 files: the tie must survive saving and loading (tests/hf_zoo.py models) --------------------

import pytest  # noqa: E402
import torch  # noqa: E402

from boomfx.frontend.loader import load_program  # noqa: E402
from boomfx.frontend.ties import find_ties  # noqa: E402

TIED_ZOO = ["tied", "gpt2", "t5", "whisper"]


def _eager_unique_param_bytes(name: str) -> tuple[int, int]:
    """(count, bytes) of the parameters an eager model holds: nn.Module lists a tied weight once."""
    import hf_zoo
    model, _, _ = hf_zoo.build(name, "meta")
    params = list(model.parameters())
    return len(params), sum(p.numel() * p.element_size() for p in params)


def _param_bytes(source) -> int:
    return boomfx.analyze(source, device="cpu", dims=_dims(source)).memory.by_category_bytes["parameter"]


def _dims(source) -> dict[str, int]:
    """Bind every symbol of the program to a small legal size (2 frames/tokens... at least its minimum)."""
    program = capture(source)
    return {name: max(2, info.min_value) for name, info in program.symbols.items()}


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("name", TIED_ZOO)
def test_pt2_counts_tied_weights_once(zoo, name: str, device: str) -> None:
    """Real-weight files (the tie is a shared record) and meta files (the tie is only in the graph's
    structure) count each tied weight once, like the in-memory program and the eager model."""
    ep, path = zoo(name, device)
    _, eager_bytes = _eager_unique_param_bytes(name)
    assert _param_bytes(ep) == eager_bytes            # in memory: right before and after this change
    assert _param_bytes(path) == eager_bytes          # T5: the shared embedding was counted 4x
    loaded = load_program(path)
    assert sorted(map(sorted, find_ties(loaded))) == sorted(sorted(g) for g in tied_parameters(ep))


@pytest.mark.parametrize("name", ["tied", "t5"])
def test_pt2_tied_weights_train_as_one_parameter(zoo, name: str) -> None:
    """--train on a loaded meta file: one gradient and one optimizer state per eager parameter."""
    _, path = zoo(name, "meta")
    n_params, _ = _eager_unique_param_bytes(name)
    program = capture(path, options=ProgramOptions(train=True, optimizer="adamw"))
    assert list(program.input_roles.values()).count("param") == n_params
    assert len(program.grad_nodes) == n_params
    # AdamW: exp_avg + exp_avg_sq + one step scalar per unique parameter
    assert list(program.input_roles.values()).count("opt_state") == 3 * n_params


def test_untied_weights_of_equal_shape_stay_apart(tmp_path) -> None:
    """Two embeddings of one shape, both read, are two tensors: no rule may merge them."""
    class TwoTables(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Embedding(32, 8)
            self.b = torch.nn.Embedding(32, 8)
            self.unused = torch.nn.Embedding(32, 8)    # never read, never run: eager still holds it

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.a(ids) + self.b(ids)

    with torch.device("meta"):
        ep = torch.export.export(TwoTables(), (torch.zeros(2, 4, dtype=torch.long),))
    torch.export.save(ep, str(tmp_path / "two.pt2"))
    assert find_ties(load_program(tmp_path / "two.pt2")) == []
    assert _param_bytes(str(tmp_path / "two.pt2")) == 3 * 32 * 8 * 4    # three float32 tables
