"""Depth-free training graphs (boomfx/training/truncate.py, boomfx/training/expand.py): tracing four layers
and replicating one must predict exactly what tracing the whole model predicts."""
from __future__ import annotations

from typing import Any

import pytest

from boomfx.training import truncate as fast_training
from boomfx.training import trace as training
from boomfx.analysis.analysis import Analysis
from boomfx.frontend.capture import capture, export_roles, program_from_traced, resolve_bindings, symbols_of
from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions

from conftest import export_meta

def _numbers(traced: Any, ep: Any, options: ProgramOptions, device: str) -> tuple:
    program = program_from_traced(traced, symbols_of(ep, export_roles(ep)), options)
    report = Analysis(program, get_device(device)).evaluate(resolve_bindings(program, {}, 3, 40)).report
    alloc = report.memory.allocator
    return (report.time.total_ns, report.time.flops, report.time.bytes_moved, report.memory.peak_live_bytes,
            report.memory.total_device_bytes, alloc.peak_reserved_bytes if alloc else None,
            alloc.peak_allocated_bytes if alloc else None, len(report.kernels),
            sorted((k.module, k.op, k.time_ns) for k in report.kernels),
            [(b.name, b.instances, b.activation_bytes_per_instance) for b in report.blocks])


@pytest.mark.parametrize("name,layers,checkpoint", [("llama", 8, False), ("gpt", 7, False), ("gpt", 7, True),
                                                    ("llama", 9, True)])
def test_synthesised_graph_predicts_exactly_what_the_full_trace_predicts(name: str, layers: int,
                                                                         checkpoint: bool) -> None:
    ep = export_meta(name, layers)
    full = training.build_training_program(ep, checkpoint=checkpoint)
    fast = fast_training.build_training_program_fast(ep, checkpoint=checkpoint)
    assert fast is not None, "the fast path fell back to the full trace"
    options = ProgramOptions(train=True, checkpoint=checkpoint)
    for device in ("h100-sxm", "cpu"):
        assert _numbers(fast, ep, options, device) == _numbers(full, ep, options, device)
    # every layer's parameters, gradients and optimizer state are there, under their own names
    assert sorted(fast.param_names.values()) == sorted(full.param_names.values())
    assert sorted(fast.grad_nodes.values()) == sorted(full.grad_nodes.values())
    assert sorted(fast.input_roles.items()) == sorted(full.input_roles.items())


def test_shallow_models_use_the_full_trace() -> None:
    assert fast_training.build_training_program_fast(export_meta("llama", 3)) is None


def test_capture_uses_the_fast_path_for_deep_models(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = export_meta("gpt", 8)
    calls = []
    real = training.build_training_program
    monkeypatch.setattr(training, "build_training_program",
                        lambda e, **kw: calls.append(len(list(e.graph.nodes))) or real(e, **kw))
    program = capture(ep, options=ProgramOptions(train=True, target_kind="cuda"))   # foreach: CUDA's default
    assert len(calls) == 1 and calls[0] < len(list(ep.graph.nodes))    # only the truncated program
    assert {p for p in program.param_names.values() if p.startswith("h.")} >= {f"h.{i}.fc.weight"
                                                                               for i in range(8)}
    # torch.optim's per-parameter loop (--no-foreach, and torch's default for a CPU's tensors): the
    # synthesis extends foreach lists, so the whole model is traced
    for options in (ProgramOptions(train=True, target_kind="cuda", foreach=False),
                    ProgramOptions(train=True, target_kind="cpu")):
        calls.clear()
        capture(ep, options=options)
        assert calls == [len(list(ep.graph.nodes))]


def test_unsupported_structure_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = export_meta("gpt", 8)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise fast_training.Unsupported("test")

    monkeypatch.setattr("boomfx.training.expand.expand", refuse)
    assert fast_training.build_training_program_fast(ep) is None


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fsdp_of_a_synthesised_stack_equals_fsdp_of_the_full_trace(name: str) -> None:
    """The synthesis leaves the template layer's size queries where they were traced (ahead of the copies'
    backward); FSDP must not take them for the start of the template's backward (it placed that unit's
    prefetched all-gather after views reading it: the rewrite failed for fp32 stacks of 7+ layers)."""
    from boomfx.distributed.analysis import DistributedAnalysis
    from boomfx.distributed.plan import ParallelConfig

    ep = export_meta(name, 8)
    options = ProgramOptions(train=True)
    symbols = symbols_of(ep, export_roles(ep))
    fast = program_from_traced(fast_training.build_training_program_fast(ep), symbols, options)
    full = program_from_traced(training.build_training_program(ep), symbols, options)
    device = get_device("h100-sxm")
    cfg = ParallelConfig(dp_shard=4, nodes=1, gpus_per_node=4)
    numbers = []
    for program in (fast, full):
        classes = DistributedAnalysis(program, cfg, device).evaluate(
            resolve_bindings(program, {}, 3, 40)).report.parallel["classes"]
        numbers.append([(c["step_time_ns"], c["peak_live_bytes"], c["total_device_bytes"]) for c in classes])
    assert numbers[0] == numbers[1]
