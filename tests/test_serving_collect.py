"""``boomfx serve --collect`` (boomfx/serving/collect.py): the serving steps' own kernels measured on this
machine and priced from those rows; ``--kv-write concat`` (transformers' DynamicCache) from the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from boomfx.cli.main import main
from boomfx.core.devices import cpu_spec
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.store import Store
from boomfx.serving.serve import report_steps, setup
from boomfx.serving.steps import Step

OPTIONS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
ARGS = ["--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
        "--input-len", "32", "--output-len", "8"]


@pytest.fixture(scope="module")
def collected(tmp_path_factory, examples_dir: Path) -> tuple[str, Path, dict, set]:
    """The CLI run, and the kernels its collection refused as implausible (a loaded test host can slow
    a tiny kernel past the plausibility bound; those are priced by the model, and the CLI says so)."""
    from boomfx.serving import collect
    refused: set = set()
    original = collect.collect_serving

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        refused.update(result.refused)
        return result
    path = str(examples_dir / "llama_tiny.pt2")
    tmp = tmp_path_factory.mktemp("serve_collect")
    db, out = tmp / "serve.sqlite", tmp / "report.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(collect, "collect_serving", recording)
        assert main(["serve", path, *ARGS, "--collect", "--db", str(db), "--json", str(out)]) == 0
    return path, db, json.loads(out.read_text()), refused


def test_every_kernel_of_the_reported_steps_has_its_row(collected) -> None:
    """The database holds each call the report's prefill and decode steps price (their kernel keys,
    computed here from the steps independently of the collection), measured on this host."""
    path, db, report, refused = collected
    s = setup(capture(path, options=ProgramOptions(target_kind="cpu")), cpu_spec(), db=str(db), **OPTIONS)
    steps = report_steps(s, 32, 8)
    assert [len(st.decode_contexts) for st in steps] == [0, 1, 4]          # one prefill chunk; decode 1, 4
    with Store(db) as store:
        held = {h for fp in store.fingerprints() for h in store.key_hashes(fp)}
    pricer = s.pricer()
    wanted = {kernel_key(call).key_hash for step in steps for call in pricer.kernel_calls(step)}
    assert wanted and wanted <= held | refused and len(refused) < len(wanted) / 4


def test_the_report_is_priced_from_the_collected_rows(collected) -> None:
    path, db, report, refused = collected
    s = setup(capture(path, options=ProgramOptions(target_kind="cpu")), cpu_spec(), db=str(db), **OPTIONS)
    pricer = s.pricer()
    allowed = ("measured", "interpolated", "model") if refused else ("measured",)   # refused: from other rows
    for step in report_steps(s, 32, 8):
        parts = pricer.step_time(step).parts
        sources = {src for name, part in parts.items() if name != "host_overhead" for src in part.sources}
        assert sources and all(src.startswith(allowed) for src in sources), sources
        assert any(src.startswith("measured") for src in sources)
    # the JSON report's steps are the same steps at the same prices
    priced = [pricer.step_time(step).total_ns for step in report_steps(s, 32, 8)]
    assert [row["time_ns"] for row in report["steps"]] == pytest.approx(priced)


def test_collect_refuses_a_gpu_target_without_its_gpu(capsys, tmp_path, examples_dir: Path) -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --collect would measure on it")
    code = main(["serve", str(examples_dir / "llama_tiny.pt2"), "--device", "h100-80gb", "--collect",
                 "--db", str(tmp_path / "x.sqlite")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "needs its GPU here" in err
    assert not (tmp_path / "x.sqlite").exists()


def test_cli_kv_write_concat_copies_the_cache_every_step(capsys, examples_dir: Path) -> None:
    """transformers' DynamicCache concatenates: its write grows with the context; the engine's paged write
    stores the new token's row only."""
    f = str(examples_dir / "llama_tiny.pt2")
    parts = {}
    for rule in ("paged", "concat"):
        assert main(["serve", f, "--device", "h100-80gb", "--db", "none", "--max-model-len", "1024",
                     "--kv-write", rule, "--sweep", "--json", "-"]) == 0
        report = json.loads(capsys.readouterr().out)
        parts[rule] = {(r["batch"], r["context"]): r["parts_ns"]["kv_cache_write"] for r in report["steps"]}
        assert any("--kv-write concat" in w for w in report["warnings"]) == (rule == "concat")
    contexts = sorted(ctx for batch, ctx in parts["concat"] if batch == 1)
    short, long = contexts[0], contexts[-1]
    assert long > short
    assert parts["concat"][(1, long)] > parts["concat"][(1, short)]
    assert parts["concat"][(1, long)] > parts["paged"][(1, long)]


def test_report_steps_are_the_priced_rows() -> None:
    """``step_rows`` prices exactly ``report_steps``: one prefill chunk per token budget, then the decode batches."""
    from types import SimpleNamespace
    s = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=100, max_model_len=512, max_num_seqs=8))
    steps = report_steps(s, 250, 10)
    assert steps[:3] == [Step((), ((100, 100),)), Step((), ((100, 200),)), Step((), ((50, 250),))]
    assert [len(st.decode_contexts) for st in steps[3:]] == [1, 8] and steps[3].decode_contexts == (255,)


def _db_with_module_call(path: Path, ns: float) -> Path:
    from boomfx.kernels_db.host_overheads import MODULE_CALL, host_key
    from boomfx.kernels_db.measure import Measurement, Measurer
    measurer = Measurer("cpu")
    with Store(path) as store:
        store.put(Measurement(ns, ns, ns, 2, ns, 0, "measured:cpu").record(measurer.fingerprint(), host_key(MODULE_CALL)))
    return path


def test_concat_rule_prices_the_stored_python_per_module_call(tmp_path, examples_dir: Path) -> None:
    """Under --kv-write concat a step pays the measured Python per module call times the module calls the
    export traced; the engine's rule does not."""
    from boomfx.serving.steps import KV_WRITE_CONCAT
    db = _db_with_module_call(tmp_path / "m.sqlite", 10_000.0)
    program = capture(str(examples_dir / "llama_tiny.pt2"), options=ProgramOptions(target_kind="cpu"))
    s = setup(program, cpu_spec(), db=str(db), **OPTIONS)
    step = Step((16,))
    concat = s.pricer(kv_write=KV_WRITE_CONCAT).step_time(step).parts["host_overhead"]
    assert s.model.module_calls > 0 and concat.device_ns == pytest.approx(10_000.0 * s.model.module_calls)
    assert s.pricer().step_time(step).parts["host_overhead"].device_ns == 0.0


def test_module_call_collected_once(tmp_path, monkeypatch) -> None:
    from boomfx.kernels_db.measure import Measurer
    from boomfx.serving import host_overhead
    runs = []
    monkeypatch.setattr(host_overhead, "measure_module_call_ns", lambda *a, **k: runs.append(1) or (4_000.0, []))
    path = tmp_path / "c.sqlite"
    assert host_overhead.collect_module_call(Store(path), Measurer("cpu")) == 4_000.0
    assert host_overhead.collect_module_call(Store(path), Measurer("cpu")) == 4_000.0 and len(runs) == 1
    with Store(path) as store:
        records = [r for fp in store.fingerprints() for r in store.records(fp)]
    from boomfx.kernels_db.host_overheads import MODULE_CALL, stored_ns
    assert stored_ns({r.key.key_hash: r for r in records}, MODULE_CALL) == 4_000.0


def test_module_call_measured_on_calibration_llamas() -> None:
    """The real calibration: both Llamas' steps priced from kernels measured here and timed for real; the
    deeper one traces more module calls; the per-call cost is their gaps over their calls, never negative.
    (Its size is a timing, checked by benchmarks/serving_cpu.py: under a loaded test run the two gaps can
    sum below zero.)"""
    pytest.importorskip("transformers")
    from boomfx.serving.host_overhead import CALIBRATION_LAYERS, measure_module_call_ns
    per_call, rows = measure_module_call_ns(iters=7)
    assert [r["layers"] for r in rows] == list(CALIBRATION_LAYERS)
    assert rows[0]["module_calls"] < rows[1]["module_calls"]
    assert all(r["real_ns"] > 0 and r["pred_ns"] > 0 for r in rows)
    assert all(r["gap_ns"] == pytest.approx(r["real_ns"] - r["pred_ns"]) for r in rows)
    gaps = sum(r["gap_ns"] for r in rows) / sum(r["module_calls"] for r in rows)
    assert per_call == pytest.approx(max(gaps, 0.0))


def test_cli_collect_concat_charges_the_measured_python(tmp_path, monkeypatch, examples_dir: Path) -> None:
    """``serve --collect --kv-write concat`` on a CPU stores transformers' Python per module call (the
    calibration replaced by a fixed 5 us here) and every reported step pays it per module call."""
    from boomfx.serving import host_overhead
    monkeypatch.setattr(host_overhead, "measure_module_call_ns", lambda *a, **k: (5_000.0, []))
    f = str(examples_dir / "llama_tiny.pt2")
    out = tmp_path / "r.json"
    assert main(["serve", f, *ARGS, "--collect", "--kv-write", "concat", "--db", str(tmp_path / "c.sqlite"),
                 "--json", str(out)]) == 0
    calls = setup(capture(f, options=ProgramOptions(target_kind="cpu")), cpu_spec(), db=None, **OPTIONS).model.module_calls
    steps = json.loads(out.read_text())["steps"]
    assert steps and all(row["parts_ns"]["host_overhead"] == pytest.approx(5_000.0 * calls) for row in steps)
