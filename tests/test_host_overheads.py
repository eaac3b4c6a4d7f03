"""Host time outside kernel prices (kernels_db/host_overheads.py, boomfx/analysis/host_time.py): compiled graphs'
entries, a CPU's cold starts and eager dispatch (op switches, aliasing ops, the autograd engine), stored like
kernels, read by the pricer, placed in the schedule, and measured on this CPU."""
from __future__ import annotations

import math

import pytest
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.core.devices import get_device
from boomfx.analysis.host_time import autograd_nodes
from boomfx.kernels_db.host_overheads import (ALIAS_OP, AUTOGRAD_NODE, DEFAULT_NS, EAGER_EVENTS, EVENTS,
                                              OPTIONAL_EVENTS,
                                              GRAPH_CALL, GRAPH_CALL_COLD, GRAPH_CALL_PER_INPUT, HOST_OP, OP_COLD,
                                              OP_SWITCH, TRAIN_CALLS, TRAIN_CALLS_COLD,
                                              TRAIN_CALLS_PER_INPUT, HostCosts, collect_host_costs, event_of,
                                              host_key)
from boomfx.kernels_db.measure import Measurement, Measurer, l2_cache_bytes
from boomfx.kernels_db.store import Store
from boomfx.core.program import ProgramOptions
from test_api import TwoLayer

VALUES = {GRAPH_CALL: 40_000.0, GRAPH_CALL_PER_INPUT: 1_000.0, GRAPH_CALL_COLD: 100_000.0,
          TRAIN_CALLS: 200_000.0, TRAIN_CALLS_PER_INPUT: 3_000.0, TRAIN_CALLS_COLD: 300_000.0, OP_COLD: 20_000.0,
          OP_SWITCH: 1_000.0, ALIAS_OP: 2_000.0, AUTOGRAD_NODE: 3_000.0}
WARM_ONLY = {**VALUES, GRAPH_CALL_COLD: 0.0, TRAIN_CALLS_COLD: 0.0, OP_COLD: 0.0}


class MatmulChain(torch.nn.Module):
    """x @ w, relu, sum over 256 x 256 floats: 768 KiB, 512 KiB and 256 KiB + 4 bytes moved."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w).sum()


def _db(path, values):
    measurer = Measurer("cpu")
    fp = measurer.fingerprint()
    path.mkdir(exist_ok=True)
    with Store(path / "host.sqlite") as store:
        store.put_many([Measurement(v, v, v, 1, v, 0, "measured:cpu").record(fp, host_key(e))
                        for e, v in values.items()])
    return path / "host.sqlite"


def _analysis(model: torch.nn.Module, x: torch.Tensor, train: bool = False, db=None, compile: bool = True,
              device: str = "cpu") -> Analysis:
    program = capture(torch.export.export(model, (x,)),
                      options=ProgramOptions(train=train, compile=compile, target_kind=get_device(device).kind))
    return Analysis(program, get_device(device), AnalyzeOptions(device, db=str(db) if db else None))


def _report(analysis: Analysis):
    return analysis.evaluate(resolve_bindings(analysis.program, {})).report


def test_keys_name_their_event():
    assert {event_of(host_key(e)) for e in EVENTS} == set(EVENTS)
    assert host_key(GRAPH_CALL).op == HOST_OP and host_key(GRAPH_CALL) != host_key(TRAIN_CALLS)
    with pytest.raises(ValueError):
        host_key("nonsense")


def test_costs_by_hand(tmp_path):
    """Rows win, missing events take the target kind's defaults; the cold terms scale with the bytes the
    kernel before moved, up to the L2 (1 MiB here)."""
    with Store(_db(tmp_path, VALUES)) as store:
        records = list(store.records())
    costs = HostCosts.from_records(records, "cpu", l2_bytes=1 << 20)
    # the framework events (kernels_db/framework_overheads.py) and transformers' module calls
    # (boomfx/serving/host_overhead.py) are not in a plain collection: defaults
    framework = {e: DEFAULT_NS["cpu"][e] for e in OPTIONAL_EVENTS}
    assert costs.source == "measured" and costs.values == VALUES | framework
    assert costs.entry_ns(False, 5) == 40_000 + 5 * 1_000
    assert costs.entry_ns(False, 5, previous_bytes=512 << 10) == 45_000 + 100_000 / 2
    assert costs.entry_ns(True, 5, previous_bytes=8 << 20) == 200_000 + 5 * 3_000 + 300_000
    assert costs.cold_start_ns(256 << 10, 50_000, measured=True) == 20_000 / 4
    assert costs.cold_start_ns(4 << 20, 50_000, measured=True) == 20_000
    # a measured price of >= 100 us followed a cache flush: it holds a full cold start already
    assert costs.cold_start_ns(256 << 10, 200_000, measured=True) == 20_000 / 4 - 20_000
    assert costs.cold_start_ns(256 << 10, 200_000, measured=False) == 20_000 / 4
    # an eager op after a different one: the switch, less the part of a cold start the bytes before paid
    assert costs.switch_ns(0, 50_000, measured=True) == 1_000
    assert costs.switch_ns(256 << 10, 50_000, measured=True) == 1_000 * 3 / 4
    assert costs.switch_ns(4 << 20, 50_000, measured=False) == 0
    assert costs.switch_ns(0, 200_000, measured=True) == 0          # its flushed price holds a cold start
    assert costs.alias_ns(3) == 6_000
    assert costs.autograd_ns(10) == 30_000
    partial = HostCosts.from_records([r for r in records if event_of(r.key) != OP_COLD], "cpu")
    assert partial.source == "partly measured" and partial.values[OP_COLD] == DEFAULT_NS["cpu"][OP_COLD]
    for kind in ("cpu", "cuda"):
        costs = HostCosts.from_records([], kind)
        assert costs.source == "default" and costs.values == DEFAULT_NS[kind]
    # a GPU host only issues kernels: nothing evicts its caches between them
    assert DEFAULT_NS["cuda"][OP_COLD] == DEFAULT_NS["cuda"][GRAPH_CALL_COLD] == 0 < DEFAULT_NS["cpu"][OP_COLD]


@pytest.mark.parametrize("train", [False, True])
def test_compiled_step_pays_for_entering_its_graphs(tmp_path, train):
    """Inputs: two weights, two biases and x. Inference: one forward entry of 40 + 5 x 1 us before the
    first kernel. Training: that entry, and the rest of the training cost (200 + 5 x 3 - 45 us) before
    the first backward kernel; kernels, their prices and memory are unchanged."""
    x = torch.randn(4, 32)
    report = _report(_analysis(TwoLayer(), x, train, _db(tmp_path / "warm", WARM_ONLY)))
    forward_ns, total_ns = 45_000.0, (215_000.0 if train else 45_000.0)
    assert report.time.graph_entry_ns == pytest.approx(total_ns)
    assert report.time.host_costs_source == "measured"
    free = _report(_analysis(TwoLayer(), x, train, _db(tmp_path / "free", {e: 0.0 for e in EVENTS})))
    assert report.time.total_ns == pytest.approx(free.time.total_ns + total_ns)
    assert [k.time_ns for k in report.kernels] == [k.time_ns for k in free.kernels]
    assert report.memory.peak_live_bytes == free.memory.peak_live_bytes
    assert report.kernels[0].start_ns == pytest.approx(forward_ns)
    if train:
        first_bwd = next(i for i, k in enumerate(report.kernels) if k.phase == "backward")
        assert report.kernels[first_bwd].start_ns == pytest.approx(free.kernels[first_bwd].start_ns + total_ns)
    eager = _report(_analysis(TwoLayer(), x, train, _db(tmp_path / "warm", WARM_ONLY), compile=False))
    assert eager.time.graph_entry_ns == 0 and eager.kernels[0].start_ns == 0


@pytest.fixture
def looped_prices(monkeypatch):
    """The CPU model over this host's probe without its in-step ratios: looped prices, which pay their op
    switch and cold start on top (with the ratios they hold them: ``test_in_step_model_prices_...``)."""
    import dataclasses
    from boomfx.kernels_db import pricing
    from boomfx.kernels_db.host_probe import host_profile
    profile = host_profile()
    looped = dataclasses.replace(profile, in_step=()) if profile is not None else None
    monkeypatch.setattr(pricing, "_host_profile", lambda device: looped if device.kind == "cpu" else None)


def test_in_step_model_prices_hold_their_switch_and_cold_start(tmp_path, monkeypatch):
    """With the probe's in-step ratios (kernels_db/in_step_calibration.py) the CPU model's price of each kernel
    is its looped price scaled by the ratio of what bounds it at its time (whole calls: the dispatch in),
    and such a price already holds what the kernels before it left: no cold start, no op switch."""
    import dataclasses
    from boomfx.kernels_db import pricing
    from boomfx.kernels_db.host_probe import host_profile
    profile = host_profile()
    if profile is None:
        pytest.skip("the host probe is off")
    ratios = {"matmul": ((1e3, 3.0), (1e6, 1.5)), "arithmetic": ((1e3, 2.0),), "memory": ((1e3, 2.0),)}
    from boomfx.kernels_db import cpu_model
    monkeypatch.setattr(cpu_model, "ratios_by_bound", lambda pairs, bound: ratios)
    for name, prof in (("looped", dataclasses.replace(profile, in_step=())),
                       ("in_step", dataclasses.replace(profile, in_step=(("calibration", 1.0, 2.0),)))):
        monkeypatch.setattr(pricing, "_host_profile", lambda device, p=prof: p if device.kind == "cpu" else None)
        x = torch.randn(256, 256)
        report = _report(_analysis(MatmulChain(), x, db=_db(tmp_path / name, VALUES), compile=False))
        if name == "looped":
            looped = report
            assert looped.time.cold_start_ns > 0 and looped.time.eager_dispatch_ns > 0
            continue
        assert report.time.cold_start_ns == 0 and report.time.eager_dispatch_ns == 0
        dispatch = profile.dispatch_ns
        for before, after in zip(looped.kernels, report.kernels):
            whole = before.time_ns + dispatch
            ratio = 1.5 + (3.0 - 1.5) * (math.log(1e6) - math.log(whole)) / (math.log(1e6) - math.log(1e3))
            ratio = 3.0 if whole <= 1e3 else 1.5 if whole >= 1e6 else ratio
            expected = whole * ratio - dispatch if "matmul" in before.op else whole * 2.0 - dispatch
            assert after.time_ns == pytest.approx(max(before.time_ns, expected), rel=1e-6)


def test_cold_starts_on_a_cpu(tmp_path, looped_prices):
    """Eager mm -> relu -> sum: each kernel pays op_cold x min(1, bytes before / L2), the first one after
    the step's last kernel (a loop); roofline prices hold no cold start. A GPU target pays none."""
    x = torch.randn(256, 256)
    report = _report(_analysis(MatmulChain(), x, db=_db(tmp_path / "cold", VALUES), compile=False))
    moved = [k.bytes_moved for k in report.kernels]
    assert moved == [3 * 256 * 1024, 2 * 256 * 1024, 256 * 1024 + 4]      # by hand: fp32 256 x 256
    l2 = l2_cache_bytes()
    before = (moved[2], moved[0], moved[1])
    expected = sum(20_000 * min(1.0, b / l2) for b in before)
    assert report.time.cold_start_ns == pytest.approx(expected)
    switches = sum(1_000 * (1.0 - min(1.0, b / l2)) for b in before)      # no aliasing op in this program
    assert report.time.eager_dispatch_ns == pytest.approx(switches)
    free = _report(_analysis(MatmulChain(), x, db=_db(tmp_path / "free", {e: 0.0 for e in EVENTS}), compile=False))
    assert report.time.total_ns == pytest.approx(free.time.total_ns + expected + switches)
    assert free.time.cold_start_ns == free.time.eager_dispatch_ns == 0
    compiled = _report(_analysis(MatmulChain(), x, db=_db(tmp_path / "cold", VALUES)))
    entry = 40_000 + 2 * 1_000 + 100_000 * min(1.0, compiled.kernels[-1].bytes_moved / l2)
    assert compiled.time.graph_entry_ns == pytest.approx(entry)    # after the step's last kernel
    assert compiled.time.eager_dispatch_ns == 0                     # Inductor's wrapper calls its kernels directly
    gpu = _report(_analysis(MatmulChain(), x, compile=False, device="a100-80gb"))
    assert gpu.time.cold_start_ns == gpu.time.eager_dispatch_ns == 0


class ViewsAround(torch.nn.Module):
    """view, t, t before the matmul, a transpose before the sum: four aliasing ops, no kernel of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.view(128, 64).t() @ self.w.t()).transpose(0, 1).sum()


def test_eager_dispatch_of_aliasing_ops(tmp_path, looped_prices):
    """Each aliasing op costs alias_op, charged to the kernel after it; every kernel its switch after a
    different op (scaled down by the bytes the one before moved); the kernels' own prices do not move."""
    x = torch.randn(64, 128)
    report = _report(_analysis(ViewsAround(), x, db=_db(tmp_path / "d", VALUES), compile=False))
    assert [k.op.split(".")[1] for k in report.kernels] == ["matmul", "relu", "sum"]
    l2 = l2_cache_bytes()
    moved = [k.bytes_moved for k in report.kernels]
    switches = sum(1_000 * (1.0 - min(1.0, b / l2)) for b in (moved[2], moved[0], moved[1]))
    assert report.time.eager_dispatch_ns == pytest.approx(4 * 2_000 + switches)
    free = _report(_analysis(ViewsAround(), x, db=_db(tmp_path / "f", {e: 0.0 for e in EVENTS}), compile=False))
    assert [k.time_ns for k in report.kernels] == [k.time_ns for k in free.kernels]
    assert report.time.total_ns == pytest.approx(free.time.total_ns + report.time.cold_start_ns
                                                 + 4 * 2_000 + switches)


def test_autograd_engine_in_an_eager_training_step(tmp_path):
    """TwoLayer's eager autograd graph, by hand: two TBackward, two AddmmBackward, ReluBackward,
    MeanBackward and four AccumulateGrad: 10 nodes at autograd_node each, spread over the backward's
    kernels; the traced graph's detach of saved tensors is not an eager op. Inference builds no graph."""
    x = torch.randn(4, 32)
    analysis = _analysis(TwoLayer(), x, train=True, db=_db(tmp_path / "a", VALUES), compile=False)
    assert autograd_nodes(analysis.program) == 10
    report = _report(analysis)
    free = _report(_analysis(TwoLayer(), x, train=True, db=_db(tmp_path / "f", {e: 0.0 for e in EVENTS}),
                             compile=False))
    no_engine = _report(_analysis(TwoLayer(), x, train=True, db=_db(tmp_path / "n", {**VALUES, AUTOGRAD_NODE: 0.0}),
                                  compile=False))
    assert report.time.eager_dispatch_ns - no_engine.time.eager_dispatch_ns == pytest.approx(10 * 3_000)
    assert report.time.total_ns == pytest.approx(free.time.total_ns + report.time.cold_start_ns
                                                 + report.time.eager_dispatch_ns)
    forward = [k.start_ns for k in report.kernels if k.phase == "forward"]
    assert forward == pytest.approx([k.start_ns for k in no_engine.kernels if k.phase == "forward"])
    inference = _analysis(TwoLayer(), x, db=_db(tmp_path / "a", VALUES), compile=False)
    assert inference._autograd_nodes == 0


def test_measured_on_this_cpu_and_stored(tmp_path):
    """The calibration runs real compiled graphs; each event is stored once under the host's fingerprint
    and read back by the pricer (not a timing assertion: the values only have to be valid times)."""
    path = tmp_path / "m.sqlite"
    with Store(path) as store:
        assert collect_host_costs(store, Measurer("cpu"), pairs=5, compiled=False) == list(EAGER_EVENTS)
        step_events = sorted(e for e in EVENTS if e not in OPTIONAL_EVENTS)   # framework ones: --collectives
        assert sorted(collect_host_costs(store, Measurer("cpu"), pairs=5)) == step_events
        assert collect_host_costs(store, Measurer("cpu"), pairs=5) == []          # present: not again
        records = list(store.records())
    assert sorted(event_of(r.key) for r in records) == step_events       # one row each
    assert all(r.median_ns >= 0 for r in records)
    assert HostCosts.from_records(records, "cpu").values[TRAIN_CALLS] > 0     # a backward is never free
    assert HostCosts.from_records(records, "cpu").values[ALIAS_OP] > 0        # nor is a dispatch
    assert _report(_analysis(TwoLayer(), torch.randn(4, 32), db=path)).time.host_costs_source == "measured"
