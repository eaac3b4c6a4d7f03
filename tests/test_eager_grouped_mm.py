"""transformers' MoE experts priced as the eager model runs them (passes/eager_grouped_mm.py).

Truth: torch's profiler over the real eager model names the grouped product it calls, and the rewritten
graph run on the real weights gives the export's own output."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.eager_grouped_mm import eager_grouped_products, has_cpu_grouped_mm
from boomfx.passes.op_names import op_name

pytestmark = pytest.mark.skipif(not has_cpu_grouped_mm(), reason="this torch has no CPU _grouped_mm")

CPU_EAGER = ProgramOptions(target_kind="cpu")
FALLBACK = "transformers.grouped_mm_fallback.default"


def _grouped_ops(program) -> list[str]:
    return [op_name(n.target) for n in program.graph.nodes
            if n.op == "call_function" and "grouped_mm" in str(n.target)]


def test_eager_cpu_inference_prices_the_grouped_product_the_model_calls(zoo) -> None:
    """The export traced transformers' fallback (2 layers x gate_up, down); the eager model calls torch's
    ``_grouped_mm`` as many times and the fallback never: the CPU program holds what the model calls."""
    import hf_zoo
    from torch.profiler import ProfilerActivity, profile

    ep, _ = zoo("mixtral", "cpu")
    assert [op_name(n.target) for n in ep.graph.nodes if "grouped_mm" in str(n.target)] == [FALLBACK] * 4
    model, inputs, _ = hf_zoo.build("mixtral", "cpu")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(**inputs)
    called = {e.key: e.count for e in prof.key_averages() if "grouped_mm" in e.key}
    assert called == {"aten::_grouped_mm": 4}
    assert _grouped_ops(capture(ep, options=CPU_EAGER)) == ["aten._grouped_mm.default"] * 4
    # the export's own graph is not edited
    assert [op_name(n.target) for n in ep.graph.nodes if "grouped_mm" in str(n.target)] == [FALLBACK] * 4


def test_rewritten_graph_computes_the_exports_output(zoo) -> None:
    """Same operands, same result: the rewritten graph on the real weights equals the export's module."""
    import hf_zoo

    ep, _ = zoo("mixtral", "cpu")
    program = capture(ep, options=CPU_EAGER)
    _, inputs, _ = hf_zoo.build("mixtral", "cpu")
    with torch.no_grad():
        got = program.gm(*hf_zoo.graph_args(ep, inputs))[0]
        want = ep.module()(**inputs)[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("change", [dict(compile=True), dict(train=True), dict(target_kind="cuda"),
                                    dict(python_locals=False)])
def test_compiled_training_gpu_and_graph_programs_keep_the_traced_fallback(zoo, change: dict) -> None:
    """torch.compile traces the fallback with fp32 weights (as the export did); training is traced through the
    fallback's autograd formula (a known limitation); the GPU model prices both alike; ``python_locals=False``
    is the export's graph as ``ep.module()`` runs it (boomfx validate's real step): left as recorded."""
    ep, _ = zoo("mixtral", "cpu")
    program = capture(ep, options=dataclasses.replace(CPU_EAGER, **change))
    ops = _grouped_ops(program)
    assert "aten._grouped_mm.default" not in ops
    assert FALLBACK in ops


def test_a_program_without_the_fallback_is_returned_as_is(zoo) -> None:
    program = capture(zoo("gpt2")[0], options=CPU_EAGER)
    assert eager_grouped_products(program) is program
