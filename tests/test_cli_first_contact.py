"""Small things a new user trips on (issue 14, item 8): dimension names, the bound label, units,
--version, error prefixes, --optimizer without --train, what --trace writes, --help defaults, -v."""
from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from boomfx.cli.main import main
from boomfx.cli.progress import StageProgress
from boomfx.core.errors import DimError
from boomfx.core.units import fmt_bytes, fmt_time
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.report.model import TimeReport
from boomfx.report.text import bound_label, device_busy_fraction

D_MODEL, D_OUT = 8, 4


class EncDec(torch.nn.Module):
    """Two inputs with their own sequence lengths and a shared batch: enc [B, S_enc, 8], dec [B, S_dec, 8]."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(D_MODEL, D_OUT, bias=False)
        self.dec = torch.nn.Linear(D_MODEL, D_OUT, bias=False)

    def forward(self, enc: torch.Tensor, dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.enc(enc), self.dec(dec)


def _export_enc_dec() -> torch.export.ExportedProgram:
    batch = Dim("batch", max=64)
    dynamic = {"enc": {0: batch, 1: Dim("enc_seq", max=512)}, "dec": {0: batch, 1: Dim("dec_seq", max=512)}}
    return torch.export.export(EncDec(), (torch.randn(2, 5, D_MODEL), torch.randn(2, 3, D_MODEL)),
                               dynamic_shapes=dynamic)


@pytest.fixture(scope="module")
def enc_dec(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.export.ExportedProgram, str]:
    ep = _export_enc_dec()
    path = str(tmp_path_factory.mktemp("encdec") / "encdec.pt2")
    torch.export.save(ep, path)
    return ep, path


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------
# Dimension names
# ---------------------------------------------------------------------------------------------


def test_in_memory_export_keeps_its_dim_names(enc_dec) -> None:
    ep, _ = enc_dec
    program = capture(ep)
    by_name = {n: info.symbol for info in program.symbols.values() for n in info.names}
    # the Dim names given at export, and each input dimension, name the symbol torch chose for it
    enc_val, dec_val = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in ("enc", "dec")]
    assert by_name["batch"] == by_name["enc.0"] == by_name["dec.0"] == enc_val.shape[0].node.expr
    assert by_name["enc_seq"] == by_name["enc.1"] == enc_val.shape[1].node.expr
    assert by_name["dec_seq"] == by_name["dec.1"] == dec_val.shape[1].node.expr
    bindings = resolve_bindings(program, {"batch": 4, "enc_seq": 100, "dec_seq": 7})
    assert bindings == {by_name["batch"]: 4, by_name["enc_seq"]: 100, by_name["dec_seq"]: 7}


def test_pt2_symbols_are_named_by_input_and_dimension(capsys, enc_dec) -> None:
    _, path = enc_dec
    b, s_enc, s_dec = 4, 100, 7
    code, out, err = run(capsys, "analyze", path, "--device", "a100-80gb", "--db", "none", "--json",
                         "--dim", f"dec.0={b}", "--dim", f"enc.1={s_enc}", "--dim", f"dec.1={s_dec}")
    assert code == 0, err
    data = json.loads(out)
    # two bias-free linears: 2 * rows * in * out FLOPs each, rows = B * S of their input
    assert data["time"]["flops"] == 2 * b * s_enc * D_MODEL * D_OUT + 2 * b * s_dec * D_MODEL * D_OUT
    names = {s["name"]: (s["names"], s["value"]) for s in data["symbols"]}
    assert sorted(v for _, v in names.values()) == sorted([b, s_enc, s_dec])
    assert sorted(n for ns, _ in names.values() for n in ns) == ["dec.0", "dec.1", "enc.0", "enc.1"]


def test_unknown_dimension_name_lists_the_valid_ones(enc_dec) -> None:
    _, path = enc_dec
    program = capture(path)
    with pytest.raises(DimError) as err:
        resolve_bindings(program, {"dec_seq": 7})   # a Dim name a .pt2 does not keep
    message = str(err.value)
    assert "unknown dimension 'dec_seq'" in message
    for name in ("enc.0", "dec.0", "enc.1", "dec.1"):
        assert name in message


# ---------------------------------------------------------------------------------------------
# The bound label, units
# ---------------------------------------------------------------------------------------------


def _time(total_ns: float, busy_ns: float) -> TimeReport:
    return TimeReport(total_ns, busy_ns, 0.0, max(0.0, 1 - busy_ns / total_ns), 1, 0.0, 0)


def test_device_bound_only_when_the_device_is_busy_most_of_the_step() -> None:
    assert device_busy_fraction(_time(1000.0, 500.0)) == 0.5
    assert bound_label(_time(1000.0, 500.0)) == "host-bound"      # busy half the step: the host limits it
    assert bound_label(_time(1000.0, 899.0)) == "host-bound"
    assert bound_label(_time(1000.0, 900.0)) == "device-bound"
    assert bound_label(_time(1000.0, 1000.0)) == "device-bound"


def test_summary_prints_the_label_the_timeline_implies(capsys, examples_dir: Path) -> None:
    args = ("analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "2", "--seq", "16", "--db", "none")
    _, out, _ = run(capsys, *args, "--json")
    t = json.loads(out)["time"]
    _, text, _ = run(capsys, *args)
    busy = t["device_busy_ns"] / t["total_ns"]
    expected = "device-bound" if busy >= 0.9 else "host-bound"
    assert f"({expected}: device busy {fmt_time(t['device_busy_ns'])} ({100 * busy:.0f}% of the step)" in text


def test_times_keep_their_sign_and_unit() -> None:
    assert fmt_time(-993413) == "-993.4 us"
    assert fmt_time(-2.5e9) == "-2.500 s"
    assert fmt_time(-12) == "-12 ns"
    assert fmt_time(1500) == "1.5 us"


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def test_version(capsys) -> None:
    import boomfx
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"boomfx {boomfx.__version__} (torch {torch.__version__}")


def test_errors_are_prefixed_once(capsys) -> None:
    code, _, err = run(capsys, "analyze")
    assert code == 2
    assert err == "boomfx: error: analyze: the following arguments are required: file\n"


def test_optimizer_without_train_is_refused(capsys, examples_dir: Path) -> None:
    code, out, err = run(capsys, "analyze", str(examples_dir / "mlp.pt2"), "--batch", "4", "--optimizer", "sgd")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--optimizer needs --train" in err


def test_trace_says_what_it_wrote(capsys, examples_dir: Path, tmp_path: Path) -> None:
    trace, snapshot = tmp_path / "step.json", tmp_path / "mem.pickle"
    code, _, err = run(capsys, "analyze", str(examples_dir / "mlp.pt2"), "--batch", "4", "--db", "none",
                       "--trace", str(trace), "--memory-snapshot", str(snapshot))
    assert code == 0, err
    lines = err.splitlines()
    assert f"boomfx: wrote {trace} ({fmt_bytes(os.path.getsize(trace))}): Chrome/Perfetto trace" in lines[0]
    assert f"boomfx: wrote {snapshot} ({fmt_bytes(os.path.getsize(snapshot))}): memory snapshot" in lines[1]


def test_help_shows_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "(default: a100-80gb)" in text and "(default: 8)" in text and "(default: auto)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_verbose_timing_lines_are_not_interleaved() -> None:
    stream = io.StringIO()
    progress = StageProgress(enabled=True, stream=stream)
    progress.stage("loading")
    progress.log("loaded x.pt2 with the fast path in 0.29 s")
    progress.stage("running the passes")
    progress.done()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and all(line.startswith("[boomfx] ") for line in lines)
    assert lines[0] == "[boomfx] loading..."
    assert lines[1] == "[boomfx]   loaded x.pt2 with the fast path in 0.29 s"
    assert re.fullmatch(r"\[boomfx\] loading: \d+\.\d s", lines[2])
    assert re.fullmatch(r"\[boomfx\] running the passes\.\.\. \d+\.\d s", lines[3])
