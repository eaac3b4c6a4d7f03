"""The annotate pass: every node carries its prediction, and the per-node values add up to the Report."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import boomfx
from boomfx.integrations.annotate import META_KEY, NO_SOURCE

DEVICE = "a100-80gb"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "checkpoint_under_budget.py"


def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ x.T).sum(1)


def _check_totals(result) -> None:
    """Per-node numbers add up to the Report of the same evaluation."""
    report, nodes = result.report, list(result.gm.graph.nodes)
    entries = [n.meta[META_KEY] for n in nodes]
    assert sum(e["time_ns"] for e in entries) == pytest.approx(sum(k.time_ns for k in report.kernels), rel=1e-12)
    assert sum(e["flops"] for e in entries) == pytest.approx(report.time.flops, rel=1e-12)
    assert sum(e["bytes_read"] + e["bytes_written"] for e in entries) == report.time.bytes_moved
    assert sum(e["is_kernel"] for e in entries) == report.time.kernels
    assert max(e["live_bytes"] + e["workspace_bytes"] for e in entries) == report.memory.peak_live_bytes
    # after a node, its dead inputs are gone; the next node then adds what it allocates
    for here, nxt in zip(entries, entries[1:]):
        assert here["live_bytes_after"] + nxt["alloc_bytes"] == nxt["live_bytes"]
    for node, e in zip(nodes, entries):
        if not e["is_kernel"]:
            assert (e["time_ns"], e["flops"], e["source"]) == (0.0, 0.0, NO_SOURCE), node.name
        else:
            assert e["source"] in ("measured", "block-measured", "interpolated", "transferred", "model", "roofline")
            assert e["time_ns"] > 0


def test_aten_graph_module_is_annotated_in_place():
    gm = make_fx(_f, tracing_mode="fake")(torch.randn(16, 32))
    before = list(gm.graph.nodes)
    result = boomfx.annotate(gm, device=DEVICE)
    assert result.gm is gm and list(gm.graph.nodes) == before
    assert all(META_KEY in n.meta for n in before)          # placeholders, views and output too
    by_op = {n.meta[META_KEY]["op"]: n.meta[META_KEY] for n in before if n.op == "call_function"}
    mm = by_op["aten.mm.default"]
    assert mm["flops"] == 2 * 16 * 16 * 32                  # 2*M*N*K = 16384
    assert mm["bytes_read"] == (16 * 32 + 32 * 16) * 4      # both operands once, fp32: 4096
    assert mm["bytes_written"] == 16 * 16 * 4               # the [16, 16] result: 1024
    assert mm["alloc_bytes"] == 16 * 16 * 4
    view = by_op["aten.permute.default"]                    # x.T is a view: no kernel, no storage
    assert view["is_kernel"] is False and view["alloc_bytes"] == 0
    placeholder = before[0].meta[META_KEY]
    assert placeholder["live_bytes"] == 16 * 32 * 4 and placeholder["time_ns"] == 0.0
    _check_totals(result)
    assert result["mm"] is mm


def test_exported_program_is_annotated_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ep = torch.export.export(model, (torch.randn(4, 8),))
    result = boomfx.annotate(ep, device=DEVICE)
    assert result.gm is ep.graph_module
    assert all(META_KEY in n.meta for n in ep.graph.nodes)
    _check_totals(result)


def test_symbolic_graph_binds_hints_or_dims():
    model = torch.nn.Linear(8, 16)
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes=({0: batch},))
    at_hint = boomfx.annotate(ep, device=DEVICE)
    at_64 = boomfx.annotate(ep, device=DEVICE, batch=64)
    assert list(at_hint.bindings.values()) == [4] and list(at_64.bindings.values()) == [64]
    # addmm: 2*B*8*16 + B*16 (bias) = 272*B -> linear in B
    assert at_hint.report.time.flops == 272 * 4
    assert at_64.report.time.flops == 272 * 64


def test_training_graph_is_annotated_with_phases_and_categories():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    result = boomfx.annotate(model, torch.randn(64, 16), device=DEVICE, train=True, optimizer="sgd")
    entries = [n.meta[META_KEY] for n in result.gm.graph.nodes]
    assert {"forward", "backward", "optimizer"} <= {e["phase"] for e in entries if e["phase"]}
    assert "activation" in {e["category"] for e in entries}
    _check_totals(result)


def _load_example():
    spec = importlib.util.spec_from_file_location("checkpoint_under_budget", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_checkpoint_example_lowers_predicted_peak():
    example = _load_example()
    model, x = example.MLPStack(dim=32, depth=3), torch.randn(32, 64, 32)
    unconstrained = example.plan_checkpointing(model, x, budget_bytes=1 << 40)
    assert unconstrained.chosen_layers == [] and unconstrained.peak_after_bytes == unconstrained.peak_before_bytes
    assert sorted(unconstrained.activations_by_layer) == ["layers.0", "layers.1", "layers.2"]
    budget = int(unconstrained.peak_before_bytes * 0.85)
    plan = example.plan_checkpointing(model, x, budget_bytes=budget)
    assert plan.chosen_layers                               # the budget needs some checkpointing
    assert plan.peak_after_bytes < plan.peak_before_bytes   # and the re-analysis predicts a lower peak
    assert plan.fits
