"""Small CLI contracts of issue 14: a reader that closes the pipe early (`boomfx ... | head`) ends the
command quietly, and load errors are the project's user errors."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from boomfx.core.errors import BoomfxError
from boomfx.frontend.loader import LoadError, load_program

PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu-kernel-measurements"   # as test_cli_kernels


def _with_closed_stdout(*argv: str) -> tuple[int, str]:
    """Run ``boomfx argv`` with its stdout a pipe whose reader has already gone (as after `| head -1`)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from boomfx.cli.main import main; sys.exit(main())",
                             *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()       # before the child (still importing) writes a byte
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def test_devices_into_a_closed_pipe_ends_without_a_traceback() -> None:
    code, err = _with_closed_stdout("devices")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 141      # 128 + SIGPIPE, what a shell reports for a writer stopped by `head`


def test_kernels_info_into_a_closed_pipe_ends_without_a_traceback(tmp_path: Path) -> None:
    from boomfx.cli.main import main
    db = tmp_path / "k.sqlite"
    assert main(["kernels", "import", str(PUBLIC), "--device", "p4", "--db", str(db)]) == 0
    code, err = _with_closed_stdout("kernels", "info", "--db", str(db))
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 141


def test_load_error_is_a_boomfx_error(tmp_path: Path) -> None:
    assert issubclass(LoadError, BoomfxError)
    with pytest.raises(BoomfxError, match="does not exist"):
        load_program(tmp_path / "missing.pt2")
