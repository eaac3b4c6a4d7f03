"""`boomfx kernels collect|import|export|info` and analysis priced from a collected database."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from boomfx.cli.main import main

PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu-kernel-measurements"


@pytest.fixture(autouse=True)
def _restore_threads():
    """``kernels collect --threads N`` sets the process's thread count; later tests must get theirs back."""
    import torch
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_collect_for_model_then_nothing_left(capsys, exported, tmp_path: Path) -> None:
    _, path = exported("mlp")
    db = tmp_path / "cpu.sqlite"
    assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "16", "--db", str(db),
                 "--threads", "1", "--quiet"]) == 0   # one thread: its CPU-time clock ignores other jobs (busy CI)
    first = capsys.readouterr().out
    assert "measured 4," in first and "failed 0" in first       # 3 linear + 2 relu: relu shapes repeat? see below
    assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "16", "--db", str(db),
                 "--threads", "1", "--quiet"]) == 0   # one thread: its CPU-time clock ignores other jobs (busy CI)
    second = capsys.readouterr().out
    assert "measured 0," in second and "already present 4" in second
    assert main(["analyze", path, "--batch", "16", "--device", "cpu", "--db", str(db), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k["source"] for k in report["kernels"]} == {"measured-in-step"}   # kernels_db/in_step.py
    assert report["by_source"][0]["name"] == "measured-in-step" and report["by_source"][0]["share"] == 1.0


def test_collect_for_a_parallel_plan_measures_every_rank_kernel(capsys, examples_dir, tmp_path: Path) -> None:
    # a TP rank's kernels are the sharded shapes, which the single-device program's collection lacks
    path, db = str(examples_dir / "llama_tiny.pt2"), tmp_path / "cpu.sqlite"
    shape = ["--train", "--batch", "2", "--seq", "16"]
    assert main(["kernels", "collect", "--device", "cpu", "--for", path, *shape, "--parallel", "tp=2", "--db", str(db),
                 "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "of 1 rank classes" in out and "failed 0" in out
    assert "measuring at one thread each" in err        # 2 local ranks: one thread each, as torchrun runs them
    assert main(["analyze", path, *shape, "--parallel", "tp=2", "--device", "cpu", "--db", str(db), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sources = {k["source"] for k in report["kernels"] if k["op"].startswith("aten.")}
    assert sources == {"measured-in-step"}
    assert {k["op"] for k in report["kernels"] if k["source"] != "measured-in-step"} == {
        "_c10d_functional.all_reduce.default"}     # collectives: priced by the collective model or --collectives
    for bad in (["--rank", "1"], ["--compile"]):
        assert main(["kernels", "collect", "--device", "cpu", "--for", path, *shape, "--parallel", "tp=2",
                     "--db", str(db), "--quiet", *bad]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_export_import_round_trip(capsys, exported, tmp_path: Path) -> None:
    _, path = exported("mlp")
    db, csv, db2 = tmp_path / "a.sqlite", tmp_path / "a.csv", tmp_path / "b.sqlite"
    main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "3", "--db", str(db), "--threads", "1",
          "--quiet"])
    assert main(["kernels", "export", str(csv), "--db", str(db)]) == 0
    assert main(["kernels", "import", str(csv), "--db", str(db2)]) == 0
    capsys.readouterr()
    main(["kernels", "info", "--db", str(db2)])
    info = capsys.readouterr().out
    assert "aten.linear.default: 3" in info


@pytest.mark.skipif(not PUBLIC.exists(), reason="the public GPU measurements are not next to this checkout")
def test_import_public_measurements_per_device(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["kernels", "import", str(PUBLIC), "--device", "p4"]) == 0
    out = capsys.readouterr().out
    assert "p4: 1760 new rows of 1760" in out
    assert main(["kernels", "import", str(PUBLIC), "--device", "p4"]) == 0      # idempotent
    assert "p4: 0 new rows of 1760" in capsys.readouterr().out
    assert (tmp_path / "boomfx" / "kernels-p4.sqlite").exists()


def test_bad_kernels_input(capsys, tmp_path: Path) -> None:
    assert main(["kernels", "export", str(tmp_path / "x.csv"), "--db", str(tmp_path / "missing.sqlite")]) == 2
    assert main(["kernels", "collect", "--device", "tpu"]) == 2
    assert main(["kernels", "collect", "--budget", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.count("boomfx: error:") == 3 and "Traceback" not in err


def test_threads_option_is_validated_and_applied(capsys, exported, tmp_path: Path) -> None:
    import torch
    _, path = exported("mlp")
    before = torch.get_num_threads()
    try:
        assert main(["kernels", "collect", "--threads", "0", "--db", str(tmp_path / "x.sqlite")]) == 2
        assert "--threads must be at least 1" in capsys.readouterr().err
        assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "2", "--threads", "1",
                     "--db", str(tmp_path / "t.sqlite"), "--quiet"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    from boomfx.kernels_db.store import Store
    with Store(tmp_path / "t.sqlite") as store:
        assert {fp.num_threads for fp in store.fingerprints()} == {1}


def test_scattered_samples_are_reported(tmp_path: Path) -> None:
    """Many kernels whose p90 is far above their median (descheduled worker threads) get one warning."""
    import dataclasses
    from boomfx.cli.kernels_impl import noisy_measurements_warning
    from boomfx.kernels_db.store import Store
    from test_kernels_db_store import make_record
    records = [make_record(i) for i in range(10)]
    scattered = [dataclasses.replace(r, p90_ns=r.median_ns * 50) for r in records[:4]] + records[4:]
    with Store(tmp_path / "k.sqlite") as store:
        store.put_many(scattered)
    keys = tuple(r.key.key_hash for r in records)
    warning = noisy_measurements_warning(tmp_path / "k.sqlite", keys)
    assert warning is not None and "4 of 10 kernels" in warning and "--threads 1" in warning
    assert noisy_measurements_warning(tmp_path / "k.sqlite", keys[4:]) is None     # the steady ones only
    assert noisy_measurements_warning(tmp_path / "k.sqlite", ()) is None



def test_cli_collects_with_the_validated_protocol(monkeypatch, capsys, exported, tmp_path: Path) -> None:
    """`kernels collect` on CPU measures as benchmarks/cpu_accuracy.py does: a cache flush before each
    sample of a long kernel (sized by effective_cache_bytes, capped) and, with one thread, thread time."""
    import torch
    from boomfx.kernels_db import measure
    made = []
    real = measure.Measurer

    def spy(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(measure, "Measurer", spy)
    monkeypatch.setattr(measure, "effective_cache_bytes", lambda: 1 << 40)
    _, path = exported("mlp")
    before = torch.get_num_threads()
    try:
        assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", "4",
                     "--db", str(tmp_path / "cpu.sqlite"), "--threads", "1", "--quiet"]) == 0
    finally:
        torch.set_num_threads(before)
    assert made == [{"cpu_clock": "thread", "cpu_flush_bytes": measure.PROTOCOL_MAX_FLUSH_BYTES}]
    assert "measured 4," in capsys.readouterr().out


def test_collect_compiled_groups_then_analyze_compiled(capsys, exported, tmp_path: Path) -> None:
    """`kernels collect --for M --compile` measures the library kernels and every fused group, so the
    --compile prediction is measured throughout (no roofline)."""
    _, path = exported("mlp")
    db = tmp_path / "cpu.sqlite"
    args = ["--device", "cpu", "--for", path, "--batch", "8", "--db", str(db), "--quiet", "--compile", "--threads", "1"]
    assert main(["kernels", "collect", *args]) == 0
    out = capsys.readouterr().out
    assert "compiled groups of" in out and "failed 0" in out
    assert main(["analyze", path, "--batch", "8", "--device", "cpu", "--db", str(db), "--compile", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any("fused" in k["op"] for k in report["kernels"])
    # fused groups and library kernels alike timed inside the step (kernels_db/in_step.py)
    assert {k["source"] for k in report["kernels"]} == {"measured-in-step"}


def test_compile_collection_needs_a_program(capsys) -> None:
    assert main(["kernels", "collect", "--device", "cpu", "--compile", "--quiet"]) == 2
    assert "--compile needs --for" in capsys.readouterr().err


def test_fused_groups_are_timed_without_the_custom_op(monkeypatch) -> None:
    """The collector times a compiled group as Inductor's graph calls it: the compiled callable directly,
    not through the ``boomfx::fused`` op and ``run_fused`` (their ~5 us of Python per call is no part of
    a compiled step)."""
    import torch
    from boomfx.frontend.capture import capture, resolve_bindings
    from boomfx.analysis.analysis import Analysis
    from boomfx.core.devices import get_device
    from boomfx.kernels_db.collect_fused import FusedMeasurer, fused_calls
    from boomfx.kernels_db.keys import kernel_key, make_inputs
    from boomfx.passes import fused_op
    from boomfx.core.program import ProgramOptions

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * 2.0 + 1.0

    program = capture(torch.export.export(Chain(), (torch.randn(16),)),
                      options=ProgramOptions(compile=True, target_kind="cpu"))
    analysis = Analysis(program, get_device("cpu"))
    key = kernel_key(fused_calls(analysis, resolve_bindings(program, {}))[0])
    op, args, kwargs = make_inputs(key, torch.device("cpu"))
    expected = op(*args, **kwargs)[0]
    monkeypatch.setattr(fused_op, "run_fused", lambda *a: (_ for _ in ()).throw(AssertionError("via the op")))
    out = FusedMeasurer.timed_call(op, args, kwargs)()
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert torch.equal(out, expected)
