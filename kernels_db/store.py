"""The SQLite store of kernel records: one file per device, safe under concurrent writers and kills.

Why SQLite in WAL mode: several collectors (or a collector and a reader) can share one file; every
record is committed in its own short ``BEGIN IMMEDIATE`` transaction, so a process killed mid-way
loses at most the record in flight and never leaves a half-written row. ``busy_timeout`` makes a
second writer wait for the lock instead of failing.

Example::

    with Store(default_db_path("cpu")) as store:
        store.put(record)
        assert store.get(record.fingerprint, record.key.key_hash) == record

Connections live only inside ``with`` blocks (re-entrant), never in destructors (anti-pattern 10).

Known limitations:
- WAL needs a local filesystem with shared memory; network filesystems may not honour its locks.
"""

from __future__ import annotations

import csv
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Union

from boomfx.kernels_db.schema import (
    ALL_DDL,
    FINGERPRINT_COLUMNS,
    KERNEL_COLUMNS,
    SCHEMA_VERSION,
    DeviceFingerprint,
    InvalidRecordError,
    KernelKey,
    KernelRecord,
    fingerprint_from_row,
)

BUSY_TIMEOUT_MS = 60_000
CSV_COLUMNS = FINGERPRINT_COLUMNS + tuple(c for c in KERNEL_COLUMNS if c != "fp_hash")


def device_slug(device_name: str) -> str:
    """A file-name-safe form of a device name: 'NVIDIA H200' -> 'nvidia-h200'."""
    out = "".join(ch if ch.isalnum() else "-" for ch in device_name.strip().lower())
    return "-".join(part for part in out.split("-") if part) or "device"


def default_db_path(device_name: str, env: Optional[Mapping[str, str]] = None) -> Path:
    """``$XDG_CACHE_HOME/boomfx/kernels-<device>.sqlite``, else ``~/.cache/boomfx/...``.

    The environment is read when called (never at import), and can be passed in for tests.
    """
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", str(Path.home()))) / ".cache")
    return Path(cache) / "boomfx" / f"kernels-{device_slug(device_name)}.sqlite"


@dataclass(frozen=True)
class ImportResult:
    inserted: int
    skipped: int  # rows already present (same fingerprint and key) and kept
    replaced: int


class StoreClosedError(RuntimeError):
    pass


class Store:
    """A kernel database file. Use it in a ``with`` block; nested ``with`` blocks share one connection."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.path = Path(path)
        self._conn: Optional[sqlite3.Connection] = None
        self._depth = 0

    # -- connection lifetime -------------------------------------------------------------------------------
    def __enter__(self) -> "Store":
        if self._depth == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            _enable_wal(conn)
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: committed rows survive a process kill
            conn.execute("PRAGMA foreign_keys=ON")
            self._conn = conn
            try:
                self._create_schema()
            except BaseException:
                conn.close()
                self._conn = None
                raise
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreClosedError(f"Store({self.path}) used outside a `with` block")
        return self._conn

    def _create_schema(self) -> None:
        with self._transaction():
            for ddl in ALL_DDL:
                self.conn.execute(ddl)
            row = self.conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
            if row is None:
                self.conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise InvalidRecordError(
                    f"{self.path}: schema version {row[0]}, this boomfx reads {SCHEMA_VERSION}"
                )

    def _transaction(self) -> "_Tx":
        return _Tx(self.conn)

    # -- writes --------------------------------------------------------------------------------------------
    def put(self, record: KernelRecord, replace: bool = True) -> bool:
        """Store one record in its own transaction (committed on return). Returns True if written.

        With ``replace=False`` an existing row for the same (fingerprint, key) is kept.
        """
        with self._transaction():
            return self._put(record, replace)

    def put_many(self, records: list[KernelRecord], replace: bool = True) -> int:
        with self._transaction():
            return sum(self._put(r, replace) for r in records)

    def _put(self, record: KernelRecord, replace: bool) -> bool:
        if not isinstance(record, KernelRecord):
            raise InvalidRecordError(f"not a KernelRecord: {type(record).__name__}")
        self.conn.execute(
            f"INSERT OR IGNORE INTO fingerprints VALUES ({','.join('?' * len(FINGERPRINT_COLUMNS))})",
            record.fingerprint.row(),
        )
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        cur = self.conn.execute(
            f"{verb} INTO kernels VALUES ({','.join('?' * len(KERNEL_COLUMNS))})", record.row()
        )
        return cur.rowcount > 0

    def delete(self, fingerprint: DeviceFingerprint, key_hash: str) -> bool:
        """Remove one row (a measurement found implausible after it was stored). Returns True if it existed."""
        with self._transaction():
            cur = self.conn.execute("DELETE FROM kernels WHERE fp_hash=? AND key_hash=?",
                                    (fingerprint.fp_hash, key_hash))
            return cur.rowcount > 0

    # -- reads ---------------------------------------------------------------------------------------------
    def fingerprints(self) -> list[DeviceFingerprint]:
        rows = self.conn.execute("SELECT * FROM fingerprints ORDER BY fp_hash").fetchall()
        return [fingerprint_from_row(dict(r)) for r in rows]

    def get(self, fingerprint: DeviceFingerprint, key_hash: str) -> Optional[KernelRecord]:
        row = self.conn.execute(
            "SELECT * FROM kernels WHERE fp_hash=? AND key_hash=?", (fingerprint.fp_hash, key_hash)
        ).fetchone()
        return None if row is None else KernelRecord.from_row(fingerprint, dict(row))

    def key_hashes(self, fingerprint: DeviceFingerprint) -> set[str]:
        rows = self.conn.execute("SELECT key_hash FROM kernels WHERE fp_hash=?", (fingerprint.fp_hash,))
        return {r[0] for r in rows}

    def records(
        self, fingerprint: Optional[DeviceFingerprint] = None, op: Optional[str] = None
    ) -> Iterator[KernelRecord]:
        """All records, optionally of one fingerprint and/or one op string, oldest first."""
        fps = {fp.fp_hash: fp for fp in self.fingerprints()}
        where, params = [], []
        if fingerprint is not None:
            where.append("fp_hash=?")
            params.append(fingerprint.fp_hash)
        if op is not None:
            where.append("op=?")
            params.append(op)
        sql = (
            "SELECT * FROM kernels"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY created_at"
        )
        for row in self.conn.execute(sql, params).fetchall():
            yield KernelRecord.from_row(fps[row["fp_hash"]], dict(row))

    def count(self, fingerprint: Optional[DeviceFingerprint] = None) -> int:
        if fingerprint is None:
            return int(self.conn.execute("SELECT COUNT(*) FROM kernels").fetchone()[0])
        return int(
            self.conn.execute(
                "SELECT COUNT(*) FROM kernels WHERE fp_hash=?", (fingerprint.fp_hash,)
            ).fetchone()[0]
        )

    def integrity_ok(self) -> bool:
        return self.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    # -- CSV -----------------------------------------------------------------------------------------------
    def export_csv(self, path: Union[str, os.PathLike]) -> int:
        """Write every record, fingerprint columns inlined, one row per record. Returns the row count."""
        n = 0
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            for rec in self.records():
                writer.writerow(_csv_row(rec))
                n += 1
        return n

    def import_csv(
        self, path: Union[str, os.PathLike], on_conflict: str = "keep", source_label: Optional[str] = None
    ) -> ImportResult:
        """Read rows written by ``export_csv`` (or by hand with the same columns) in one transaction.

        Idempotent: re-importing the same file changes nothing (``on_conflict="keep"``). Rows with an
        empty ``source`` get ``import:<source_label or file stem>``. A malformed row aborts the whole
        import with ``InvalidRecordError`` naming the line; nothing of that file is stored then.
        """
        if on_conflict not in ("keep", "replace"):
            raise ValueError(f"on_conflict must be 'keep' or 'replace', got {on_conflict!r}")
        label = f"import:{source_label or Path(path).stem}"
        inserted = skipped = replaced = 0
        with open(path, newline="", encoding="utf-8") as fh, self._transaction():
            reader = csv.DictReader(fh)
            missing = set(CSV_COLUMNS) - set(reader.fieldnames or ()) - {"fp_hash", "created_at", "source"}
            if missing:
                raise InvalidRecordError(f"{path}: missing columns {sorted(missing)}")
            for line_no, row in enumerate(reader, start=2):
                try:
                    rec = _record_from_csv(row, label)
                except (InvalidRecordError, ValueError, KeyError) as exc:
                    raise InvalidRecordError(f"{path}:{line_no}: {exc}") from exc
                exists = self.get(rec.fingerprint, rec.key.key_hash) is not None
                if exists and on_conflict == "keep":
                    skipped += 1
                    continue
                self._put(rec, replace=True)
                replaced += exists
                inserted += not exists
        return ImportResult(inserted, skipped, replaced)


def _enable_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to write-ahead logging, waiting out other processes that open it at the same moment.

    Changing the journal mode needs an exclusive lock, and SQLite answers "database is locked" at once
    (without its busy handler) when two connections race to create the same new file, so wait here.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


class _Tx:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error); takes the write lock up front so two
    writers never deadlock upgrading read locks."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.nested = conn.in_transaction

    def __enter__(self) -> None:
        if not self.nested:
            self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self.nested:
            return
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")


def _csv_row(rec: KernelRecord) -> dict:
    fp = dict(zip(FINGERPRINT_COLUMNS, rec.fingerprint.row()))
    kern = dict(zip(KERNEL_COLUMNS, rec.row()))
    kern.pop("fp_hash")
    fp.update(kern)
    return fp


def _record_from_csv(row: dict, default_source: str) -> KernelRecord:
    fp = fingerprint_from_row(row)
    key = KernelKey(row["op"], row["dtype"], row["key_json"], row.get("key_hash") or "")
    median = float(row["median_ns"])
    extra = {"created_at": row["created_at"]} if row.get("created_at") else {}
    return KernelRecord(
        fp,
        key,
        median,
        float(row.get("p10_ns") or median),
        float(row.get("p90_ns") or median),
        int(row.get("n_runs") or 1),
        float(row.get("host_ns") or 0.0),
        int(row.get("workspace_bytes") or 0),
        row.get("source") or default_source,
        **extra,
    )
