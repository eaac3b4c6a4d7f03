"""Page faults of an eager CPU step (analysis/memory_events.heap_fault_pages over memory/glibc_heap.py): what
the step charges (outputs glibc maps afresh), what it only reports (heap pages a trim returns), by hand."""
from __future__ import annotations

import pytest
import torch

import boomfx
from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.analysis.memory_events import heap_fault_pages
from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.kernels_db import host_probe
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.measure import Measurement, Measurer
from boomfx.kernels_db.store import Store
from boomfx.memory.glibc_heap import MIN_CHUNK, PAGE_BYTES, chunk_bytes
from boomfx.report.text import NO_REFAULT_ENV, render_text
from tests.test_cpu_model import PROFILE

MiB = 1 << 20
FLOATS = 10 * MiB             # a 40 MiB tensor: above glibc's largest mmap threshold (32 MiB)


class Doubled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _mapping_pages(nbytes: int) -> int:
    """A 64-byte aligned request glibc maps: the chunk of request + alignment + a minimum chunk, its header,
    in whole pages."""
    return -(-(chunk_bytes(chunk_bytes(nbytes) + 64 + MIN_CHUNK) + 8) // PAGE_BYTES)


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setattr(host_probe, "host_profile", lambda env=None: PROFILE)   # a fault costs 1 us there


def test_an_output_glibc_maps_afresh_is_charged_every_step(probe):
    report = boomfx.analyze(Doubled(), torch.randn(FLOATS), device="cpu", db="none")
    (kernel,) = report.kernels
    expected = _mapping_pages(FLOATS * 4) * PROFILE.page_fault_ns
    assert report.time.page_faults_ns == pytest.approx(expected)
    analysis = Analysis(capture(Doubled(), torch.randn(FLOATS), options=ProgramOptions(target_kind="cpu")),
                        get_device("cpu"), AnalyzeOptions("cpu", db="none"))
    (again,) = analysis.evaluate({}).report.kernels          # sets the cache level the prices below assume
    bare = analysis.price_node(again.node, analysis.evaluator({}))
    assert again.time_ns == pytest.approx(bare.time_ns + expected)   # the model's price holds no faults itself
    assert report.time.heap_refault_estimate_ns == 0.0
    assert "page faults: " in render_text(report)


def test_a_price_measured_alone_already_paid_the_mapping(probe, tmp_path):
    """A database row timed with fresh outputs paid the 40 MiB mapping's faults: not charged twice."""
    program = capture(Doubled(), torch.randn(FLOATS), options=ProgramOptions(target_kind="cpu"))
    analysis = Analysis(program, get_device("cpu"), AnalyzeOptions("cpu", db="none"))
    (call,) = analysis.kernel_calls({})
    db = tmp_path / "rows.sqlite"
    with Store(db) as store:
        store.put(Measurement(5e6, 5e6, 5e6, 3, 1e3, 0, "measured:cpu").record(Measurer("cpu").fingerprint(),
                                                                                kernel_key(call)))
    report = boomfx.analyze(Doubled(), torch.randn(FLOATS), device="cpu", db=str(db))
    (kernel,) = report.kernels
    assert kernel.source == "measured" and report.time.page_faults_ns == 0.0


class ConvStack(torch.nn.Module):
    """6.1 MiB activations: under glibc's raised threshold, so on the heap, where frees reach the top."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(64, 64, 3, padding=1, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x)) + x
        return x


def test_heap_refaults_are_reported_not_charged(probe):
    model, x = ConvStack().eval(), torch.randn(8, 64, 56, 56)
    report = boomfx.analyze(model, x, device="cpu", db="none")
    analysis = Analysis(capture(model, x, options=ProgramOptions(target_kind="cpu")), get_device("cpu"),
                        AnalyzeOptions("cpu", db="none"))
    ev = analysis.evaluator(resolve_bindings(analysis.program, {}, None, None))
    workspace = {step: analysis._workspace(node.name, analysis.price_node(analysis.representative(node.name), ev))
                 for step, node in enumerate(analysis._nodes) if node.name in analysis.costs.by_node}
    faults = heap_fault_pages(analysis.liveness, ev, workspace)
    regrown = sum(f.regrown for f in faults.values())
    activation_pages = 8 * 64 * 56 * 56 * 4 // PAGE_BYTES
    assert regrown >= activation_pages                    # at least one activation's pages come back each step
    assert sum(f.mapped for f in faults.values()) == 0 and report.time.page_faults_ns == 0.0
    assert report.time.heap_refault_estimate_ns == pytest.approx(regrown * PROFILE.page_fault_ns)
    # the text report mentions them (and the environment that avoids them) from 5% of the step on
    report.time.total_ns = 10 * report.time.heap_refault_estimate_ns
    assert NO_REFAULT_ENV in render_text(report)
    report.time.total_ns = 100 * report.time.heap_refault_estimate_ns
    assert NO_REFAULT_ENV not in render_text(report)


def test_targets_without_this_hosts_probe_charge_nothing(probe):
    for device, db in (("cpu", None), ("a100-80gb", "none")):
        report = boomfx.analyze(Doubled(), torch.randn(FLOATS), device=device, db=db)
        assert report.time.page_faults_ns == 0.0 and report.time.heap_refault_estimate_ns == 0.0
