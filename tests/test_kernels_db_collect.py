"""Collection contracts: every kernel of a real graph gets a row, reruns measure nothing, a killed
collection leaves a valid DB and resumes with only the missing kernels, budgets stop early."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from torch.export import Dim

from boomfx.kernels_db.collect import calls_from_graph, collect_calls, collect_sweep, sweep_calls, unique_keys
from boomfx.kernels_db.collectors import FAMILIES, build_call, family, spec
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.measure import Measurement, Measurer
from boomfx.kernels_db.progress import Progress
from boomfx.kernels_db.store import Store

aten = torch.ops.aten


def fast_measurer() -> Measurer:
    # one thread timed by its CPU time: other jobs on a busy machine do not make its rows implausible
    return Measurer("cpu", warmup_s=0.0, target_s=0.001, min_runs=3, min_sample_ns=20_000, num_threads=1,
                    cpu_clock="thread")


class CountingMeasurer(Measurer):
    """Records which keys it was asked for and returns a fixed measurement (no kernels run)."""

    def __init__(self) -> None:
        super().__init__("cpu", num_threads=1)
        self.seen: list[str] = []

    def measure(self, key):  # type: ignore[override]
        self.seen.append(key.key_hash)
        return Measurement(1000.0, 900.0, 1100.0, 3, 500.0, 0, "measured:cpu")


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Softmax(-1)
    )


def test_tiny_mlp_every_kernel_gets_a_row_and_rerun_measures_nothing(tmp_path: Path) -> None:
    ep = torch.export.export(mlp(), (torch.randn(4, 16),))
    calls = calls_from_graph(ep.graph_module)
    assert {c.op for c in calls} >= {aten.linear.default, aten.relu.default}
    measurer = fast_measurer()
    with Store(tmp_path / "k.sqlite") as store:
        first = collect_calls(store, calls, measurer=measurer, progress=False)
        keys = unique_keys(calls)
        assert first.failed == () and first.measured == len(keys)
        fp = measurer.fingerprint()
        assert all(store.get(fp, k.key_hash) is not None for k in keys)
        second = collect_calls(store, calls, measurer=measurer, progress=False)
        assert (second.measured, second.skipped) == (0, len(keys))


def test_symbolic_export_bound_to_ints(tmp_path: Path) -> None:
    ep = torch.export.export(mlp(), (torch.randn(4, 16),), dynamic_shapes=({0: Dim("batch")},))
    (batch,) = ep.range_constraints
    calls = calls_from_graph(ep.graph_module, {batch: 8})
    linear = next(c for c in calls if c.op is aten.linear.default)
    assert kernel_key(linear).data["tensors"][0]["shape"] == [8, 16]
    with Store(tmp_path / "k.sqlite") as store:
        result = collect_calls(store, calls, measurer=CountingMeasurer(), progress=False)
        assert result.measured == len(unique_keys(calls))


def test_budget_stops_early_and_rerun_finishes(tmp_path: Path) -> None:
    calls = [build_call(aten.relu.default, (spec((n,), torch.float32),)) for n in range(1, 11)]
    with Store(tmp_path / "k.sqlite") as store:
        partial = collect_calls(store, calls, budget_s=0.0, measurer=CountingMeasurer(), progress=False)
        assert (partial.measured, partial.pending) == (0, 10)
        rest = collect_calls(store, calls, measurer=CountingMeasurer(), progress=False)
        assert rest.measured == 10


def test_failing_kernel_is_reported_not_stored(tmp_path: Path) -> None:
    bad = build_call(aten.view.default, (spec((4096,), torch.float32), [64, 64]))

    class Broken(CountingMeasurer):
        def measure(self, key):  # type: ignore[override]
            raise RuntimeError("synthetic failure")

    with Store(tmp_path / "k.sqlite") as store:
        result = collect_calls(store, [bad], measurer=Broken(), progress=False)
        assert result.measured == 0 and len(result.failed) == 1 and "synthetic" in result.failed[0][1]
        assert store.count() == 0


def test_tiny_sweep_covers_every_family(tmp_path: Path) -> None:
    calls = sweep_calls(None, (torch.float32,), "tiny")
    ops = {c.op.overloadpacket for c in calls}
    assert {
        aten.mm,
        aten.relu,
        aten.sum,
        aten.convolution,
        aten.scaled_dot_product_attention,
        aten.embedding,
    } <= ops
    assert all(callable(family(name).configs) and callable(family(name).make_call) for name in FAMILIES)
    with Store(tmp_path / "k.sqlite") as store:
        result = collect_sweep(
            store,
            "cpu",
            families=["pointwise", "generic"],
            grid="tiny",
            measurer=fast_measurer(),
            progress=False,
        )
        assert result.failed == () and result.measured == store.count() > 0


_KILLED_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from boomfx.kernels_db.collect import collect_calls
    from boomfx.kernels_db.collectors import build_call, spec
    from boomfx.kernels_db.measure import Measurer
    from boomfx.kernels_db.store import Store
    calls = [build_call(torch.ops.aten.relu.default, (spec((n,), torch.float32),)) for n in range(1, 81)]
    m = Measurer("cpu", target_s=0.05, min_runs=3, num_threads=1, measure_workspace=False)
    with Store(sys.argv[1]) as store:
        collect_calls(store, calls, measurer=m, progress=False)
"""
)


def test_killed_collection_resumes_with_only_missing_kernels(tmp_path: Path) -> None:
    db = tmp_path / "k.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SCRIPT, str(db)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    rows = 0
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if db.exists():
                with Store(db) as store:
                    rows = store.count()
                if rows >= 3:
                    break
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 3 <= rows < 80, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
    calls = [build_call(aten.relu.default, (spec((n,), torch.float32),)) for n in range(1, 81)]
    resume = CountingMeasurer()
    with Store(db) as store:
        assert store.integrity_ok()
        present = store.key_hashes(resume.fingerprint())
        assert len(present) >= rows
        result = collect_calls(store, calls, measurer=resume, progress=False)
        assert result.measured == 80 - len(present) == len(resume.seen)
        assert not present & set(resume.seen)
        assert store.count() == 80


def test_progress_bar_eta_and_quiet_mode() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = Progress(4, desc="collect", stream=out, enabled=True, min_interval_s=0.0, clock=lambda: now[0])
    now[0] = 2.0
    bar.update(note="aten.mm.default")
    # 1 of 4 done in 2 s -> 3 left at 2 s each = 6 s
    assert bar.eta_s() == 6.0
    assert "1/4" in out.getvalue() and "0:02<0:06" in out.getvalue() and "aten.mm.default" in out.getvalue()
    quiet = io.StringIO()
    Progress(4, stream=quiet).update()  # StringIO is not a tty: quiet by default
    assert quiet.getvalue() == ""
