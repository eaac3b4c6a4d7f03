"""Collectives in the database: nccl-tests import round-trip, the public NCCL table, a real gloo measurement."""
from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import pytest

from boomfx.cli.main import main
from boomfx.core.devices import get_device
from boomfx.kernels_db.collective_import import CollectiveRow, parse_nccl_tests, write_nccl_tests
from boomfx.kernels_db.collective_model import CollectiveGroup, model_time
from boomfx.kernels_db.collectives import CollectivePricer, price_collective
from boomfx.kernels_db.lookup import KernelPricer
from boomfx.kernels_db.price import PriceSource
from boomfx.kernels_db.store import Store

PUBLIC_CSV = (Path(__file__).resolve().parents[2] / "shared" / "data" / "collective-measurements"
              / "nccl_single_node.csv")

# As nccl-tests 2.13 prints an all_gather_perf run on two nodes of two GPUs (times made up, columns real).
NCCL_TESTS_OUTPUT = """\
# nThread 1 nGpus 1 minBytes 1024 maxBytes 4194304 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  31001 on     node-a device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  31002 on     node-a device  1 [0x2a] NVIDIA H100 80GB HBM3
#  Rank  2 Group  0 Pid  41001 on     node-b device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  3 Group  0 Pid  41002 on     node-b device  1 [0x2a] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
        1024            64     float    none      -1    21.50    0.05    0.04      0    20.90    0.05    0.04      0
       16384          1024     float    none      -1    24.00    0.68    0.51      0    23.10    0.71    0.53      0
      262144         16384     float    none      -1    40.00    6.55    4.92      0    41.00    6.39    4.80      0
     4194304        262144     float    none      -1   180.00   23.30   17.48      0   175.00   23.97   17.98      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 5.7
#
"""


def test_parse_nccl_tests_reads_world_nodes_op_and_both_times(tmp_path: Path) -> None:
    path = tmp_path / "all_gather_perf.txt"
    path.write_text(NCCL_TESTS_OUTPUT)
    table = parse_nccl_tests(path)
    assert table.op == "all_gather"                       # from the file name
    assert table.hosts == ("node-a", "node-b")
    assert [(r.world, r.ranks_per_node) for r in table.rows] == [(4, 2)] * 4
    first = table.rows[0]
    assert (first.message_bytes, first.dtype, first.time_ns) == (1024, "float32", 21_500.0)
    assert (first.p10_ns, first.p90_ns, first.n_runs) == (20_900.0, 21_500.0, 20)   # in-place is faster here
    assert table.rows[-1].p90_ns == 180_000.0 and table.rows[-1].p10_ns == 175_000.0


def test_nccl_tests_import_prices_as_measured_and_interpolates(tmp_path: Path, capsys) -> None:
    path = tmp_path / "all_gather_perf.txt"
    path.write_text(NCCL_TESTS_OUTPUT)
    db = tmp_path / "h100.sqlite"
    assert main(["kernels", "import", str(path), "--db", str(db)]) == 0
    assert "all_gather, 4 ranks (2 per node) on h100-sxm: 4 rows" in capsys.readouterr().out
    group = CollectiveGroup.of(4, ranks_per_node=2)
    device = get_device("h100-sxm")
    exact = price_collective("all_gather", 262144, group, device, Store(db))
    assert (exact.source, exact.time_ns) == (PriceSource.MEASURED, 40_000.0)
    between = price_collective("all_gather", 65536, group, device, Store(db))
    # log-log between (16384 B, 24 us) and (262144 B, 40 us): 65536 is halfway in log -> sqrt(24 * 40) us
    assert between.source == PriceSource.INTERPOLATED
    assert between.time_ns == pytest.approx(math.sqrt(24_000.0 * 40_000.0), rel=1e-12)
    other = price_collective("all_gather", 262144, CollectiveGroup.of(4), device, Store(db))  # one node of 4
    assert other.source == PriceSource.MODEL
    assert KernelPricer(Store(db), device)._exact == {}   # the kernel pricer leaves collective rows alone


def test_written_table_round_trips(tmp_path: Path) -> None:
    rows = [CollectiveRow("all_reduce", 1 << k, 8, 8, "float16", 10_000.0 + 500.0 * k, 10_000.0 + 500.0 * k,
                          10_000.0 + 500.0 * k) for k in range(10, 21, 2)]
    path = tmp_path / "out.txt"
    write_nccl_tests(path, "all_reduce", rows, "NVIDIA H200", ["host-1"])
    table = parse_nccl_tests(path)
    assert table.op == "all_reduce" and table.gpu_name == "NVIDIA H200"
    assert [(r.message_bytes, r.world, r.ranks_per_node, r.dtype) for r in table.rows] == \
           [(r.message_bytes, 8, 8, "float16") for r in rows]
    assert [r.time_ns for r in table.rows] == pytest.approx([r.time_ns for r in rows], rel=1e-9)


@pytest.mark.skipif(not PUBLIC_CSV.exists(), reason="public NCCL measurements not present")
def test_public_table_import_prices_its_rows(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["kernels", "import", str(PUBLIC_CSV), "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "h200: 504 new collective rows of 504" in out
    with open(PUBLIC_CSV, newline="") as fh:   # read independently of the importer
        table = [r for r in csv.DictReader(fh) if r["system"] == "h200_sxm" and r["op_name"] == "all_gather"
                 and r["num_gpus"] == "8"]
    rec = next(r for r in table if r["nccl_dtype"] == "half" and r["message_elements"] == "268435456")
    int8 = next(r for r in table if r["nccl_dtype"] == "int8" and r["message_elements"] == "536870912")
    db = tmp_path / "boomfx" / "kernels-h200.sqlite"
    group, h200 = CollectiveGroup.of(8), get_device("h200")
    price = price_collective("all_gather", 268435456 * 2, group, h200, Store(db))   # 512 MiB: half by preference
    assert price.source == PriceSource.MEASURED
    assert price.time_ns == pytest.approx(float(rec["latency_ms"]) * 1e6, rel=1e-12)
    as_int8 = price_collective("all_gather", 536870912, group, h200, Store(db), dtype="int8")   # the same bytes
    assert as_int8.time_ns == pytest.approx(float(int8["latency_ms"]) * 1e6, rel=1e-12)
    assert main(["kernels", "import", str(PUBLIC_CSV), "--device", "h200"]) == 0
    assert "h200: 0 new collective rows" in capsys.readouterr().out          # idempotent


@pytest.mark.slow   # two spawned processes import torch: ~5-13 s on a loaded 2-core machine
def test_gloo_measurement_with_two_processes_prices_as_measured(tmp_path: Path) -> None:
    from boomfx.kernels_db.collective_bench import collect_collectives
    db = tmp_path / "cpu.sqlite"
    sizes = (4096, 65536)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = collect_collectives(Store(db), world=2, ops=("all_reduce", "all_gather"), sizes=sizes,
                                  backend="gloo", warmup=2, iters=5)
    assert run.failed == () and len(run.rows) == 4
    assert all(r.p10_ns <= r.time_ns <= r.p90_ns and r.time_ns > 0 for r in run.rows)
    cpu = get_device("cpu")
    pricer = CollectivePricer(Store(db), cpu)
    assert len(pricer) == 4 and len(CollectivePricer(Store(db), get_device("h100-sxm"))) == 0   # other device
    for row in run.rows:
        price = pricer.price(row.op, row.message_bytes, CollectiveGroup.of(2))
        assert (price.source, price.time_ns) == (PriceSource.MEASURED, row.time_ns)
    unmeasured = pricer.price("all_reduce", 1 << 24, CollectiveGroup.of(2))   # outside the measured sizes
    assert unmeasured.source == PriceSource.MODEL
    assert unmeasured.time_ns == model_time("all_reduce", 1 << 24, CollectiveGroup.of(2), cpu).time_ns


def test_bad_collective_files_exit_2(tmp_path: Path, capsys) -> None:
    broken = tmp_path / "all_reduce_perf.txt"
    broken.write_text(NCCL_TESTS_OUTPUT.replace("    40.00 ", "    forty "))
    assert main(["kernels", "import", str(broken), "--db", str(tmp_path / "x.sqlite")]) == 2
    assert "not a number" in capsys.readouterr().err
    no_ranks = tmp_path / "sendrecv_perf.txt"
    no_ranks.write_text("\n".join(line for line in NCCL_TESTS_OUTPUT.splitlines() if "Rank" not in line))
    assert main(["kernels", "import", str(no_ranks), "--db", str(tmp_path / "x.sqlite")]) == 2
    assert "world size is unknown" in capsys.readouterr().err
    unnamed = tmp_path / "run.log"
    unnamed.write_text(NCCL_TESTS_OUTPUT)
    assert main(["kernels", "import", str(unnamed), "--db", str(tmp_path / "x.sqlite")]) == 2
    assert "pass --op" in capsys.readouterr().err
    assert main(["kernels", "import", str(unnamed), "--db", str(tmp_path / "x.sqlite"), "--op", "all_gather"]) == 0
    assert main(["kernels", "collect", "--collectives", "--world", "1", "--db", str(tmp_path / "y.sqlite")]) == 2


def test_concatenated_runs_are_split_and_in_place_na_is_ignored(tmp_path: Path, capsys) -> None:
    first = "# Collective test starting: all_reduce_perf\n" + NCCL_TESTS_OUTPUT
    second = ("# Collective test starting: alltoall_perf\n"
              + NCCL_TESTS_OUTPUT.replace("    20.90    0.05    0.04      0", "      N/A     N/A     N/A    N/A"))
    path = tmp_path / "cluster.log"
    path.write_text(first + second)
    from boomfx.kernels_db.collective_import import parse_nccl_tests_runs
    runs = parse_nccl_tests_runs(path)
    assert [r.op for r in runs] == ["all_reduce", "all_to_all"]
    a2a_first = runs[1].rows[0]
    assert (a2a_first.time_ns, a2a_first.p10_ns, a2a_first.p90_ns) == (21_500.0, 21_500.0, 21_500.0)
    db = tmp_path / "h100.sqlite"
    assert main(["kernels", "import", str(path), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "all_reduce, 4 ranks" in out and "all_to_all, 4 ranks" in out
    group = CollectiveGroup.of(4, ranks_per_node=2)
    price = price_collective("_c10d_functional.all_reduce_.default", 16384, group, get_device("h100-sxm"), Store(db))
    assert (price.source, price.time_ns) == (PriceSource.MEASURED, 24_000.0)


def test_a_measured_collective_row_keeps_the_mean_of_its_samples() -> None:
    """nccl-tests reports the average over its iterations, and a step pays every collective's tail: one stall
    of 3.4 ms among nine 0.4 ms all-reduces puts the row at their mean, 0.7 ms, where a median says 0.4."""
    from boomfx.kernels_db.collective_bench import summarize_samples
    samples = [400_000.0] * 9 + [3_400_000.0]
    mean, p10, p90 = summarize_samples(samples)
    assert mean == pytest.approx(700_000.0)
    assert p10 == pytest.approx(400_000.0)
    assert p90 == pytest.approx(400_000.0 + 0.1 * 3_000_000.0)   # between the 9th and 10th of 10 sorted
