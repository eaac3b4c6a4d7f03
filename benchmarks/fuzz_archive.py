"""Feed 10,000 damaged copies of the shipped examples to ``boomfx analyze``; count how each one ended.

Every mutant (``benchmarks/archive_mutations.py``) is analysed by the CLI in-process
(``boomfx.cli.main.main``). It must end in one of two ways:

- ``ok``: exit 0. Its numbers are compared with the undamaged file's: ``ok-same`` or ``ok-changed``
  (a change the file's own data explains, e.g. a changed exported range; listed so a reader can check
  that none is a silently wrong number);
- ``refused``: exit 2 and exactly one line on stderr, counted by error type and, for a ``LoadError``,
  by the archive entry its message names.

Anything else is a failure: an exception escaping ``main`` (a traceback: the runs set
``BOOMFX_TRACEBACK=1``, so a bug the CLI would print as its one ``internal error`` line escapes with
where it happened; that line is a failure too), exit 2 with more or fewer
than one line, another exit status, a mutant running past ``--timeout-s``, or the worker process
dying. Mutants run in worker processes of ``--chunk`` mutants each, ``--jobs`` at a time (a crash
costs one mutant, not the run). Results: ``benchmarks/results/fuzz_archive.{json,md}``.

Usage: ``python benchmarks/fuzz_archive.py [--mutants 10000] [--seed 0]``
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from archive_mutations import mutant  # noqa: E402

# The shipped examples, how often each is drawn (the small ones are cheaper per mutant) and the
# options that bind their symbols.
EXAMPLES = {
    "mlp.pt2": (3, ["--batch", "4"]),
    "gpt_tiny.pt2": (3, ["--batch", "2", "--seq", "16"]),
    "llama_tiny.pt2": (2, ["--batch", "2", "--seq", "16"]),
    "gpt2_small.pt2": (1, ["--batch", "1", "--seq", "16"]),
}
ANALYZE_OPTIONS = ["--device", "a100-80gb", "--db", "none", "--json"]
# Numbers compared between a mutant and its undamaged file.
FINGERPRINT_FIELDS = (("time", "total_ns"), ("time", "flops"), ("time", "bytes_moved"), ("time", "kernels"),
                      ("memory", "peak_live_bytes"), ("memory", "total_device_bytes"))


class MutantTimeout(BaseException):
    """Raised by the alarm inside a mutant that runs too long (BaseException: no handler swallows it)."""


@dataclass
class Outcome:
    """How one mutant ended."""

    index: int
    example: str
    kind: str
    entry: str
    detail: str
    status: str                     # ok-same | ok-changed | refused | traceback | internal | bad-output | timeout | crash
    error_type: str = ""            # of a refusal or an escaped exception
    message: str = ""               # the stderr line, or the exception's last frame and text
    named_entry: str = ""           # the archive entry a refusal names ("" when none)


def _example_for(seed: int, index: int) -> str:
    import random
    names = list(EXAMPLES)
    return random.Random(f"example:{seed}:{index}").choices(names, weights=[EXAMPLES[n][0] for n in names])[0]


def run_cli(path: str, options: list[str]) -> tuple[int, str, str, Optional[BaseException], str]:
    """``boomfx analyze path options`` in-process: (exit code, stdout, stderr, escaped exception, error type).

    The error type of a refusal is recorded by wrapping ``boomfx.cli.main._user_error_message``, which
    sees every exception the CLI turns into its one line.
    """
    from boomfx.cli import main as cli
    before = os.environ.get(cli.TRACEBACK_ENV)
    os.environ[cli.TRACEBACK_ENV] = "1"      # a bug escapes with its frame instead of the CLI's one line
    seen: list[str] = []
    original = cli._user_error_message

    def recording(exc: BaseException) -> Optional[str]:
        seen.append(type(exc).__name__)
        return original(exc)

    out, err = io.StringIO(), io.StringIO()
    cli._user_error_message = recording
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["analyze", path, *ANALYZE_OPTIONS, *options])
        escaped = None
    except MutantTimeout:
        raise
    except BaseException as exc:  # noqa: BLE001  what this benchmark counts
        code, escaped = -1, exc
    finally:
        cli._user_error_message = original
        if before is None:
            os.environ.pop(cli.TRACEBACK_ENV, None)
        else:
            os.environ[cli.TRACEBACK_ENV] = before
    return code, out.getvalue(), err.getvalue(), escaped, seen[-1] if seen else ""


def fingerprint(stdout: str) -> tuple:
    data = json.loads(stdout)
    return tuple(data[a][b] for a, b in FINGERPRINT_FIELDS)


def archive_entries(archive: bytes) -> list[str]:
    """The entry names a refusal may name: each entry without its root folder, and the zip directory."""
    from archive_mutations import read_entries
    return sorted({n.split("/", 1)[1] for n, _ in read_entries(archive) if "/" in n} | {"the zip directory"})


def _named_entry(message: str, entries: list[str]) -> str:
    """The longest archive entry name (without its root folder) that the message mentions."""
    hits = [e for e in entries if e and re.search(re.escape(e) + r"(?![\w.])", message)]
    return max(hits, key=len) if hits else ""


def classify(index: int, example: str, m: Any, result: tuple, baseline: tuple, entries: list[str]) -> Outcome:
    code, stdout, stderr, escaped, error_type = result
    base = Outcome(index, example, m.kind, m.entry, m.detail, "")
    if escaped is not None:
        frame = traceback.extract_tb(escaped.__traceback__)[-1]
        text = str(escaped).strip().splitlines()
        base.status, base.error_type = "traceback", type(escaped).__name__
        base.message = f"{Path(frame.filename).name}:{frame.lineno} {text[0][:200] if text else ''}"
        return base
    lines = stderr.strip("\n").splitlines()
    if code == 0:
        try:
            same = fingerprint(stdout) == baseline
        except (ValueError, KeyError, TypeError):
            base.status, base.message = "bad-output", "exit 0 without a JSON report"
            return base
        base.status = "ok-same" if same else "ok-changed"
        return base
    if code == 2 and len(lines) == 1 and lines[0].startswith("boomfx: error: "):
        base.status, base.error_type, base.message = "refused", error_type, lines[0][:300]
        base.named_entry = _named_entry(lines[0], entries)
        return base
    if code == 70 and len(lines) == 1 and lines[0].startswith("boomfx: internal error: "):
        base.status, base.message = "internal", lines[0][:300]     # a bug the CLI caught: still a failure
        base.error_type = lines[0].removeprefix("boomfx: internal error: ").split(":", 1)[0]
        return base
    base.status, base.error_type = "bad-output", error_type
    base.message = f"exit {code}, {len(lines)} stderr lines: {' | '.join(lines)[:300]}"
    return base


# ---------------------------------------------------------------------------------------------
# Worker: runs mutants [start, stop) and appends one JSON line per mutant to a file.
# ---------------------------------------------------------------------------------------------


def _on_alarm(signum: int, frame: Any) -> None:
    raise MutantTimeout()


def run_mutants(seed: int, indices: range, timeout_s: int, sink: Any) -> None:
    sources = {name: (ROOT / "examples" / name).read_bytes() for name in EXAMPLES}
    root_free = {name: archive_entries(data) for name, data in sources.items()}
    baselines = {}
    signal.signal(signal.SIGALRM, _on_alarm)
    with tempfile.TemporaryDirectory() as tmp:
        for name in EXAMPLES:
            code, stdout, stderr, escaped, _ = run_cli(str(ROOT / "examples" / name), EXAMPLES[name][1])
            if code != 0:
                raise RuntimeError(f"the undamaged {name} fails: {stderr or escaped}")
            baselines[name] = fingerprint(stdout)
        for index in indices:
            example = _example_for(seed, index)
            m = mutant(sources[example], seed, index)
            path = os.path.join(tmp, example)
            with open(path, "wb") as f:
                f.write(m.data)
            signal.alarm(timeout_s)
            try:
                result = run_cli(path, EXAMPLES[example][1])
                outcome = classify(index, example, m, result, baselines[example], root_free[example])
            except MutantTimeout:
                outcome = Outcome(index, example, m.kind, m.entry, m.detail, "timeout")
            finally:
                signal.alarm(0)
            sink.write(json.dumps(asdict(outcome)) + "\n")
            sink.flush()


# ---------------------------------------------------------------------------------------------
# Parent: chunks of mutants in worker processes, then the summary.
# ---------------------------------------------------------------------------------------------


def _run_all(seed: int, n: int, chunk: int, timeout_s: int, log_path: Path, jobs: int) -> list[dict]:
    """Run mutants [0, n) in worker processes, ``jobs`` at a time; a worker that dies costs one mutant."""
    done: dict[int, dict] = {}
    pending = [(start, min(n, start + chunk)) for start in range(0, n, chunk)]
    running: list[tuple[subprocess.Popen, int, int, Path]] = []
    serial = 0
    while pending or running:
        while pending and len(running) < jobs:
            start, stop = pending.pop(0)
            sink = log_path.with_name(f"{log_path.stem}.{serial}.jsonl")
            serial += 1
            sink.write_text("")
            proc = subprocess.Popen([sys.executable, __file__, "--worker", "--seed", str(seed), "--start",
                                     str(start), "--stop", str(stop), "--timeout-s", str(timeout_s), "--sink",
                                     str(sink)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            running.append((proc, start, stop, sink))
        proc, start, stop, sink = running.pop(0)
        _, stderr = proc.communicate()
        rows = [json.loads(line) for line in sink.read_text().splitlines() if line.strip()]
        sink.unlink()
        for row in rows:
            done[row["index"]] = row
        finished = start + len(rows)
        if finished < stop:
            # the worker died in mutant `finished`: record it and go on after it
            example = _example_for(seed, finished)
            m = mutant((ROOT / "examples" / example).read_bytes(), seed, finished)
            tail = stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            done[finished] = asdict(Outcome(finished, example, m.kind, m.entry, m.detail, "crash",
                                            message=tail[0][:300]))
            if finished + 1 < stop:
                pending.insert(0, (finished + 1, stop))
        print(f"{len(done)}/{n} mutants", file=sys.stderr, flush=True)
    with open(log_path, "w") as f:
        for i in sorted(done):
            f.write(json.dumps(done[i]) + "\n")
    return [done[i] for i in sorted(done)]


FAILURES = ("traceback", "internal", "bad-output", "timeout", "crash")


def _torch_version() -> str:
    import torch
    return torch.__version__


def summarize(rows: list[dict], seed: int, seconds: float) -> dict:
    status = collections.Counter(r["status"] for r in rows)
    refused = [r for r in rows if r["status"] == "refused"]
    load_errors = collections.Counter(r["named_entry"] or "(no entry named)" for r in refused
                                      if r["error_type"] == "LoadError")
    other_refusals = collections.Counter(r["error_type"] for r in refused if r["error_type"] != "LoadError")
    failures = [r for r in rows if r["status"] in FAILURES]
    failure_types = collections.Counter(f"{r['status']}: {r['error_type'] or '-'}" for r in failures)
    return {
        "seed": seed, "mutants": len(rows), "seconds": round(seconds, 1), "loadavg": list(os.getloadavg()),
        "torch": _torch_version(),
        "by_status": dict(status.most_common()),
        "tracebacks": status.get("traceback", 0),
        "failures": len(failures),
        "load_error_by_entry": dict(load_errors.most_common()),
        "other_refusals_by_type": dict(other_refusals.most_common()),
        "failures_by_type": dict(failure_types.most_common()),
        "by_kind": {k: dict(collections.Counter(r["status"] for r in rows if r["kind"] == k))
                    for k in sorted({r["kind"] for r in rows})},
        "failure_examples": failures[:50],
        "ok_changed_examples": [r for r in rows if r["status"] == "ok-changed"][:50],
    }


def _markdown(s: dict) -> str:
    lines = ["# Damaged .pt2 files (benchmarks/fuzz_archive.py)", "",
             f"{s['mutants']} mutants of the shipped examples (seed {s['seed']}), {s['seconds']} s, "
             f"load average {', '.join(f'{x:.1f}' for x in s['loadavg'])}.", "",
             f"**Tracebacks: {s['tracebacks']}; all failures (traceback, not one line, timeout, crash): "
             f"{s['failures']}.**", "", "| how it ended | mutants |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in s["by_status"].items()]
    lines += ["", "`ok-same`: analysed, same numbers as the undamaged file (the damage hit metadata, sample "
              "inputs, padding). `ok-changed`: analysed, different numbers; each is listed in "
              "`ok_changed_examples` of the JSON to check that the edit describes another consistent program "
              "(e.g. a linear whose bias argument was removed), not a wrong number from an inconsistent one."]
    lines += ["", "LoadError by the archive entry it names:", "", "| entry | mutants |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in s["load_error_by_entry"].items()]
    lines += ["", "Other refusals (one line, exit 2) by error type:", "", "| type | mutants |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in s["other_refusals_by_type"].items()]
    if s["failures_by_type"]:
        lines += ["", "Failures:", "", "| failure | mutants |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in s["failures_by_type"].items()]
    lines += ["", "By mutation kind:", "", "| kind | " + " | ".join(["ok-same", "ok-changed", "refused", *FAILURES])
              + " |", "|---" * 8 + "|"]
    for kind, counts in s["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(counts.get(c, 0)) for c in
                                                 ["ok-same", "ok-changed", "refused", *FAILURES]) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mutants", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=500, help="mutants per worker process")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    p.add_argument("--timeout-s", type=int, default=60, help="per mutant")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_archive"))
    p.add_argument("--keep-rows", action="store_true", help="keep one JSON line per mutant in OUT.jsonl")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sink", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        with open(args.sink, "a") as sink:
            run_mutants(args.seed, range(args.start, args.stop), args.timeout_s, sink)
        return 0
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = _run_all(args.seed, args.mutants, args.chunk, args.timeout_s, out.with_suffix(".jsonl"), args.jobs)
    summary = summarize(rows, args.seed, time.perf_counter() - started)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(summary))
    if not args.keep_rows:
        out.with_suffix(".jsonl").unlink()
    print(_markdown(summary))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
