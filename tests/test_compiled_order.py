"""--compile keeps the graph topologically ordered when inlined values are copied into each reading kernel
(passes/compiled.py:recompute_inlined). transformers' GPT-2 with eager attention (the causal mask is built
from chains of cheap pointwise/index values read by several kernels) failed with "Argument 'unsqueeze_19'
of Node 'index_4' was used before it has been defined" at 2 layers and more (issue 14: a 36-layer GPT-2):
a copy placed before another copy got the order value of an original node (``first - 0.5``), and the next
value was then copied in front of the wrong one of the two."""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import boomfx
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.fused_op import FusedKernel


@pytest.fixture(scope="module")
def eager_gpt2() -> torch.export.ExportedProgram:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=256,
                                  attn_implementation="eager", bos_token_id=0, eos_token_id=0, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg).eval()
        ids = torch.randint(0, 128, (2, 8))
    dims = {"input_ids": {0: Dim("batch", max=512), 1: Dim("seq", min=2, max=256)}}
    return torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes=dims, strict=False)


def test_compiled_graph_is_topologically_ordered(eager_gpt2: torch.export.ExportedProgram) -> None:
    program = capture(eager_gpt2, options=ProgramOptions(compile=True))
    program.graph.lint()   # every argument defined before its use
    seen: set = set()
    for node in program.graph.nodes:
        assert all(i in seen for i in node.all_input_nodes), node.format_node()
        seen.add(node)
    assert any(isinstance(n.target, FusedKernel) for n in program.graph.nodes)


def test_compiled_work_is_the_eager_work_plus_recomputation(eager_gpt2: torch.export.ExportedProgram) -> None:
    dims = {"batch": 2, "seq": 64}
    eager = boomfx.analyze(eager_gpt2, device="a100-80gb", dims=dims)
    compiled = boomfx.analyze(eager_gpt2, device="a100-80gb", dims=dims, compile=True)
    # the same members' FLOPs, plus inlined values recomputed in each reading kernel (a few, cheap)
    assert eager.time.flops <= compiled.time.flops <= 1.02 * eager.time.flops
    assert compiled.time.kernels < eager.time.kernels
