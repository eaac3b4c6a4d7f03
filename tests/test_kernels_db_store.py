"""Store contracts: round trips, CSV export/import (idempotent), loud failures, concurrent writers.

This module imports no torch, so the spawned writer processes start fast.
"""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from boomfx.kernels_db.schema import DeviceFingerprint, InvalidRecordError, KernelKey, KernelRecord
from boomfx.kernels_db.store import Store, default_db_path, device_slug

FP = DeviceFingerprint("cpu", "cpu", "2.13.0", "", "", "testhost", 2, "test cpu")


def make_record(i: int, fp: DeviceFingerprint = FP, median_ns: float = 1000.0) -> KernelRecord:
    key_json = json.dumps(
        {
            "op": "aten.relu.default",
            "args": {"self": {"$t": 0}},
            "context": {},
            "tensors": [{"arg": "self", "shape": [i + 1], "stride": [1], "dtype": "float32", "offset": 0}],
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    key = KernelKey("aten.relu.default", "float32", key_json)
    return KernelRecord(
        fp, key, median_ns + i, median_ns + i - 1, median_ns + i + 1, 10, 500.0, 4 * i, "measured:cpu"
    )


def test_put_get_round_trip(tmp_path: Path) -> None:
    rec = make_record(3)
    with Store(tmp_path / "k.sqlite") as store:
        assert store.put(rec)
        assert store.get(FP, rec.key.key_hash) == rec
        assert store.count(FP) == 1
        assert store.fingerprints() == [FP]
    with Store(tmp_path / "k.sqlite") as store:  # persisted, readable by a new connection
        assert list(store.records()) == [rec]
        assert store.integrity_ok()


def test_unique_per_fingerprint_and_key(tmp_path: Path) -> None:
    other = DeviceFingerprint("cpu", "cpu", "2.14.0", "", "", "testhost", 2, "test cpu")
    with Store(tmp_path / "k.sqlite") as store:
        store.put(make_record(1, median_ns=1000))
        store.put(make_record(1, median_ns=2000))  # same fingerprint and key: replaced
        store.put(make_record(1, fp=other))  # other fingerprint: a second row
        assert store.count() == 2
        assert store.get(FP, make_record(1).key.key_hash).median_ns == 2001
        assert not store.put(make_record(1, median_ns=5000), replace=False)
        assert store.get(FP, make_record(1).key.key_hash).median_ns == 2001


def test_csv_export_import_round_trip_and_idempotent(tmp_path: Path) -> None:
    records = [make_record(i) for i in range(5)]
    csv_path = tmp_path / "export.csv"
    with Store(tmp_path / "a.sqlite") as store:
        store.put_many(records)
        assert store.export_csv(csv_path) == 5
    with Store(tmp_path / "b.sqlite") as store:
        first = store.import_csv(csv_path)
        again = store.import_csv(csv_path)
        assert (first.inserted, first.skipped) == (5, 0)
        assert (again.inserted, again.skipped) == (0, 5)
        assert sorted(store.records(), key=lambda r: r.key.key_hash) == sorted(
            records, key=lambda r: r.key.key_hash
        )


def test_csv_import_labels_rows_without_source(tmp_path: Path) -> None:
    csv_path = tmp_path / "public.csv"
    with Store(tmp_path / "a.sqlite") as store:
        store.put(make_record(0))
        store.export_csv(csv_path)
    text = csv_path.read_text().replace("measured:cpu", "")
    csv_path.write_text(text)
    with Store(tmp_path / "b.sqlite") as store:
        store.import_csv(csv_path)
        assert [r.source for r in store.records()] == ["import:public"]


def test_malformed_csv_row_raises_and_stores_nothing(tmp_path: Path) -> None:
    csv_path = tmp_path / "bad.csv"
    with Store(tmp_path / "a.sqlite") as store:
        store.put_many([make_record(0), make_record(1)])
        store.export_csv(csv_path)
    lines = csv_path.read_text().splitlines()
    lines[2] = lines[2].replace(",10,", ",0,")  # n_runs=0 on the second record
    csv_path.write_text("\n".join(lines) + "\n")
    with Store(tmp_path / "b.sqlite") as store:
        with pytest.raises(InvalidRecordError, match="bad.csv:3"):
            store.import_csv(csv_path)
        assert store.count() == 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("median_ns", float("nan")),
        ("median_ns", -1.0),
        ("n_runs", 0),
        ("workspace_bytes", -4),
        ("source", "guessed"),
    ],
)
def test_invalid_records_raise(field: str, value: object) -> None:
    good = make_record(0)
    kwargs = {
        f: getattr(good, f)
        for f in (
            "fingerprint",
            "key",
            "median_ns",
            "p10_ns",
            "p90_ns",
            "n_runs",
            "host_ns",
            "workspace_bytes",
            "source",
        )
    }
    kwargs[field] = value
    if field == "median_ns":
        kwargs["p10_ns"] = kwargs["p90_ns"] = value if value == value else 0.0
    with pytest.raises(InvalidRecordError):
        KernelRecord(**kwargs)


def test_key_hash_must_match_json() -> None:
    with pytest.raises(InvalidRecordError):
        KernelKey("aten.relu.default", "float32", "{}", "0" * 20)


def test_unstorable_value_raises_loudly(tmp_path: Path) -> None:
    rec = make_record(0)
    huge = KernelRecord(rec.fingerprint, rec.key, 1.0, 1.0, 1.0, 1, 0.0, 2**70, "measured:cpu")
    with Store(tmp_path / "k.sqlite") as store:
        with pytest.raises(OverflowError):
            store.put(huge)
        assert store.count() == 0


def test_store_outside_with_block_raises(tmp_path: Path) -> None:
    store = Store(tmp_path / "k.sqlite")
    with pytest.raises(RuntimeError, match="with"):
        store.count()


def test_default_path_uses_xdg_then_home(tmp_path: Path) -> None:
    assert (
        default_db_path("NVIDIA H200", {"XDG_CACHE_HOME": str(tmp_path)})
        == tmp_path / "boomfx" / "kernels-nvidia-h200.sqlite"
    )
    assert default_db_path("cpu", {"HOME": "/home/u"}) == Path("/home/u/.cache/boomfx/kernels-cpu.sqlite")
    assert device_slug(" A100-SXM4 (80GB) ") == "a100-sxm4-80gb"


def test_wal_mode(tmp_path: Path) -> None:
    with Store(tmp_path / "k.sqlite") as store:
        assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _writer(path: str, start: int, count: int) -> None:
    with Store(path) as store:
        for i in range(start, start + count):
            store.put(make_record(i))


def _open_at_once(path: str, barrier, results) -> None:
    barrier.wait()
    try:
        with Store(path) as store:
            results.put(store.conn.execute("PRAGMA journal_mode").fetchone()[0])
    except Exception as exc:  # reported to the parent, which asserts on it
        results.put(repr(exc))


def test_processes_creating_the_same_new_file_at_once_all_succeed(tmp_path: Path) -> None:
    """Switching a new file to WAL takes an exclusive lock that SQLite refuses at once, without waiting,
    when several processes race to create the file (seen in CI); every opener must still succeed."""
    ctx = multiprocessing.get_context("fork")  # children only touch sqlite, never torch
    for trial in range(5):
        path = str(tmp_path / f"k{trial}.sqlite")
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(path, barrier, results)) for _ in range(8)]
        for p in procs:
            p.start()
        answers = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(60)
        assert answers == ["wal"] * 8


def test_concurrent_writers_keep_every_row(tmp_path: Path) -> None:
    path = str(tmp_path / "k.sqlite")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, start, 60)) for start in (0, 60)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with Store(path) as store:
        assert store.count(FP) == 120
        assert store.integrity_ok()
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
