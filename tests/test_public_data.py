"""Public NeuSight CSV import: counts per device and op, units, size convention and provenance."""
from __future__ import annotations

import csv
from collections import Counter

import pytest
import torch

from boomfx.core.devices import get_device
from boomfx.kernels_db.public_data import (
    CSV_FILES, DEFAULT_DATA_DIR, DEVICE_NAMES, OP_NAMES, SOURCE, import_rows, load_public_rows, to_opcall,
)

aten = torch.ops.aten
DATA = DEFAULT_DATA_DIR / "dataset" / "test"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="public GPU measurements not present")


@pytest.fixture(scope="module")
def rows():
    return load_public_rows(DEFAULT_DATA_DIR)


def _csv_counts() -> Counter:
    """Counted independently of the parser: the csv module and the raw Device/OPName strings."""
    counts: Counter = Counter()
    for name in CSV_FILES:
        with open(DATA / name, newline="") as fh:
            for rec in csv.DictReader(fh):
                counts[(rec["Device"], rec["OPName"])] += 1
    return counts


def test_row_counts_per_device_and_op(rows):
    expected = _csv_counts()
    got = Counter((r.source_device, r.source_op) for r in rows)
    assert got == expected
    assert len(rows) == sum(expected.values()) == 27339   # 8254 + 13461 + 4558 + 533 + 533
    mapped = Counter((r.device, r.op) for r in rows)
    assert mapped[("h100-sxm", "linear")] == expected[("NVIDIA H100 80GB HBM3", "linear")] == 1040


def test_devices_map_to_boomfx_specs(rows):
    assert {r.device for r in rows} == set(DEVICE_NAMES.values())
    for name in DEVICE_NAMES.values():
        assert get_device(name).name == name
    assert {r.op for r in rows} == set(OP_NAMES.values())


def test_latency_is_converted_from_ms_once(rows):
    with open(DATA / "linear.csv", newline="") as fh:
        first = next(csv.DictReader(fh))
    row = next(r for r in rows if r.op == "linear")
    assert row.latency_ns == pytest.approx(float(first["Latency"]) * 1e6)   # ms -> ns


def test_gemm_sizes_use_boomfx_convention(rows):
    # NeuSight: bmm(x[B,M,N], y[B,N,K]) -> its N is the contraction; boomfx: out [b,m,n], contraction k.
    row = next(r for r in rows if r.op == "bmm")
    assert (row.b, row.m, row.k, row.n) == tuple(row.csv_sizes[c] for c in "BMNK")
    call = to_opcall(row)
    assert call.op is aten.bmm.default
    assert tuple(int(s) for s in call.arg("self").shape) == (row.b, row.m, row.k)
    assert tuple(int(s) for s in call.outputs[0].shape) == (row.b, row.m, row.n)


def test_provenance_kept(rows):
    for r in rows[:: max(1, len(rows) // 200)]:
        p = r.provenance
        assert p.source == SOURCE and p.torch_version == "2.1.0" and p.cuda_version == "12.1"
        assert p.tf32 is False and p.file in CSV_FILES
        assert r.dtype == torch.float32 and r.kernel_name
        assert r.geometry.num_blocks >= 1


def test_opcalls_for_every_op(rows):
    seen = {}
    for r in rows:
        seen.setdefault(r.op, r)
    ops = {op: to_opcall(r).op for op, r in seen.items()}
    assert ops["linear"] is aten.linear.default
    assert to_opcall(seen["linear"], "addmm").op is aten.addmm.default
    assert ops["add_scalar"] is aten.add.Tensor and ops["pow_scalar"] is aten.pow.Tensor_Scalar
    assert ops["layer_norm"] is aten.native_layer_norm.default and ops["softmax"] is aten._softmax.default
    assert to_opcall(seen["add_scalar"]).arg("other") == 0.5


def test_import_rows_hands_every_row_to_the_sink(rows):
    got = []
    n = import_rows(rows[:50], lambda row, call: got.append((row, call)))
    assert n == 50 and len(got) == 50 and got[0][1].op is aten.linear.default


def test_import_public_into_store(tmp_path, rows):
    from boomfx.kernels_db.public_data import import_public
    from boomfx.kernels_db.store import Store

    ln_csv = DATA / "ln.csv"
    with Store(tmp_path / "k.sqlite") as store:
        n = import_public(store, ln_csv)
        assert n == 533 and store.count() == 533     # one record per row: no key collisions
        rec = next(store.records(op=None))
        assert rec.source == "import:neusight-asplos25" and rec.fingerprint.torch_version == "2.1.0"
