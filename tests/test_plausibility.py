"""Collection refuses implausible measurements and says why; analysis flags rows that look poisoned
(kernels_db/plausibility.py). A busy machine is played by a fake clock, never by loading the real one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions, analyze
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.cli.main import main
from boomfx.core.devices import get_device
from boomfx.kernels_db import plausibility as P
from boomfx.kernels_db.collect import collect_calls
from boomfx.kernels_db.collectors import build_call, spec
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.measure import Measurement, Measurer
from boomfx.kernels_db.roofline import roofline_ns
from boomfx.kernels_db.schema import DeviceFingerprint, KernelRecord
from boomfx.kernels_db.store import Store
from boomfx.core.program import ProgramOptions

aten = torch.ops.aten
F32 = torch.float32
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BUSY_SLICE_NS = 8_000_000     # what a descheduled sample measured on the loaded VM: ~8 ms, whatever the kernel


class SteppingClock:
    """A clock that advances ``step_ns`` per read: every timed sample (two reads) lasts ``step_ns``, as when
    the measuring thread loses a scheduler slice to other jobs before every sample."""

    def __init__(self, step_ns: int) -> None:
        self.step_ns = step_ns
        self.now = 0

    def __call__(self) -> int:
        self.now += self.step_ns
        return self.now


def _measurer(step_ns: int) -> Measurer:
    return Measurer("cpu", warmup_s=0.0, target_s=0.0, min_runs=3, max_runs=3, measure_workspace=False,
                    num_threads=1, clock=SteppingClock(step_ns))


def _calls() -> list:
    return [build_call(aten.relu.default, (spec((1 << 16,), F32),)),
            build_call(aten.add.Tensor, (spec((256, 256), F32), spec((256, 256), F32))),
            build_call(aten.mm.default, (spec((64, 64), F32), spec((64, 64), F32)))]


def test_a_busy_machines_measurements_are_refused_with_a_reason(tmp_path: Path) -> None:
    measurer = _measurer(BUSY_SLICE_NS)
    with Store(tmp_path / "k.sqlite") as store:
        result = collect_calls(store, _calls(), measurer=measurer, progress=False)
        assert result.measured == 0 and store.count(measurer.fingerprint()) == 0
    assert {r.key.key_hash for r in result.rejected} == {kernel_key(c).key_hash for c in _calls()}
    relu = next(r for r in result.rejected if r.key.op == "aten.relu.default")
    # 64K fp32 elements read + written: 524,288 bytes / (20 GB/s x 0.5) = 52.4 us of roofline; the dispatch
    # allowance is the measured one-element call (also 8 ms here), capped at MAX_OVERHEAD_NS = 50 us:
    # 8,000 us / (52.4 + 50) us = 78 rooflines
    assert "8000.0 us is 78x the cpu roofline" in relu.reason


def test_a_workspace_only_collection_keeps_the_busy_rows(tmp_path: Path) -> None:
    """``check_plausible=False`` (a database read for its workspaces only, as the gloo and CPU memory
    checks read theirs): the same busy clock's rows are all stored, so a load spike cannot drop a
    kernel's measured scratch from a memory prediction."""
    measurer = Measurer("cpu", warmup_s=0.0, target_s=0.0, min_runs=1, max_runs=1, num_threads=1,
                        clock=SteppingClock(BUSY_SLICE_NS))
    with Store(tmp_path / "k.sqlite") as store:
        result = collect_calls(store, _calls(), measurer=measurer, progress=False, check_plausible=False)
        assert not result.rejected
        assert result.measured == len(_calls()) == store.count(measurer.fingerprint())


def test_the_same_measurer_with_a_plausible_clock_stores_every_row(tmp_path: Path) -> None:
    measurer = _measurer(1_000)    # every sample 1 us: faster than no roofline forbids
    with Store(tmp_path / "k.sqlite") as store:
        result = collect_calls(store, _calls(), measurer=measurer, progress=False)
        assert result.rejected == () and result.measured == 3 == store.count(measurer.fingerprint())


class ScriptedMeasurer:
    """Returns a chosen median per key on an H100 fingerprint (no kernel runs)."""

    def __init__(self, times_ns: dict[str, float]) -> None:
        self.times_ns = times_ns

    def fingerprint(self) -> DeviceFingerprint:
        return DeviceFingerprint("h100-sxm", "cuda", "2.13.0", "12.4", "550", "gpuhost", 0, "")

    def measure(self, key) -> Measurement:
        t = self.times_ns[key.key_hash]
        return Measurement(t, t, t, 5, 5_000.0, 0, "measured:cuda")


def _mm(n: int):
    return build_call(aten.mm.default, (spec((n, n), F32), spec((n, n), F32)))


@pytest.mark.parametrize("small_first", [True, False])
def test_a_smaller_call_far_slower_than_a_larger_one_is_refused(tmp_path: Path, small_first: bool) -> None:
    small, large = _mm(64), _mm(128)
    h100 = get_device("h100-sxm")
    # the small one alone is plausible: 45 us is 17.6 of its 2.56 us roofline (2.5 us launch + 0.06 us), < 20
    assert P.slowness(45_000.0, 0.0, small, P.call_cost(small), h100) < P.SLOW_FACTOR
    # but the 8x larger call took 3 us: 45 / 3 = 15 > INVERSION_FACTOR (12)
    times = {kernel_key(small).key_hash: 45_000.0, kernel_key(large).key_hash: 3_000.0}
    calls = [small, large] if small_first else [large, small]
    measurer = ScriptedMeasurer(times)
    with Store(tmp_path / "k.sqlite") as store:
        result = collect_calls(store, calls, measurer=measurer, progress=False)
        kept = {rec.key.key_hash for rec in store.records(measurer.fingerprint())}
    assert kept == {kernel_key(large).key_hash}
    assert [r.key.key_hash for r in result.rejected] == [kernel_key(small).key_hash]
    assert "8.0x the work took 3.0 us" in result.rejected[0].reason and result.measured == 1


def test_consistent_sizes_are_all_stored(tmp_path: Path) -> None:
    small, large = _mm(64), _mm(128)
    measurer = ScriptedMeasurer({kernel_key(small).key_hash: 45_000.0, kernel_key(large).key_hash: 50_000.0})  # 19.5 rooflines
    with Store(tmp_path / "k.sqlite") as store:
        result = collect_calls(store, [small, large], measurer=measurer, progress=False)
    assert result.rejected == () and result.measured == 2


def test_collect_cli_lists_each_refused_row_and_counts_them(tmp_path: Path, monkeypatch, capsys) -> None:
    import boomfx.kernels_db.host_overheads as host_overheads
    import boomfx.kernels_db.measure as measure
    monkeypatch.setattr(measure, "protocol_measurer", lambda device, kind=None: _measurer(BUSY_SLICE_NS))
    monkeypatch.setattr(host_overheads, "collect_host_costs", lambda *a, **k: [])
    db = tmp_path / "cpu.sqlite"
    status = main(["kernels", "collect", "--for", str(EXAMPLES / "mlp.pt2"), "--batch", "8", "--db", str(db),
                   "--quiet"])
    captured = capsys.readouterr()
    refused = [line for line in captured.err.splitlines() if line.startswith("  refused ")]
    assert status == 0 and refused and all("roofline" in line for line in refused)
    assert f"refused as implausible {len(refused)}" in captured.out
    assert f"boomfx: {len(refused)} measurements refused as implausible" in captured.err


# ---------------------------------------------------------------------------------------------------
# analyze: rows already in a database (collected before these checks, or imported) that look poisoned
# ---------------------------------------------------------------------------------------------------
def _db_with_times(tmp_path: Path, time_of) -> tuple[str, int]:
    """A CPU database holding every kernel of examples/mlp.pt2 at batch 64, each timed ``time_of(call)``."""
    program = capture(str(EXAMPLES / "mlp.pt2"), options=ProgramOptions(target_kind="cpu"))
    bindings = resolve_bindings(program, {}, 64, None)
    calls = Analysis(program, get_device("cpu"), AnalyzeOptions("cpu", db="none")).kernel_calls(bindings)
    fp = DeviceFingerprint("cpu", "cpu", "2.13.0", "", "", "somehost", 1, "")
    rows = []
    for call in calls:
        t = time_of(call)
        rows.append(KernelRecord(fp, kernel_key(call), t, t, t, 5, 0.0, 0, "measured:cpu"))
    db = tmp_path / "cpu.sqlite"
    with Store(db) as store:
        store.put_many(rows)
    return str(db), len(rows)


def test_analyze_warns_when_poisoned_rows_price_the_step(tmp_path: Path) -> None:
    db, n = _db_with_times(tmp_path, lambda call: float(BUSY_SLICE_NS))
    report = analyze(str(EXAMPLES / "mlp.pt2"), device="cpu", db=db, batch=64)
    lines = [w for w in report.warnings if "probably measured on a busy machine" in w]
    assert len(lines) == 1
    flagged = int(lines[0].split(" kernels")[0])
    assert 0 < flagged <= n


def test_analyze_is_quiet_about_rows_near_the_roofline(tmp_path: Path) -> None:
    one_core = P.at_threads(get_device("cpu"), 1)
    db, _ = _db_with_times(tmp_path, lambda call: 3.0 * roofline_ns(call, P.call_cost(call), one_core))
    report = analyze(str(EXAMPLES / "mlp.pt2"), device="cpu", db=db, batch=64)
    assert any(k.source == "measured" for k in report.kernels)
    assert not any("busy machine" in w for w in report.warnings)
