"""Kernels timed inside their program's step (kernels_db/in_step.py): the rotation, the rows it writes, how the
pricer labels them and which host terms they already hold (boomfx/analysis/host_time.py)."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.cli.main import main
from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.kernels_db.collect import collect_calls
from boomfx.kernels_db.host_overheads import ALIAS_OP, EVENTS, OP_COLD, OP_SWITCH, host_key
from boomfx.kernels_db.in_step import InStepTimes, record_in_step, time_in_step
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.measure import Measurement, Measurer
from boomfx.kernels_db.schema import is_in_step_source
from boomfx.kernels_db.store import Store
from test_host_overheads import ViewsAround


def _program_calls(model: torch.nn.Module, x: torch.Tensor):
    program = capture(torch.export.export(model, (x,)), options=ProgramOptions(compile=False, target_kind="cpu"))
    analysis = Analysis(program, get_device("cpu"), AnalyzeOptions("cpu", db="none"))
    return program, analysis.kernel_calls(resolve_bindings(program, {}))


class Repeated(torch.nn.Module):
    """Three relu calls on the same shape (one key) between two matmuls of different shapes: three keys."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(32, 48))
        self.b = torch.nn.Parameter(torch.randn(48, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.relu(torch.relu(x @ self.a)))
        return h @ self.b


def _ticking(step: int = 1_000):
    """A clock that advances ``step`` ns per reading: every timed call takes exactly ``step``."""
    now = [0]

    def clock() -> int:
        now[0] += step
        return now[0]
    return clock


def test_every_call_is_timed_where_it_stands_each_pass():
    """Each pass runs the program's calls in order; a key's samples are all its calls in all timed passes;
    passes stop at the time target once the minimum ran."""
    _, calls = _program_calls(Repeated(), torch.randn(16, 32))
    keys = [kernel_key(c).key_hash for c in calls]
    assert len(calls) == 5 and len(set(keys)) == 3              # mm, relu x3 (one key), mm
    times = time_in_step(calls, clock=_ticking(), min_passes=3, target_s=0.0, warmup_passes=1)
    assert {h: len(s) for h, s in times.samples.items()} == {h: 3 * keys.count(h) for h in set(keys)}
    assert all(v == 1_000.0 for s in times.samples.values() for v in s)
    # one pass takes 5 calls x 1 us: 12 passes reach 60 us
    longer = time_in_step(calls, clock=_ticking(), min_passes=3, target_s=60e-6, warmup_passes=0)
    assert len(longer.samples[keys[0]]) == 12
    capped = time_in_step(calls, clock=_ticking(), min_passes=3, max_passes=4, target_s=1.0, warmup_passes=0)
    assert len(capped.samples[keys[0]]) == 4


def test_the_rotation_never_holds_more_than_its_budget():
    """Inputs by hand (fp32): the first matmul [16, 32] @ [32, 48] holds 8 KiB, each relu [16, 48] 3 KiB, the
    last matmul [16, 48] @ [48, 32] 9 KiB. With 10 KiB only the first matmul is built; the relu and the last
    matmul are left out (their isolated rows stay) and say why."""
    from boomfx.kernels_db.keys import input_bytes
    _, calls = _program_calls(Repeated(), torch.randn(16, 32))
    keys = [kernel_key(c) for c in calls]
    assert [input_bytes(k) for k in keys] == [8192, 3072, 3072, 3072, 9216]
    times = time_in_step(calls, clock=_ticking(), min_passes=2, target_s=0.0, warmup_passes=0,
                         input_budget_bytes=10 * 1024)
    assert set(times.samples) == {keys[0].key_hash}
    assert {keys[1].key_hash, keys[4].key_hash} == set(times.failed)
    assert all("over the rotation's budget" in why for why in times.failed.values())
    # room for the first matmul and one relu: the relu's later calls share its inputs, still timed each
    shared = time_in_step(calls, clock=_ticking(), min_passes=2, target_s=0.0, warmup_passes=0,
                          input_budget_bytes=8192 + 3072)
    assert {h: len(v) for h, v in shared.samples.items()} == {keys[0].key_hash: 2, keys[1].key_hash: 6}
    assert set(shared.failed) == {keys[4].key_hash}


def test_a_call_that_fails_keeps_its_isolated_row(monkeypatch):
    """A key whose call raises in the rotation gets no in-step time; the others do."""
    _, calls = _program_calls(Repeated(), torch.randn(16, 32))
    bad = kernel_key(calls[1]).key_hash
    import boomfx.kernels_db.in_step as in_step
    real = in_step.make_inputs

    def broken(key, device, seed=0):
        op, args, kwargs = real(key, device, seed)
        if key.key_hash == bad:
            return (lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no kernel"))), args, kwargs
        return op, args, kwargs
    monkeypatch.setattr(in_step, "make_inputs", broken)
    times = time_in_step(calls, min_passes=2, target_s=0.0, warmup_passes=1)
    assert bad in times.failed and "no kernel" in times.failed[bad]
    assert bad not in times.samples and len(times.samples) == 2


def test_rows_are_rewritten_with_the_in_step_median(tmp_path):
    """record_in_step replaces median/p10/p90/runs of the program's isolated rows, keeps their workspace and
    host time, and labels them; a key without an isolated row gets none."""
    _, calls = _program_calls(Repeated(), torch.randn(16, 32))
    db = tmp_path / "k.sqlite"
    measurer = Measurer("cpu", target_s=0.002, min_runs=3)
    collect_calls(Store(db), calls[:4], measurer=measurer, progress=False, check_plausible=False)       # the last matmul left out
    keys = {kernel_key(c).key_hash: kernel_key(c) for c in calls}
    samples = {h: [float(10_000 * (i + 1) + j) for j in range(5)] for i, h in enumerate(keys)}
    with Store(db) as store:
        before = {r.key.key_hash: r for r in store.records(measurer.fingerprint())}
    written = record_in_step(Store(db), measurer.fingerprint(), InStepTimes(samples, {}))
    assert written == 2
    with Store(db) as store:
        after = {r.key.key_hash: r for r in store.records(measurer.fingerprint())}
    assert set(after) == set(before) and len(after) == 2
    for h, rec in after.items():
        assert rec.median_ns == statistics.median(samples[h]) and rec.n_runs == 5
        assert rec.p10_ns <= rec.median_ns <= rec.p90_ns
        assert rec.workspace_bytes == before[h].workspace_bytes and rec.host_ns == before[h].host_ns
        assert rec.source == "measured:cpu:in-step" and is_in_step_source(rec.source)
    record_in_step(Store(db), measurer.fingerprint(), InStepTimes(samples, {}))   # again: one suffix
    with Store(db) as store:
        assert {r.source for r in store.records(measurer.fingerprint())} == {"measured:cpu:in-step"}


def _in_step_db(tmp_path, model, x, prices: dict[str, float], host: dict[str, float]):
    """A database with an in-step row per kernel of ``model`` (op name -> price) and the host rows ``host``."""
    _, calls = _program_calls(model, x)
    db = tmp_path / "k.sqlite"
    measurer = Measurer("cpu", target_s=0.002, min_runs=3)
    collect_calls(Store(db), calls, measurer=measurer, progress=False, check_plausible=False)
    keys = {kernel_key(c).key_hash: kernel_key(c) for c in calls}
    samples = {h: [prices[k.op.split(".")[1]]] for h, k in keys.items()}
    record_in_step(Store(db), measurer.fingerprint(), InStepTimes(samples, {}))
    fp = measurer.fingerprint()
    with Store(db) as store:
        store.put_many([Measurement(v, v, v, 1, v, 0, "measured:cpu").record(fp, host_key(e)) for e, v in host.items()])
    return db


def test_in_step_prices_hold_their_switch_and_cold_start(tmp_path):
    """Kernels priced by in-step rows are labelled so and pay neither an op switch nor a cold start (the
    rotation ran the other kernels between their calls); the aliasing ops, not in the rotation, still
    cost alias_op each: the step is the prices plus 4 aliasing ops, by hand."""
    x = torch.randn(64, 128)
    host = {**{e: 0.0 for e in EVENTS}, OP_COLD: 20_000.0, OP_SWITCH: 1_000.0, ALIAS_OP: 2_000.0}
    prices = {"matmul": 50_000.0, "relu": 7_000.0, "sum": 3_000.0}
    db = _in_step_db(tmp_path, ViewsAround(), x, prices, host)
    program = capture(torch.export.export(ViewsAround(), (x,)), options=ProgramOptions(compile=False, target_kind="cpu"))
    report = Analysis(program, get_device("cpu"), AnalyzeOptions("cpu", db=str(db))).evaluate(
        resolve_bindings(program, {})).report
    assert {k.source for k in report.kernels} == {"measured-in-step"}
    assert [k.time_ns for k in report.kernels] == [50_000.0, 7_000.0, 3_000.0]
    assert report.time.cold_start_ns == 0.0
    assert report.time.eager_dispatch_ns == pytest.approx(4 * 2_000.0)
    assert report.time.total_ns == pytest.approx(60_000.0 + 4 * 2_000.0)


def test_collect_for_times_in_step_by_default(capsys, exported, tmp_path):
    """`kernels collect --for` on a CPU writes in-step rows and analyze reports them; --no-in-step keeps the
    isolated rows ("measured")."""
    _, path = exported("mlp")
    db = tmp_path / "cpu.sqlite"
    before = torch.get_num_threads()
    try:
        assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "8", "--db", str(db),
                     "--threads", "1", "--quiet"]) == 0
        assert "(4 timed in step)" in capsys.readouterr().out
        assert main(["analyze", path, "--batch", "8", "--device", "cpu", "--db", str(db), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert {k["source"] for k in report["kernels"]} == {"measured-in-step"}
        plain = tmp_path / "plain.sqlite"
        assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "8", "--db", str(plain),
                     "--threads", "1", "--quiet", "--no-in-step"]) == 0
        assert "timed in step" not in capsys.readouterr().out
        with Store(plain) as store:
            assert {r.source for r in store.records() if r.key.op.startswith("aten")} == {"measured:cpu"}
    finally:
        torch.set_num_threads(before)
