"""The Python API gives the CLI's numbers on every kind of input, and ``import boomfx`` stays cheap."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import boomfx

DEVICE = "a100-80gb"


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _numbers(report: boomfx.Report) -> dict:
    alloc = report.memory.allocator
    return {"time_ns": report.time.total_ns, "flops": report.time.flops, "bytes_moved": report.time.bytes_moved,
            "kernels": report.time.kernels, "peak_live_bytes": report.memory.peak_live_bytes,
            "peak_allocated_bytes": alloc.peak_allocated_bytes, "peak_reserved_bytes": alloc.peak_reserved_bytes,
            "total_device_bytes": report.memory.total_device_bytes}


def _json_numbers(data: dict) -> dict:
    alloc = data["memory"]["allocator"]
    return {"time_ns": data["time"]["total_ns"], "flops": data["time"]["flops"],
            "bytes_moved": data["time"]["bytes_moved"], "kernels": data["time"]["kernels"],
            "peak_live_bytes": data["memory"]["peak_live_bytes"],
            "peak_allocated_bytes": alloc["peak_allocated_bytes"], "peak_reserved_bytes": alloc["peak_reserved_bytes"],
            "total_device_bytes": data["memory"]["total_device_bytes"]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model, x = TwoLayer(), torch.randn(8, 32)
    ep = torch.export.export(model, (x,))
    path = tmp_path_factory.mktemp("api") / "two_layer.pt2"
    torch.export.save(ep, str(path))
    return model, x, ep, path


def run_cli(*args: str) -> dict:
    """``boomfx analyze ... --json`` in a fresh process (as a user runs it); the JSON's numbers."""
    out = subprocess.run([sys.executable, "-m", "boomfx.cli.main", "analyze", *args, "--device", DEVICE, "--json"],
                         capture_output=True, text=True, check=True)
    return _json_numbers(json.loads(out.stdout))


@pytest.fixture(scope="module")
def cli_numbers(exported):
    return run_cli(str(exported[3]))


SOURCES = {
    "pt2 path": lambda model, x, ep, path: ((str(path),), {}),
    "ExportedProgram": lambda model, x, ep, path: ((ep,), {}),
    "module + inputs": lambda model, x, ep, path: ((model, x), {}),
    "GraphModule (ep.module())": lambda model, x, ep, path: ((ep.module(), x), {}),
    "GraphModule (symbolic_trace)": lambda model, x, ep, path: ((torch.fx.symbolic_trace(model), x), {}),
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_api_matches_cli_json(kind, exported, cli_numbers):
    args, kwargs = SOURCES[kind](*exported)
    report = boomfx.analyze(*args, device=DEVICE, **kwargs)
    got = _numbers(report)
    assert got == pytest.approx(cli_numbers, rel=1e-12), kind


def test_aten_graph_module_with_fake_values(exported, cli_numbers):
    """A make_fx graph (aten ops, fake values, parameters as inputs) gives the export's FLOPs."""
    model, x, _ep, _path = exported
    params = dict(model.named_parameters())
    gm = make_fx(lambda p, inp: torch.func.functional_call(model, p, (inp,)), tracing_mode="fake")(params, x)
    report = boomfx.analyze(gm, device=DEVICE)
    # 2*8*32*64 + 2*8*64*16 = 32768 + 16384 = 49152 matmul FLOPs; + 8*64 + 8*16 bias adds
    # (addmm) + 8*64 relu = 512 + 128 + 512 -> the CLI's total, whatever the formula split
    assert report.time.flops == cli_numbers["flops"]
    assert report.time.kernels == cli_numbers["kernels"]


def test_dynamic_batch_binding_matches_cli(tmp_path):
    model, x = TwoLayer(), torch.randn(8, 32)
    batch = torch.export.Dim("batch", min=1, max=4096)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    path = tmp_path / "dyn.pt2"
    torch.export.save(ep, str(path))
    cli = run_cli(str(path), "--batch", "256")
    report = boomfx.analyze(ep, device=DEVICE, batch=256)
    assert _numbers(report) == pytest.approx(cli, rel=1e-12)
    assert [s.value for s in report.symbols] == [256]


def test_report_round_trips_through_json(exported):
    report = boomfx.analyze(exported[2], device=DEVICE)
    again = boomfx.Report.from_json(report.to_json())
    assert again == report
    assert again.schema_version == boomfx.SCHEMA_VERSION


def test_package_root_is_lazy_and_exports_plain_objects():
    code = (
        "import sys, types, boomfx\n"
        "assert 'torch' not in sys.modules, 'import boomfx imported torch'\n"
        "from boomfx.analysis.analysis import Analysis, analyze\n"
        "assert isinstance(boomfx.analyze, types.FunctionType) and boomfx.analyze is analyze\n"
        "assert boomfx.Analysis is Analysis\n"
        "from boomfx.frontend.capture import capture\n"
        "assert boomfx.capture is capture\n"
        "assert boomfx.devices.get_device('h100').name == 'h100-sxm'\n"
        "assert boomfx.get_device('h100').name == 'h100-sxm'\n"
        "assert boomfx.Report.__name__ == 'Report'\n"
        "import boomfx.integrations.annotate as fx_pass\n"
        "assert boomfx.annotate is fx_pass.annotate and fx_pass.META_KEY == 'boomfx'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_attribute_raises():
    with pytest.raises(AttributeError):
        boomfx.no_such_thing  # noqa: B018


def test_json_schema_doc_names_every_report_field():
    """docs/json-schema.md must not drift from the dataclasses it documents (anti-pattern 9)."""
    import dataclasses
    from pathlib import Path

    from boomfx.report import model as rep
    doc = (Path(__file__).resolve().parent.parent / "docs" / "json-schema.md").read_text()
    classes = (rep.Report, rep.SymbolReport, rep.TimeReport, rep.MemoryReport, rep.AllocatorReport,
               rep.KernelReport, rep.GroupTime, rep.BlockReport)
    missing = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
               if f"| `{f.name}` |" not in doc]
    assert not missing, f"fields not documented in docs/json-schema.md: {missing}"
    assert f'currently `"{rep.SCHEMA_VERSION}"`' in doc
