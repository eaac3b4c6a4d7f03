"""``boomfx validate`` and ``kernels collect`` on a .pt2 that calls a library's custom op (transformers' MoE
fallback), run as the CLI runs them: in a process that never imported the library.

Truth: torch's profiler over the real step (which op classes ran, how many calls), the database's rows, and
the exit status and one line a user sees when the op's library is not known."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from boomfx.kernels_db.calibration import op_class, op_class_of
from boomfx.passes.eager_grouped_mm import has_cpu_grouped_mm

FALLBACK, BACKWARD = "transformers::grouped_mm_fallback", "transformers::grouped_mm_fallback_backward"
MOE_MODULE = "transformers.integrations.moe"


def _cli(argv: list[str], imported: bool) -> None:
    """``boomfx <argv>`` in a fresh process; ``imported``: whether transformers' MoE module is loaded after."""
    script = textwrap.dedent(f"""
        import sys
        from boomfx.cli.main import main
        code = main({argv!r})
        assert ({MOE_MODULE!r} in sys.modules) is {imported!r}, sorted(m for m in sys.modules if "transformers" in m)
        sys.exit(code)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)


def _ops(path: Path) -> dict[str, tuple[int, int]]:
    return {o["op"]: (o["predicted_calls"], o["measured_calls"]) for o in json.loads(path.read_text())["ops"]}


@pytest.mark.skipif(not has_cpu_grouped_mm(), reason="this torch has no CPU _grouped_mm")
def test_validate_of_moe_inference_runs_and_prices_the_product_the_eager_model_calls(zoo, tmp_path: Path) -> None:
    """Before: the real step called the fallback's stand-in (an internal error without transformers) and,
    with it imported, the prediction priced a fallback the database from ``collect --for`` never measured.
    Now both sides run torch's ``_grouped_mm`` (2 layers x gate_up, down), no library import needed."""
    _, path = zoo("mixtral", "cpu")
    out = tmp_path / "v.json"
    _cli(["validate", path, "--device", "cpu", "--db", "none", "--repeats", "2", "--warmup", "1",
          "--json", str(out)], imported=False)
    ops = _ops(out)
    assert ops["_grouped_mm"] == (4, 4)
    assert not [op for op in ops if "fallback" in op]


def test_validate_of_moe_training_imports_the_library_and_matches_its_ops(zoo, tmp_path: Path) -> None:
    """Training keeps the traced fallback (passes/eager_grouped_mm.py): the real step needs transformers' op
    and its backward, so the library that registers them is imported and the file read again; the profiled
    step's op classes are the predicted ones, call for call (forward and backward of 2 layers x 2)."""
    _, path = zoo("mixtral", "cpu")
    out = tmp_path / "v.json"
    _cli(["validate", path, "--device", "cpu", "--train", "--db", "none", "--repeats", "2", "--warmup", "1",
          "--json", str(out)], imported=True)
    ops = _ops(out)
    assert ops[FALLBACK] == (4, 4)
    assert ops[BACKWARD] == (4, 4)
    assert "fused" not in ops


def test_collect_for_moe_training_measures_the_library_op(zoo, tmp_path: Path) -> None:
    """A stand-in cannot run, so ``collect --for --train`` measured none of the fallback's calls; with its
    library imported the database holds the forward and backward ops, measured, none failed."""
    _, path = zoo("mixtral", "cpu")
    db = tmp_path / "k.db"
    _cli(["kernels", "collect", "--device", "cpu", "--for", path, "--train", "--batch", "2", "--seq", "16", "--db",
          str(db), "--quiet"],
         imported=True)
    with sqlite3.connect(db) as conn:
        ops = {row[0] for row in conn.execute("SELECT DISTINCT op FROM kernels")}
    assert {"transformers.grouped_mm_fallback.default", "transformers.grouped_mm_fallback_backward.default"} <= ops


def test_validate_refuses_in_one_line_an_op_whose_library_it_does_not_know(capsys, tmp_path: Path) -> None:
    """A custom op of a library boomfx has no registering module for cannot run: exit 2, one line naming it."""
    from test_foreign_ops import NAMESPACE, _WRITER

    from boomfx.cli.main import main
    path = tmp_path / "custom.pt2"
    subprocess.run([sys.executable, "-c", _WRITER, str(path)], check=True, timeout=120)
    assert main(["validate", str(path), "--device", "cpu", "--db", "none", "--repeats", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{NAMESPACE}::scaled_proj" in err and "no implementation" in err


@pytest.mark.parametrize("text, expected", [
    ("aten::addmm", "addmm"), ("aten.addmm.default", "addmm"),
    ("transformers::grouped_mm_fallback", FALLBACK), ("transformers.grouped_mm_fallback.default", FALLBACK),
    ("autograd::engine::evaluate_function: MmBackward0", None), ("Optimizer.step#AdamW.step", None),
    ("boomfx.fused.default", None), ("ProfilerStep#1", None), ("[memory]", None),
])
def test_op_classes_of_profiler_events_and_priced_kernels(text: str, expected) -> None:
    """The profiler's and the priced kernel's spelling of one op land in one class (validate's table and
    the in-situ calibration both key on it); profiler ranges are not op classes."""
    assert op_class(text) == expected
    assert op_class_of(text) == (expected or text)


def test_eager_forms_of_a_traced_op_are_charged_to_it() -> None:
    """A traced training graph holds the functional ``index_put`` where eager autograd (IndexBackward0) calls
    ``_index_put_impl_``, and ``index_put_`` where the user wrote it: the profiled step charges both to the op
    class the prediction holds (they were two rows, predicted-only and in-situ-only)."""
    import torch

    from boomfx.validate.measure import profile_ops

    x = torch.randn(64, 32, requires_grad=True)
    idx = torch.randint(0, 64, (128,))

    def step() -> None:
        x[idx].sum().backward()
        torch.zeros(64).index_put_((idx,), torch.ones(128), accumulate=True)

    measured = {o.op: o.calls for o in profile_ops(step, {"index", "index_put"}, torch.device("cpu")).ops}
    assert measured["index_put"] == 2
    assert "_index_put_impl_" not in measured and "index_put_" not in measured
