"""The kernel database's records and the SQL that stores them, side by side (style rule 8).

Three records:

- ``DeviceFingerprint``: what a measurement depends on besides the kernel itself (device name, driver /
  runtime / torch versions, host, thread count). Stored once in ``fingerprints``; rows refer to it by hash.
- ``KernelKey``: one kernel call with concrete sizes, as canonical JSON plus its hash (built by ``keys.py``).
- ``KernelRecord``: the measured statistics of one key on one fingerprint (one row of ``kernels``).

Units are in the names: ``_ns`` for nanoseconds, ``_bytes`` for bytes. A row is unique per
(fingerprint, key). Invalid records raise ``InvalidRecordError`` on construction, and the DDL repeats
the same checks, so nothing malformed is ever stored silently (anti-pattern 10).

Example::

    >>> fp = DeviceFingerprint("cpu", "cpu", "2.13.0", "", "", "host", 2, "x86")
    >>> len(fp.fp_hash)
    20

Known limitations:
- The fingerprint does not record clock/power settings; two rows from one GPU under different clocks
  collide unless the host name differs.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

SCHEMA_VERSION = 1
HASH_CHARS = 20  # 80 bits of sha256: collisions are not a practical concern at DB sizes
SOURCE_PREFIXES = ("measured:", "import:")
# a measured row's source ends so when it was timed inside its program's step (kernels_db/in_step.py)
IN_STEP_SUFFIX = ":in-step"


def is_in_step_source(source: str) -> bool:
    """Whether a row's ``source`` says it was timed inside its program's step, not in a loop of its own."""
    return source.endswith(IN_STEP_SUFFIX)

# KernelKey.op of rows that are not single kernels: whole repeated blocks (kernels_db/blocks_db.py) and
# host overheads (kernels_db/host_overheads.py); kernel lookups skip them
BLOCK_OP = "block"


class InvalidRecordError(ValueError):
    """A record that must not be stored (negative/non-finite time, unknown provenance...)."""


def canonical_json(value: Any) -> str:
    """The one canonical text of a JSON-able value: sorted keys, no spaces, so equal values hash equal."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_CHARS]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------
# Device fingerprint
# ---------------------------------------------------------------------------------------------------------

FINGERPRINTS_DDL = """
CREATE TABLE IF NOT EXISTS fingerprints (
    fp_hash         TEXT PRIMARY KEY,
    device_name     TEXT NOT NULL,
    device_kind     TEXT NOT NULL CHECK (device_kind IN ('cpu', 'cuda', 'other')),
    torch_version   TEXT NOT NULL,
    runtime_version TEXT NOT NULL,   -- CUDA runtime torch was built with ('' on CPU)
    driver_version  TEXT NOT NULL,   -- CUDA driver / cuDNN version where known ('' otherwise)
    host            TEXT NOT NULL,
    num_threads     INTEGER NOT NULL CHECK (num_threads >= 0),
    detail          TEXT NOT NULL    -- CPU model, compute capability...
)
"""


@dataclass(frozen=True)
class DeviceFingerprint:
    """Everything besides the kernel key that a timing depends on. ``fp_hash`` identifies it."""

    device_name: str
    device_kind: str
    torch_version: str
    runtime_version: str
    driver_version: str
    host: str
    num_threads: int
    detail: str = ""

    def __post_init__(self) -> None:
        if self.device_kind not in ("cpu", "cuda", "other"):
            raise InvalidRecordError(f"device_kind must be cpu/cuda/other, got {self.device_kind!r}")
        if not self.device_name:
            raise InvalidRecordError("device_name is empty")

    @property
    def fp_hash(self) -> str:
        return short_hash(canonical_json(asdict(self)))

    def row(self) -> tuple:
        return (
            self.fp_hash,
            self.device_name,
            self.device_kind,
            self.torch_version,
            self.runtime_version,
            self.driver_version,
            self.host,
            int(self.num_threads),
            self.detail,
        )


FINGERPRINT_COLUMNS = (
    "fp_hash",
    "device_name",
    "device_kind",
    "torch_version",
    "runtime_version",
    "driver_version",
    "host",
    "num_threads",
    "detail",
)


# ---------------------------------------------------------------------------------------------------------
# Kernel key
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelKey:
    """One kernel call with concrete sizes, canonical JSON text plus the fields lookup filters on.

    ``key_json`` holds ``{"op", "args", "tensors", "context"}`` (see ``keys.py``); ``dtype`` is the
    dtype of the first tensor argument (or ``"none"``); ``key_hash`` is the hash of ``key_json``.
    """

    op: str
    dtype: str
    key_json: str
    key_hash: str = field(default="")

    def __post_init__(self) -> None:
        expected = short_hash(self.key_json)
        if not self.key_hash:
            object.__setattr__(self, "key_hash", expected)
        elif self.key_hash != expected:
            raise InvalidRecordError(
                f"key_hash {self.key_hash} does not match key_json (expected {expected})"
            )

    @property
    def data(self) -> dict:
        return json.loads(self.key_json)


# ---------------------------------------------------------------------------------------------------------
# Kernel record
# ---------------------------------------------------------------------------------------------------------

KERNELS_DDL = """
CREATE TABLE IF NOT EXISTS kernels (
    fp_hash         TEXT NOT NULL REFERENCES fingerprints(fp_hash),
    key_hash        TEXT NOT NULL,
    op              TEXT NOT NULL,
    dtype           TEXT NOT NULL,
    key_json        TEXT NOT NULL,
    median_ns       REAL NOT NULL CHECK (median_ns >= 0),
    p10_ns          REAL NOT NULL CHECK (p10_ns >= 0 AND p10_ns <= median_ns),
    p90_ns          REAL NOT NULL CHECK (p90_ns >= median_ns),
    n_runs          INTEGER NOT NULL CHECK (n_runs >= 1),
    host_ns         REAL NOT NULL CHECK (host_ns >= 0),
    workspace_bytes INTEGER NOT NULL CHECK (workspace_bytes >= 0),
    source          TEXT NOT NULL CHECK (source LIKE 'measured:%' OR source LIKE 'import:%'),
    created_at      TEXT NOT NULL,
    PRIMARY KEY (fp_hash, key_hash)
)
"""

INDEX_DDL = "CREATE INDEX IF NOT EXISTS kernels_by_op ON kernels (op, dtype)"

META_DDL = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"

ALL_DDL = (META_DDL, FINGERPRINTS_DDL, KERNELS_DDL, INDEX_DDL)

KERNEL_COLUMNS = (
    "fp_hash",
    "key_hash",
    "op",
    "dtype",
    "key_json",
    "median_ns",
    "p10_ns",
    "p90_ns",
    "n_runs",
    "host_ns",
    "workspace_bytes",
    "source",
    "created_at",
)


@dataclass(frozen=True)
class KernelRecord:
    """Measured statistics of one kernel key on one device fingerprint.

    ``median_ns``/``p10_ns``/``p90_ns``: execution time. On CUDA it is device time between CUDA events;
    on CPU (where issue and execution share a thread) it is the wall time of the whole call, so it
    *includes* ``host_ns``. ``host_ns``: CPU time eager PyTorch spends issuing the op. ``workspace_bytes``:
    transient memory the kernel allocated beyond its inputs and outputs. ``source``: provenance,
    ``measured:cpu``, ``measured:cuda`` or ``import:<source>``.
    """

    fingerprint: DeviceFingerprint
    key: KernelKey
    median_ns: float
    p10_ns: float
    p90_ns: float
    n_runs: int
    host_ns: float
    workspace_bytes: int
    source: str
    created_at: str = field(default_factory=utc_now)

    def __post_init__(self) -> None:
        times = {
            "median_ns": self.median_ns,
            "p10_ns": self.p10_ns,
            "p90_ns": self.p90_ns,
            "host_ns": self.host_ns,
        }
        for name, value in times.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidRecordError(f"{name}={value!r} for {self.key.op}: must be a finite number >= 0")
        if not self.p10_ns <= self.median_ns <= self.p90_ns:
            raise InvalidRecordError(
                f"need p10 <= median <= p90, got {self.p10_ns}, {self.median_ns}, {self.p90_ns}"
            )
        if int(self.n_runs) < 1:
            raise InvalidRecordError(f"n_runs={self.n_runs} for {self.key.op}: must be >= 1")
        if not isinstance(self.workspace_bytes, int) or self.workspace_bytes < 0:
            raise InvalidRecordError(f"workspace_bytes={self.workspace_bytes!r}: must be an int >= 0")
        if not self.source.startswith(SOURCE_PREFIXES) or self.source in SOURCE_PREFIXES:
            raise InvalidRecordError(
                f"source {self.source!r} must look like measured:<kind> or import:<source>"
            )

    @property
    def host_in_time(self) -> bool:
        """True when ``median_ns`` already contains the host issue time (CPU measurements)."""
        return self.fingerprint.device_kind == "cpu"

    def row(self) -> tuple:
        return (
            self.fingerprint.fp_hash,
            self.key.key_hash,
            self.key.op,
            self.key.dtype,
            self.key.key_json,
            float(self.median_ns),
            float(self.p10_ns),
            float(self.p90_ns),
            int(self.n_runs),
            float(self.host_ns),
            int(self.workspace_bytes),
            self.source,
            self.created_at,
        )

    @staticmethod
    def from_row(fingerprint: DeviceFingerprint, row: dict) -> "KernelRecord":
        key = KernelKey(row["op"], row["dtype"], row["key_json"], row["key_hash"])
        return KernelRecord(
            fingerprint,
            key,
            float(row["median_ns"]),
            float(row["p10_ns"]),
            float(row["p90_ns"]),
            int(row["n_runs"]),
            float(row["host_ns"]),
            int(row["workspace_bytes"]),
            row["source"],
            row["created_at"],
        )


def fingerprint_from_row(row: dict) -> DeviceFingerprint:
    fp = DeviceFingerprint(
        row["device_name"],
        row["device_kind"],
        row["torch_version"],
        row["runtime_version"],
        row["driver_version"],
        row["host"],
        int(row["num_threads"]),
        row["detail"],
    )
    stored: Optional[str] = row.get("fp_hash")
    if stored and stored != fp.fp_hash:
        raise InvalidRecordError(
            f"fingerprint hash {stored} does not match its fields (expected {fp.fp_hash})"
        )
    return fp
