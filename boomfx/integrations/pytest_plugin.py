"""pytest plugin: graph-level performance and memory regression tests against stored baselines.

Loaded automatically when boomfx is installed (``pytest11`` entry point). A test asks the
``boomfx_baseline`` fixture to analyse a model (any ``boomfx.analyze`` source) or to check a Report
it already has; the predicted metrics are compared with ``boomfx_baselines/<test name>.json`` next
to the test file, under per-metric relative tolerances::

    def test_gpt_block_budget(boomfx_baseline):
        model, x = make_block(), torch.randn(8, 128, 256)
        boomfx_baseline(model, x, device="a100-80gb", train=True, optimizer="sgd",
                        rtol={"time": 0.10})          # the others keep their defaults

    pytest --boomfx-update         # write / rewrite the baselines of the tests that ran

Compared metrics (``METRICS``): predicted step time, peak allocated and peak reserved bytes (the
allocator model's; live storage bytes on a CPU device, which has no caching allocator) and FLOPs.
A baseline also keeps its context (device, mode, options, symbol values, schema version); a test
whose context changed fails and asks for ``--boomfx-update`` rather than comparing unlike numbers.

Baselines do not depend on the speed of the machine running the tests: without ``db=`` kernels are
priced from the device's datasheet model, a pure function of the graph. (``device="cpu"`` does
depend on the host's core count, which is why its description is part of the context.)

Known limitations:
    - One baseline file per call; a test calling the fixture twice gets ``<name>.json`` and
      ``<name>.2.json`` unless it passes ``name=``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import pytest

BASELINE_DIR = "boomfx_baselines"
BASELINE_FORMAT = 1

# metric -> (field in the baseline file, default relative tolerance)
METRICS: dict[str, tuple[str, float]] = {
    "time": ("time_ns", 0.05),
    "peak_allocated": ("peak_allocated_bytes", 0.01),
    "peak_reserved": ("peak_reserved_bytes", 0.01),
    "flops": ("flops", 0.0),
}
DEFAULT_RTOL: dict[str, float] = {name: rtol for name, (_field, rtol) in METRICS.items()}
_UPDATED_KEY = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("boomfx", "boomfx performance/memory baselines")
    group.addoption("--boomfx-update", action="store_true", default=False,
                    help="write the boomfx baselines of the tests that run instead of comparing with them")
    parser.addini("boomfx_baseline_dir", default=BASELINE_DIR,
                  help="folder (relative to each test file) of the boomfx baselines")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_UPDATED_KEY] = []


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    written = config.stash.get(_UPDATED_KEY, [])
    if written:
        terminalreporter.write_sep("-", f"boomfx: wrote {len(written)} baseline(s)")
        for path in written:
            terminalreporter.write_line(f"  {path}")


# --------------------------------------------------------------------------------------------
# Metrics and baselines
# --------------------------------------------------------------------------------------------

def metrics_of(report: Any) -> dict[str, float]:
    """The compared metrics of a Report, keyed by their baseline field names."""
    alloc = report.memory.allocator
    peak_allocated = alloc.peak_allocated_bytes if alloc is not None else report.memory.peak_live_bytes
    peak_reserved = alloc.peak_reserved_bytes if alloc is not None else report.memory.peak_live_bytes
    return {"time_ns": float(report.time.total_ns), "peak_allocated_bytes": int(peak_allocated),
            "peak_reserved_bytes": int(peak_reserved), "flops": float(report.time.flops)}


def context_of(report: Any) -> dict[str, Any]:
    """What the metrics were predicted for; a baseline only compares within the same context."""
    context: dict[str, Any] = {
        "device": report.device, "mode": report.mode,
        "options": {k: v for k, v in sorted(report.options.items()) if v not in (None, "", False)},
        "dims": {s.name: s.value for s in report.symbols if s.value is not None},
    }
    if report.device == "cpu":
        context["device_description"] = report.device_description
    return context


def baseline_document(report: Any, test: str) -> dict[str, Any]:
    return {"boomfx_baseline": BASELINE_FORMAT, "schema_version": report.schema_version, "test": test,
            "context": context_of(report), "metrics": metrics_of(report)}


def relative_change(baseline: float, current: float) -> float:
    if baseline == current:
        return 0.0
    if baseline == 0:
        return math.inf
    return (current - baseline) / abs(baseline)


@dataclass(frozen=True)
class MetricDiff:
    metric: str
    field: str
    baseline: float
    current: float
    rtol: float

    @property
    def change(self) -> float:
        return relative_change(self.baseline, self.current)

    @property
    def ok(self) -> bool:
        return abs(self.change) <= self.rtol


def compare(baseline: Mapping[str, Any], current: Mapping[str, Any], rtol: Mapping[str, float]) -> list[MetricDiff]:
    return [MetricDiff(name, field, float(baseline[field]), float(current[field]), float(rtol[name]))
            for name, (field, _default) in METRICS.items() if field in baseline]


def _fmt_value(field: str, value: float) -> str:
    from boomfx.core.units import fmt_bytes, fmt_time
    if field.endswith("_ns"):
        return fmt_time(value)
    if field.endswith("_bytes"):
        return f"{fmt_bytes(int(value))} ({int(value):,} B)"
    return f"{value:.4g}"


def diff_table(diffs: list[MetricDiff]) -> str:
    """A per-metric table: baseline, current, relative change, tolerance and verdict."""
    rows = [("metric", "baseline", "current", "change", "tolerance", "")]
    for d in diffs:
        change = "new" if math.isinf(d.change) else f"{d.change:+.2%}"
        rows.append((d.field, _fmt_value(d.field, d.baseline), _fmt_value(d.field, d.current), change,
                     f"{d.rtol:.2%}", "ok" if d.ok else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# --------------------------------------------------------------------------------------------
# The fixture
# --------------------------------------------------------------------------------------------

def _file_name(nodeid_tail: str) -> str:
    return re.sub(r"[^A-Za-z0-9._\-\[\]]", "_", nodeid_tail.replace("::", "."))


class BoomfxBaseline:
    """Callable fixture value: ``boomfx_baseline(source, *inputs, rtol=..., name=..., **analyze_kwargs)``.

    Returns the Report. ``check(report)`` compares a Report computed elsewhere; ``path(name)`` is where
    a baseline lives.
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._config = request.config
        self._calls = 0
        self.update = bool(self._config.getoption("--boomfx-update"))
        test_tail = request.node.nodeid.split("::", 1)[1] if "::" in request.node.nodeid else request.node.name
        self.test_name = _file_name(test_tail)
        self.directory = Path(request.node.path).parent / str(self._config.getini("boomfx_baseline_dir"))

    def path(self, name: Optional[str] = None) -> Path:
        return self.directory / f"{_file_name(name) if name else self.test_name}.json"

    def __call__(self, source: Any, *example_inputs: Any, rtol: Optional[Mapping[str, float]] = None,
                 name: Optional[str] = None, **analyze_kwargs: Any) -> Any:
        from boomfx.analysis.analysis import analyze
        analyze_kwargs.setdefault("device", "a100-80gb")
        report = analyze(source, *example_inputs, **analyze_kwargs)
        self.check(report, rtol=rtol, name=name)
        return report

    def check(self, report: Any, rtol: Optional[Mapping[str, float]] = None, name: Optional[str] = None) -> None:
        self._calls += 1
        if name is None and self._calls > 1:
            name = f"{self.test_name}.{self._calls}"
        tolerances = dict(DEFAULT_RTOL)
        unknown = set(rtol or {}) - set(tolerances)
        if unknown:
            raise ValueError(f"unknown metric(s) in rtol: {sorted(unknown)} (known: {sorted(tolerances)})")
        tolerances.update(rtol or {})
        path = self.path(name)
        document = baseline_document(report, name or self.test_name)
        if self.update:
            self._write(path, document)
            return
        if not path.exists():
            pytest.fail(f"boomfx: no baseline at {path}\n"
                        f"  run `pytest --boomfx-update {self._request.node.nodeid}` to create it "
                        f"(then review and commit the file)", pytrace=False)
        stored = json.loads(path.read_text())
        problems = self._context_problems(stored, document)
        if problems:
            pytest.fail(f"boomfx: the baseline {path} was recorded for a different context:\n"
                        + "\n".join(f"  {p}" for p in problems)
                        + "\n  rerun with --boomfx-update if the change is intended", pytrace=False)
        diffs = compare(stored["metrics"], document["metrics"], tolerances)
        if not all(d.ok for d in diffs):
            failed = ", ".join(d.metric for d in diffs if not d.ok)
            pytest.fail(f"boomfx: predicted {failed} outside tolerance of the baseline {path}\n"
                        f"{diff_table(diffs)}\n"
                        f"  rerun with --boomfx-update to accept the new values", pytrace=False)

    @staticmethod
    def _context_problems(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
        problems = []
        old_major = str(stored.get("schema_version", "0")).split(".")[0]
        if old_major != str(current["schema_version"]).split(".")[0]:
            problems.append(f"report schema {stored.get('schema_version')} -> {current['schema_version']}")
        old, new = stored.get("context", {}), current["context"]
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                problems.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
        return problems

    def _write(self, path: Path, document: Mapping[str, Any]) -> None:
        text = json.dumps(document, indent=2, sort_keys=True) + "\n"
        if path.exists() and path.read_text() == text:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self._config.stash[_UPDATED_KEY].append(str(path))


@pytest.fixture
def boomfx_baseline(request: pytest.FixtureRequest) -> BoomfxBaseline:
    """Compare a model's predicted time/memory/FLOPs with its stored baseline (see module doc)."""
    return BoomfxBaseline(request)
