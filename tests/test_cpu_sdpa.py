"""Compiled CPU attention as the dispatcher decomposes it (passes/cpu_sdpa.py), against the dispatcher itself
(``make_fx`` traces through the composite as AOTAutograd does) and against real calls."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.cpu_sdpa import FLASH_CPU, SDPA, decompose_cpu_attention

aten = torch.ops.aten
B, H, L, S, D = 2, 4, 16, 24, 8


class _Attention(torch.nn.Module):
    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, mask):  # noqa: ANN001, ANN201
        if mask is not None and mask.dtype == torch.bool:
            mask = mask.expand(q.shape[0], 1, q.shape[2], k.shape[2])    # transformers' batch-expanded pattern
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kwargs)


# name -> (query heads, kv heads, head dim of v, query dims, mask, sdpa keyword arguments)
CASES = {
    "bool-mask": (H, H, D, 4, "bool", {}),
    "float-mask": (H, H, D, 4, "float", {}),
    "causal": (H, H, D, 4, None, {"is_causal": True}),
    "gqa-causal": (H, 2, D, 4, None, {"is_causal": True, "enable_gqa": True}),
    "scaled": (H, H, D, 4, "bool", {"scale": 0.3}),
    "dropout": (H, H, D, 4, None, {"dropout_p": 0.5}),        # the math path: kept as exported
    "3-d": (H, H, D, 3, None, {}),                              # the math path
    "v-head-dim": (H, H, 2 * D, 4, None, {}),                   # unequal head dims: the math path
}


def _inputs(case: str) -> tuple:
    heads, kv_heads, dv, dims, mask, _ = CASES[case]
    torch.manual_seed(0)
    q, k, v = torch.randn(B, heads, L, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, dv)
    if dims == 3:
        q, k, v = q[0], k[0], v[0]
    m = (torch.rand(1, 1, L, S) > 0.3) if mask == "bool" else torch.randn(B, 1, L, S) if mask == "float" else None
    return q, k, v, m


def _program(case: str, target_kind: str = "cpu", compile: bool = False):
    module = _Attention(CASES[case][5])
    ep = torch.export.export(module, _inputs(case), strict=False)
    return capture(ep, options=ProgramOptions(train=False, compile=compile, target_kind=target_kind)), module


def _calls(graph: torch.fx.Graph) -> list:
    """The ops a graph runs, views, getitems and the export's asserts left out."""
    return sorted(str(n.target) for n in graph.nodes if n.op == "call_function"
                  and n.target is not operator.getitem and n.target not in (aten.expand.default,)
                  and "assert" not in str(n.target))


@pytest.mark.parametrize("case", sorted(CASES))
def test_decomposition_is_the_dispatchers(case) -> None:
    """The rewritten graph calls what ``make_fx`` records the composite calling: the CPU flash kernel, after a
    ``where(mask, 0, -inf)`` for a boolean mask; the composite stays where the dispatcher takes the math path."""
    program, module = _program(case)
    rewritten = decompose_cpu_attention(program)
    dispatcher = make_fx(module, tracing_mode="fake")(*_inputs(case)).graph
    runs_flash = FLASH_CPU in {n.target for n in dispatcher.nodes}
    assert runs_flash == (case not in ("dropout", "3-d", "v-head-dim"))
    if runs_flash:
        assert _calls(rewritten.graph) == _calls(dispatcher)
    else:
        assert rewritten is program and SDPA in {n.target for n in program.graph.nodes}


@pytest.mark.parametrize("case", ["bool-mask", "float-mask", "causal", "gqa-causal", "scaled"])
def test_rewritten_graph_computes_the_same_attention(case) -> None:
    program, module = _program(case)
    rewritten = decompose_cpu_attention(program)
    inputs = _inputs(case)
    got = torch.fx.Interpreter(torch.fx.GraphModule(rewritten.gm, rewritten.graph)).run(*inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, module(*inputs), rtol=1e-5, atol=1e-5)


def test_boolean_mask_becomes_a_stored_batch_sized_float_mask() -> None:
    """Compiled, the float mask is the output of a generated kernel of the expanded mask's shape, read by the
    flash kernel (Inductor's ``cpp_fused_..._where`` buffer): ``batch x q x kv`` fp32 elements."""
    program, _ = _program("bool-mask", compile=True)
    flash = [n for n in program.graph.nodes if n.target is FLASH_CPU]
    assert len(flash) == 1
    mask = flash[0].kwargs["attn_mask"]
    assert getattr(mask.target, "boomfx_fused", False)
    assert "where" in mask.target.ops
    assert tuple(mask.meta["val"].shape) == (B, 1, L, S) and mask.meta["val"].dtype == torch.float32
    outputs = [n for n in program.graph.nodes if n.op == "call_function" and n.target is operator.getitem
               and n.args[0] is flash[0]]
    assert [n.args[1] for n in outputs] == [0]                   # the log-sum-exp: allocated, never read


def test_gpu_targets_keep_the_composite() -> None:
    program, _ = _program("bool-mask", target_kind="cuda", compile=True)
    assert SDPA in {n.target for n in program.graph.nodes}
    assert FLASH_CPU not in {n.target for n in program.graph.nodes}
