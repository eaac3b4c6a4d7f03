"""``torch.compile(backend="boomfx")``: same outputs as eager, one record per captured graph."""
from __future__ import annotations

import shutil

import pytest
import torch

import boomfx
import boomfx.integrations.dynamo_backend as bd


class Branchy(torch.nn.Module):
    """A data-dependent Python branch on ``.item()``: Dynamo breaks the graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        if y.sum().item() > 0:
            y = y * 2
        else:
            y = y - 1
        return self.b(y)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    bd.clear_reports()
    yield
    torch._dynamo.reset()
    bd.clear_reports()


def test_registered_backend_matches_eager_and_records_each_graph():
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4, 16)
    expected = model(x)
    compiled = torch.compile(model, backend="boomfx")      # found through the entry point
    torch.testing.assert_close(compiled(x), expected)
    records = bd.records()
    assert len(records) >= 2                                # the graph break gives a second graph
    assert all(r.ok and r.warning is None for r in records)
    assert len(bd.reports()) == len(records)
    assert [r.index for r in records] == list(range(len(records)))
    for rep in bd.reports():
        assert isinstance(rep, boomfx.Report)
        assert rep.device == "a100-80gb" and rep.time.total_ns > 0 and rep.time.flops > 0
    # first graph: linear (2*4*16*32 + 4*32 bias) + relu + sum; second: mul + linear
    assert bd.reports()[0].time.flops >= 2 * 4 * 16 * 32


def test_graph_report_matches_boomfx_analyze_of_the_same_code():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    torch.compile(model, backend="boomfx")(x)
    (rep,) = bd.reports()
    direct = boomfx.analyze(model, x, device="a100-80gb")
    assert rep.time.flops == direct.time.flops
    assert rep.time.kernels == direct.time.kernels
    assert rep.time.bytes_moved == direct.time.bytes_moved


def test_options_select_device_and_delegate():
    model, x = Branchy(), torch.randn(4, 16)
    expected = model(x)
    compiled = torch.compile(model, backend="boomfx", options={"device": "h100", "delegate": "aot_eager"})
    torch.testing.assert_close(compiled(x), expected)
    assert {r.device for r in bd.reports()} == {"h100-sxm"}


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor on CPU needs a C++ compiler")
def test_inductor_delegate_compiles_after_the_analysis():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
    x = torch.randn(4, 16)
    backend = bd.make_backend(delegate="inductor")
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    assert [r.ok for r in backend.records] == [True]


def test_make_backend_keeps_its_own_records():
    backend = bd.make_backend(delegate="eager", device="t4")
    model, x = Branchy(), torch.randn(4, 16)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    assert len(backend.records) >= 2 and {r.device for r in backend.reports()} == {"t4"}
    assert bd.records() == backend.records


def test_failed_analysis_records_a_warning_and_the_run_goes_on():
    backend = bd.make_backend(device="no-such-gpu")
    model, x = Branchy(), torch.randn(4, 16)
    with pytest.warns(RuntimeWarning, match="boomfx could not analyse"):
        out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, model(x))
    assert backend.records and all(not r.ok and "no-such-gpu" in r.warning for r in backend.records)
    assert bd.reports() == []


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown option"):
        bd.boomfx_backend(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [torch.randn(1, 2)],
                          options={"devcie": "h100"})
