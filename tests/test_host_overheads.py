"""The host cost of entering compiled graphs (kernels_db/host_overheads.py): stored like kernels, read by
the pricer, added to a compiled step before its forward and its backward, and measured on this CPU."""
from __future__ import annotations

import pytest
import torch

from boomfx.analyze import Analysis, AnalyzeOptions
from boomfx.capture import capture, resolve_bindings
from boomfx.devices import get_device
from boomfx.kernels_db.host_overheads import (DEFAULT_NS, EVENTS, GRAPH_CALL, GRAPH_CALL_PER_INPUT, HOST_OP,
                                              TRAIN_CALLS, TRAIN_CALLS_PER_INPUT, CompiledCallCosts,
                                              collect_compiled_call_overheads, event_of, host_key)
from boomfx.kernels_db.measure import Measurement, Measurer
from boomfx.kernels_db.store import Store
from boomfx.program import ProgramOptions

VALUES = {GRAPH_CALL: 40_000.0, GRAPH_CALL_PER_INPUT: 1_000.0, TRAIN_CALLS: 200_000.0, TRAIN_CALLS_PER_INPUT: 3_000.0}


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _db(tmp_path, values=VALUES):
    measurer = Measurer("cpu")
    fp = measurer.fingerprint()
    path = tmp_path / "host.sqlite"
    with Store(path) as store:
        store.put_many([Measurement(v, v, v, 1, v, 0, "measured:cpu").record(fp, host_key(e))
                        for e, v in values.items()])
    return path


def _analysis(train: bool, db=None, compile: bool = True) -> Analysis:
    ep = torch.export.export(TwoLayer(), (torch.randn(4, 8),))
    program = capture(ep, options=ProgramOptions(train=train, compile=compile, target_kind="cpu"))
    return Analysis(program, get_device("cpu"), AnalyzeOptions("cpu", db=str(db) if db else None))


def test_keys_name_their_event():
    assert {event_of(host_key(e)) for e in EVENTS} == set(EVENTS)
    assert host_key(GRAPH_CALL).op == HOST_OP and host_key(GRAPH_CALL) != host_key(TRAIN_CALLS)
    with pytest.raises(ValueError):
        host_key("nonsense")


def test_costs_need_every_event_else_defaults(tmp_path):
    with Store(_db(tmp_path)) as store:
        records = list(store.records())
    costs = CompiledCallCosts.from_records(records, "cpu")
    assert costs.source == "measured" and costs.values == VALUES
    assert costs.step_ns(False, 5) == 40_000 + 5 * 1_000
    assert costs.step_ns(True, 5) == 200_000 + 5 * 3_000
    partial = [r for r in records if event_of(r.key) != TRAIN_CALLS]
    for kind in ("cpu", "cuda"):
        costs = CompiledCallCosts.from_records(partial, kind)
        assert costs.source == "default" and costs.values == DEFAULT_NS[kind]
    # a CPU target's entry follows its own kernels on the same core (in situ), a GPU host's does not
    assert DEFAULT_NS["cpu"][GRAPH_CALL] > DEFAULT_NS["cuda"][GRAPH_CALL]


@pytest.mark.parametrize("train", [False, True])
def test_compiled_step_pays_for_entering_its_graphs(tmp_path, train):
    """Inputs: two weights, two biases and x. Inference: one forward entry of 40 + 5 x 1 us before the
    first kernel. Training: that entry, and the rest of the training cost (200 + 5 x 3 - 45 us) before
    the first backward kernel; kernels, their prices and memory are unchanged."""
    db = _db(tmp_path)
    analysis = _analysis(train, db)
    bindings = resolve_bindings(analysis.program, {})
    report = analysis.evaluate(bindings).report
    forward_ns, total_ns = 45_000.0, (215_000.0 if train else 45_000.0)
    assert report.time.graph_entry_ns == pytest.approx(total_ns)
    assert report.time.graph_entry_source == "measured"
    (tmp_path / "free").mkdir()
    free = _analysis(train, _db(tmp_path / "free", {e: 0.0 for e in EVENTS})).evaluate(bindings).report
    assert report.time.total_ns == pytest.approx(free.time.total_ns + total_ns)
    assert [k.time_ns for k in report.kernels] == [k.time_ns for k in free.kernels]
    assert report.memory.peak_live_bytes == free.memory.peak_live_bytes
    assert report.kernels[0].start_ns == pytest.approx(forward_ns)
    if train:
        first_bwd = next(i for i, k in enumerate(report.kernels) if k.phase == "backward")
        assert report.kernels[first_bwd].start_ns == pytest.approx(free.kernels[first_bwd].start_ns + total_ns)
    eager = _analysis(train, db, compile=False).evaluate(bindings).report
    assert eager.time.graph_entry_ns == 0 and eager.kernels[0].start_ns == 0


def test_default_costs_without_a_database():
    analysis = _analysis(False)
    report = analysis.evaluate(resolve_bindings(analysis.program, {})).report
    cpu = DEFAULT_NS["cpu"]
    assert report.time.graph_entry_source == "default"
    assert report.time.graph_entry_ns == pytest.approx(cpu[GRAPH_CALL] + 5 * cpu[GRAPH_CALL_PER_INPUT])
    gpu = Analysis(analysis.program, get_device("a100-80gb")).evaluate(resolve_bindings(analysis.program, {})).report
    assert gpu.time.graph_entry_ns == pytest.approx(DEFAULT_NS["cuda"][GRAPH_CALL] + 5 * DEFAULT_NS["cuda"][GRAPH_CALL_PER_INPUT])


def test_measured_on_this_cpu_and_stored(tmp_path):
    """The calibration runs real compiled graphs; each event is stored once under the host's fingerprint
    and read back by the pricer (not a timing assertion: the values only have to be valid times)."""
    path = tmp_path / "m.sqlite"
    with Store(path) as store:
        assert sorted(collect_compiled_call_overheads(store, Measurer("cpu"), pairs=5)) == sorted(EVENTS)
        records = list(store.records())
    assert sorted(event_of(r.key) for r in records) == sorted(EVENTS)
    assert all(r.median_ns >= 0 for r in records)
    assert CompiledCallCosts.from_records(records, "cpu").values[TRAIN_CALLS] > 0     # a backward is never free
    analysis = _analysis(False, path)
    assert analysis.evaluate(resolve_bindings(analysis.program, {})).report.time.graph_entry_source == "measured"
