"""Damaged .pt2 files: a few hundred seeded mutants of the shipped examples through the CLI.

Each must end with exit 0 (a report) or exit 2 and exactly one ``boomfx: error:`` line on stderr,
never an escaped exception; every ``LoadError`` must name the archive entry it is about. The
10,000-mutant run is ``benchmarks/fuzz_archive.py`` (results in ``benchmarks/results/``).
"""
from __future__ import annotations

import collections
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEED = 20261201
MUTANTS = 200
# the two cheapest examples: most of the test's time is the analysis of the mutants that still load
EXAMPLES = ("mlp.pt2", "gpt_tiny.pt2")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzz():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return _load("archive_mutations"), _load("fuzz_archive")


def test_mutants_are_deterministic_and_cover_every_kind(fuzz) -> None:
    mutations, _ = fuzz
    data = (ROOT / "examples" / "mlp.pt2").read_bytes()
    first = [mutations.mutant(data, SEED, i) for i in range(60)]
    again = [mutations.mutant(data, SEED, i) for i in range(60)]
    assert [m.data for m in first] == [m.data for m in again]
    assert {m.kind for m in first} == set(mutations.KINDS)
    assert all(m.data != data for m in first if m.kind != "entry-flip" or m.detail != "empty")


def test_damaged_files_end_with_a_report_or_one_line(fuzz, tmp_path: Path) -> None:
    mutations, runner = fuzz
    sources = {name: (ROOT / "examples" / name).read_bytes() for name in EXAMPLES}
    entries = {name: runner.archive_entries(data) for name, data in sources.items()}
    baselines = {}
    for name in EXAMPLES:
        code, stdout, stderr, escaped, _ = runner.run_cli(str(ROOT / "examples" / name), runner.EXAMPLES[name][1])
        assert code == 0 and escaped is None, stderr
        baselines[name] = runner.fingerprint(stdout)
    outcomes = []
    for index in range(MUTANTS):
        name = EXAMPLES[index % len(EXAMPLES)]
        m = mutations.mutant(sources[name], SEED, index)
        path = tmp_path / name
        path.write_bytes(m.data)
        result = runner.run_cli(str(path), runner.EXAMPLES[name][1])
        outcomes.append(runner.classify(index, name, m, result, baselines[name], entries[name]))
    failures = [o for o in outcomes if o.status in runner.FAILURES]
    assert not failures, "\n".join(f"{o.kind} {o.entry} {o.detail}: {o.status} {o.error_type} {o.message}"
                                   for o in failures[:10])
    unnamed = [o for o in outcomes if o.status == "refused" and o.error_type == "LoadError" and not o.named_entry]
    assert not unnamed, "\n".join(f"{o.kind} {o.entry} {o.detail}: {o.message}" for o in unnamed[:10])
    status = collections.Counter(o.status for o in outcomes)
    # both ends are exercised: damaged files refused, harmless damage (metadata, sample inputs) analysed
    assert status["refused"] > MUTANTS // 3 and status["ok-same"] > 0, status
