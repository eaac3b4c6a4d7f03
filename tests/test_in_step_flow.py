"""The in-step rotation's operand flow (kernels_db/in_step.py ``_OperandFlow``, passes/operands.py): each call
is handed the tensors the step's earlier calls left, as a real step hands them. Truth: the program's graph
(which node each argument is, which storage an in-place write or a view keeps) and the storages the calls
actually received, recorded at call time."""
from __future__ import annotations

import pytest
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.kernels_db.in_step import time_in_step
from boomfx.kernels_db.measure import Measurer
from boomfx.passes.aliasing import is_view_node

ADDCMUL = "aten.addcmul_.default"


class TokenMLP(torch.nn.Module):
    """An embedding (integer indices), two linears and a mean loss: a forward, a backward and AdamW's loop."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(self.emb(ids))))


def _step(compile: bool = False):
    ep = torch.export.export(TokenMLP(), (torch.randint(0, 50, (4, 6)),))
    program = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu",   # a CPU's default: the loop
                                                 compile=compile))
    analysis = Analysis(program, get_device("cpu"), AnalyzeOptions("cpu", db="none"))
    return program, analysis.kernel_calls(resolve_bindings(program, {})), analysis.kernel_operands()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _recorded_pass(calls, operands):
    """One untimed-warm-up-free pass; per call: (op, storages of its tensor arguments at call time, storages
    of its outputs)."""
    log = []

    def timed_call(op, args, kwargs):
        def run():
            out = op(*args, **kwargs)
            log.append((str(op), [t.untyped_storage().data_ptr() for t in _tensors([args, kwargs])],
                        [t.untyped_storage().data_ptr() for t in _tensors(out)]))
            return out
        return run

    time_in_step(calls, min_passes=1, max_passes=1, target_s=0.0, warmup_passes=0, timed_call=timed_call,
                 operands=operands)
    return log


def test_operands_name_the_values_and_storages_of_the_graph():
    """AdamW's loop: ``addcmul_`` writes the exponential average of squares (an input of the step) in place,
    reading the gradient twice; the gradient is a backward kernel's fresh output seen through a view."""
    program, calls, operands = _step()
    by_name = {n.name: n for n in program.graph.nodes}
    sites = [(c, o) for c, o in zip(calls, operands) if str(c.op) == ADDCMUL]
    assert len(sites) == 5                                   # one per parameter
    for call, ops in sites:
        state, grad1, grad2 = ops.inputs
        assert by_name[state.storage].op == "placeholder" and state.storage.startswith("exp_avg_sq_")
        assert grad1 == grad2
        producer, seen = by_name[grad1.storage], by_name[grad1.value]
        assert isinstance(producer.target, torch._ops.OpOverload) and not is_view_node(producer)
        while seen is not producer:                          # the view chain leads back to the producer
            assert is_view_node(seen)
            seen = seen.args[0]
        (out,) = ops.outputs
        assert out.storage == state.storage                  # an in-place write keeps its argument's storage


@pytest.mark.parametrize("compile", [False, True])
def test_each_call_is_handed_what_the_step_left(compile):
    """With operands, a floating-point argument is the tensor its producer returned earlier in the pass (or,
    for a value no call produces, one tensor shared by every call reading it); integer indices keep the
    call's own; without operands every call reads its own tensors. Compiled, the fused groups (Inductor's
    generated kernels) are handed them too: a group reads the matmul output its producer just wrote."""
    _, calls, operands = _step(compile)
    fused = [c for c in calls if str(c.op) == "boomfx.fused.default"]
    assert bool(fused) == compile
    log = _recorded_pass(calls, operands)
    assert [op for op, _, _ in log] == [str(c.op) for c in calls]
    out_storage: dict[str, int] = {}       # value -> storage its producer returned this pass
    first_seen: dict[str, int] = {}        # storage value -> storage a reader was handed first
    shared = handed_own = shared_fused = 0
    for (op, ins, outs), call, ops in zip(log, calls, operands):
        specs = call.tensor_args()
        for ptr, spec, operand in zip(ins, specs, ops.inputs):
            if not spec.dtype.is_floating_point:
                handed_own += 1
                assert all(ptr != p for p in out_storage.values())   # indices: never another call's tensor
                continue
            if operand.storage in out_storage:
                assert ptr == out_storage[operand.storage], (op, operand)
                shared += 1
                shared_fused += op == "boomfx.fused.default"
            else:
                assert first_seen.setdefault(operand.storage, ptr) == ptr, (op, operand)
        for ptr, output in zip(outs, ops.outputs):
            if output is not None and output.storage == output.value:
                out_storage[output.storage] = ptr
    assert shared >= 30 and handed_own >= 1    # the loop's chains, the embedding's indices
    assert (shared_fused >= 4) == compile      # compiled: the ReLU's, the loss's and their gradients' kernels

    own = _recorded_pass(calls, None)
    distinct = [p for _, ins, _ in own for p in ins]
    assert len(set(distinct)) == len(distinct)   # every argument of every call its own storage


def test_adamw_loop_updates_one_set_of_tensors_per_parameter():
    """Per parameter, the loop's ``mul_`` on the average of squares, ``addcmul_`` and ``sqrt`` read one
    storage; ``addcdiv_`` writes the parameter ``mul_`` decayed, with the average ``lerp_`` updated."""
    _, calls, operands = _step()
    log = _recorded_pass(calls, operands)
    ops = [op for op, _, _ in log]
    starts = [i for i, op in enumerate(ops) if op == "aten.mul_.Tensor" and ops[i + 1] == "aten.lerp_.Scalar"]
    assert len(starts) == 5
    for i in starts:
        decay, lerp, sq_decay, addcmul, sqrt, div, add_eps, addcdiv = (log[i + k] for k in range(8))
        assert [op for op, _, _ in (sq_decay, addcmul, sqrt, div, add_eps, addcdiv)] == [
            "aten.mul_.Tensor", ADDCMUL, "aten.sqrt.default", "aten.div.Tensor", "aten.add_.Tensor",
            "aten.addcdiv_.default"]
        assert sq_decay[1][0] == addcmul[1][0] == sqrt[1][0]           # the average of squares, in place
        assert lerp[1][1] == addcmul[1][1] == addcmul[1][2]             # the gradient
        assert sqrt[2][0] == div[1][0] and div[2][0] == add_eps[1][0] == addcdiv[1][2]   # the denominator
        assert addcdiv[1][0] == decay[1][0] and addcdiv[1][1] == lerp[1][0]           # parameter, average


def test_timings_come_from_the_same_rotation_with_and_without_operands():
    """The flow changes which tensors a call reads, not which calls are timed or how often."""
    _, calls, operands = _step()
    flow = time_in_step(calls, min_passes=3, max_passes=3, target_s=0.0, warmup_passes=1, operands=operands,
                        timed_call=Measurer.timed_call)
    plain = time_in_step(calls, min_passes=3, max_passes=3, target_s=0.0, warmup_passes=1)
    assert not flow.failed and not plain.failed
    assert {k: len(v) for k, v in flow.samples.items()} == {k: len(v) for k, v in plain.samples.items()}
