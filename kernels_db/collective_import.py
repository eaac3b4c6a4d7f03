"""Collective measurements from files people already have: nccl-tests ``*_perf`` output and the public table.

1. **nccl-tests** (github.com/NVIDIA/nccl-tests) prints one table per run::

       #  Rank  0 Group  0 Pid  4242 on  node-a device  0 [0x18] NVIDIA H100 80GB HBM3
       ...
       #       size         count      type   redop    root     time   algbw   busbw #wrong     time ...
       #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us) ...
           1048576        262144     float     sum      -1    21.40   49.00   85.75      0    21.10 ...

   The first ``time`` column is the out-of-place time (us), the second the in-place one. ``size`` is the whole
   buffer (all-gather: the gathered output; reduce-scatter: the input), the convention of
   ``kernels_db/collectives.py``. World = the ``Rank`` lines, nodes = their distinct hosts, the device = their
   GPU name; the collective comes from ``Collective test starting: <op>_perf`` or the file name (or is given).
   Each row becomes a record of ``median = out-of-place time`` and p10/p90 = the lower/higher of the two times.
2. **The public NCCL table** (``shared/data/collective-measurements/nccl_single_node.csv``, from NVIDIA's
   aiconfigurator): ``message_elements`` x dtype size is the whole buffer too (an all-gather and a
   reduce-scatter of the same size take the same time, ~0.39 ms at 128 MiB on 8 H100s: a per-rank reading
   would imply 2.4 TB/s of bus bandwidth).

Known limitations:
- Within one run, a size printed twice keeps its last row.
- nccl-tests' ``-g`` (several GPUs per thread) and ``-t`` rank lines are counted the same way (one per GPU).
"""
from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from boomfx.core.errors import CollectiveError
from boomfx.kernels_db.collective_model import canonical_op
from boomfx.kernels_db.collectives import collective_key
from boomfx.kernels_db.schema import DeviceFingerprint, KernelRecord

PUBLIC_COLUMNS = ("system", "device", "nccl_version", "op_name", "nccl_dtype", "num_gpus", "message_elements",
                  "latency_ms")
DTYPE_BYTES = {"half": 2, "float16": 2, "bfloat16": 2, "float": 4, "float32": 4, "double": 8, "float64": 8,
               "int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
_DTYPE_NAMES = {"half": "float16", "float": "float32", "double": "float64"}
_RANK_LINE = re.compile(r"#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(.+)$")
_OP_LINE = re.compile(r"Collective test starting:\s*(\w+?)_perf")
_NCCL_VERSION = re.compile(r"NCCL version\s+(\S+)")
_ITERS = re.compile(r"(warmup |agg )?iters:\s*(\d+)")


@dataclass(frozen=True)
class CollectiveRow:
    """One measurement, normalised: whole-buffer bytes, time in ns."""

    op: str
    message_bytes: int
    world: int
    ranks_per_node: int
    dtype: str
    time_ns: float
    p10_ns: float
    p90_ns: float
    n_runs: int = 1


def dtype_name(name: str) -> str:
    """torch's name of an nccl-tests / NCCL dtype ('half' -> 'float16')."""
    return _DTYPE_NAMES.get(name, name)


def record_of(row: CollectiveRow, fingerprint: DeviceFingerprint, source: str, backend: str = "nccl") -> KernelRecord:
    key = collective_key(row.op, row.message_bytes, row.world, row.ranks_per_node, backend, row.dtype)
    return KernelRecord(fingerprint, key, row.time_ns, min(row.p10_ns, row.time_ns), max(row.p90_ns, row.time_ns),
                        max(1, row.n_runs), 0.0, 0, source)


# ---------------------------------------------------------------------------------------------------------
# nccl-tests
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NcclTestsTable:
    op: str
    rows: tuple[CollectiveRow, ...]
    gpu_name: str          # as the Rank lines print it ('' when absent)
    hosts: tuple[str, ...]
    nccl_version: str


def is_nccl_tests_output(path: Union[str, os.PathLike]) -> bool:
    """True when the file has an nccl-tests header line (``#  size  count  type ...  time  algbw  busbw``)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return any(_header_tokens(line) is not None for line in fh)
    except OSError:
        return False


def _header_tokens(line: str) -> Optional[list[str]]:
    if not line.startswith("#"):
        return None
    tokens = line.lstrip("#").split()
    if tokens[:2] == ["size", "count"] and "time" in tokens and "busbw" in tokens:
        return tokens
    return None


def _op_from_name(text: str) -> Optional[str]:
    stem = text.lower()
    for name in ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv", "broadcast"):
        if name in stem or name.replace("_", "") in stem:
            return canonical_op(name)
    return None


def parse_nccl_tests_runs(path: Union[str, os.PathLike], op: Optional[str] = None,
                          ranks_per_node: Optional[int] = None) -> list[NcclTestsTable]:
    """Every run in an nccl-tests output file (logs of several ``*_perf`` runs concatenated are split at each
    run's ``Collective test starting`` / ``# nThread`` line). Raises CollectiveError naming the line."""
    path = Path(path)
    segments: list[list[tuple[int, str]]] = [[]]
    has_table = False
    for line_no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        stripped = line.strip()
        starts_run = stripped.startswith("# nThread") or _OP_LINE.search(stripped) is not None
        if starts_run and has_table:
            segments.append([])
            has_table = False
        has_table = has_table or _header_tokens(stripped) is not None
        segments[-1].append((line_no, stripped))
    runs = [seg for seg in segments if any(_header_tokens(text) is not None for _, text in seg)]
    if not runs:
        raise CollectiveError(f"{path}: no nccl-tests table (a '#  size  count  type ... time  algbw  busbw' header)")
    file_op = _op_from_name(path.name) if len(runs) == 1 else None
    return [_parse_run(path, seg, op, ranks_per_node, file_op) for seg in runs]


def parse_nccl_tests(path: Union[str, os.PathLike], op: Optional[str] = None,
                     ranks_per_node: Optional[int] = None) -> NcclTestsTable:
    """The one run of an nccl-tests output file (``parse_nccl_tests_runs`` for files with several)."""
    runs = parse_nccl_tests_runs(path, op, ranks_per_node)
    if len(runs) != 1:
        raise CollectiveError(f"{path}: {len(runs)} nccl-tests runs in one file; read them with parse_nccl_tests_runs")
    return runs[0]


def _parse_run(path: Path, lines: list[tuple[int, str]], op: Optional[str], ranks_per_node: Optional[int],
               file_op: Optional[str]) -> NcclTestsTable:
    header: Optional[list[str]] = None
    ranks: dict[int, tuple[str, str]] = {}
    found_op = canonical_op(op) if op else None
    nccl_version = ""
    iters = 1
    raw_rows: list[tuple[int, list[str]]] = []
    for line_no, stripped in lines:
        if not stripped:
            continue
        if stripped.startswith("#"):
            tokens = _header_tokens(stripped)
            if tokens is not None:
                header = tokens
                continue
            if (m := _RANK_LINE.match(stripped)) is not None:
                ranks[int(m.group(1))] = (m.group(2), m.group(3).strip())
            elif found_op is None and (m := _OP_LINE.search(stripped)) is not None:
                found_op = canonical_op(m.group(1))
            elif (m := _NCCL_VERSION.search(stripped)) is not None:
                nccl_version = m.group(1)
            for prefix, value in _ITERS.findall(stripped):   # "warmup iters: 5 iters: 20 agg iters: 1"
                if not prefix:
                    iters = int(value)
            continue
        if header is not None and stripped[0].isdigit():
            raw_rows.append((line_no, stripped.split()))
    assert header is not None   # runs are chosen by their header
    found_op = found_op or file_op
    where = f"{path}:{lines[0][0]}"
    if found_op is None:
        raise CollectiveError(f"{where}: cannot tell which collective this is; pass --op")
    world = len(ranks)
    if world < 1:
        raise CollectiveError(f"{where}: no '#  Rank N Group G Pid P on HOST device D [..] GPU' lines: "
                              "the world size is unknown")
    hosts = tuple(sorted({host for host, _ in ranks.values()}))
    per_node = ranks_per_node or world // len(hosts)
    if per_node < 1 or world % per_node:
        raise CollectiveError(f"{where}: {world} ranks do not split into nodes of {per_node}")
    time_cols = [i for i, t in enumerate(header) if t == "time"]
    size_col, type_col = header.index("size"), header.index("type")
    by_size: dict[int, CollectiveRow] = {}
    for line_no, tokens in raw_rows:
        if len(tokens) < time_cols[0] + 1:
            raise CollectiveError(f"{path}:{line_no}: {len(tokens)} columns, the header has {len(header)}")
        try:
            size = int(tokens[size_col])
            oop_us = float(tokens[time_cols[0]])
        except ValueError as exc:
            raise CollectiveError(f"{path}:{line_no}: not a number ({exc})") from None
        others_us = [float(tokens[i]) for i in time_cols[1:] if i < len(tokens) and _is_number(tokens[i])]
        if size < 0 or oop_us < 0 or any(t < 0 for t in others_us):
            raise CollectiveError(f"{path}:{line_no}: negative size or time")
        all_ns = [t * 1e3 for t in [oop_us] + others_us]   # in-place may print N/A
        by_size[size] = CollectiveRow(found_op, size, world, per_node, dtype_name(tokens[type_col]), oop_us * 1e3,
                                      min(all_ns), max(all_ns), iters)
    if not by_size:
        raise CollectiveError(f"{where}: the nccl-tests table has no rows")
    gpu_names = sorted({gpu for _, gpu in ranks.values()})
    return NcclTestsTable(found_op, tuple(by_size[s] for s in sorted(by_size)), gpu_names[0] if gpu_names else "",
                          hosts, nccl_version)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def nccl_tests_records(table: NcclTestsTable, device_name: str, source_file: str) -> list[KernelRecord]:
    detail = json.dumps({"backend": "nccl", "nccl_version": table.nccl_version, "gpu": table.gpu_name,
                         "file": source_file}, sort_keys=True)
    fp = DeviceFingerprint(device_name, "cuda", "", "", f"nccl {table.nccl_version}".strip(),
                           ",".join(table.hosts)[:200], 0, detail)
    label = f"import:nccl-tests:{Path(source_file).name}"
    return [record_of(row, fp, label) for row in table.rows]


def write_nccl_tests(path: Union[str, os.PathLike], op: str, rows: list[CollectiveRow], gpu_name: str,
                     hosts: list[str]) -> None:
    """Write rows as nccl-tests prints them (used by tests and to share boomfx measurements in that format)."""
    from boomfx.kernels_db.collective_model import bus_factor
    world = rows[0].world if rows else 1
    lines = [f"# Collective test starting: {op}_perf",
             "# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 "
             "agg iters: 1 validation: 1 graph: 0", "#", "# Using devices"]
    for rank in range(world):
        lines.append(f"#  Rank {rank:2d} Group  0 Pid {1000 + rank:6d} on {hosts[rank % len(hosts)]:>10} device "
                     f"{rank % max(1, world // len(hosts)):2d} [0x{16 + rank:02x}] {gpu_name}")
    lines += ["#", "#" + " " * 60 + "out-of-place                       in-place",
              "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   "
              "algbw   busbw #wrong",
              "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  "
              "(GB/s)  (GB/s)"]
    for row in rows:
        elem = DTYPE_BYTES.get(row.dtype, 1)
        nccl_type = {"float16": "half", "float32": "float", "float64": "double"}.get(row.dtype, row.dtype)
        t_us = row.time_ns / 1e3
        algbw = row.message_bytes / (t_us * 1e3) if t_us > 0 else 0.0
        busbw = algbw * bus_factor(row.op, world)
        lines.append(f"{row.message_bytes:12d} {row.message_bytes // elem:13d} {nccl_type:>9} {'sum':>7} {-1:7d} "
                     f"{t_us:8.2f} {algbw:7.2f} {busbw:7.2f} {0:6d} {t_us:8.2f} {algbw:7.2f} {busbw:7.2f} {0:6d}")
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 0", "#"]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# The public NCCL table
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublicCollectiveRow:
    system: str
    device: str            # boomfx registry name
    nccl_version: str
    row: CollectiveRow


def is_public_collectives_csv(path: Union[str, os.PathLike]) -> bool:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh), [])
    except (OSError, UnicodeDecodeError):
        return False
    return set(PUBLIC_COLUMNS) <= set(header)


def iter_public_collectives(path: Union[str, os.PathLike]) -> Iterator[PublicCollectiveRow]:
    """Rows of the public table with bytes = elements x dtype size (the whole buffer) and time in ns."""
    from boomfx.kernels_db.measure import registry_device_name
    with open(path, newline="", encoding="utf-8") as fh:
        for line_no, raw in enumerate(csv.DictReader(fh), start=2):
            try:
                elem = DTYPE_BYTES[raw["nccl_dtype"]]
                world = int(raw["num_gpus"])
                time_ns = float(raw["latency_ms"]) * 1e6
                row = CollectiveRow(canonical_op(raw["op_name"]), int(raw["message_elements"]) * elem, world, world,
                                    dtype_name(raw["nccl_dtype"]), time_ns, time_ns, time_ns)
            except (KeyError, ValueError, CollectiveError) as exc:
                raise CollectiveError(f"{path}:{line_no}: {exc}") from None
            device = registry_device_name(raw["device"])
            if device is None:
                raise CollectiveError(f"{path}:{line_no}: device '{raw['device']}' is not in the device registry")
            yield PublicCollectiveRow(raw["system"], device, raw["nccl_version"], row)


def public_records(rows: list[PublicCollectiveRow], source_label: str = "aiconfigurator-nccl") -> list[KernelRecord]:
    out = []
    for r in rows:
        fp = DeviceFingerprint(r.device, "cuda", "", "", f"nccl {r.nccl_version}", f"public:{r.system}", 0,
                               json.dumps({"backend": "nccl", "system": r.system}, sort_keys=True))
        out.append(record_of(r.row, fp, f"import:{source_label}"))
    return out
