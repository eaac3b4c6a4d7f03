"""A database holding several devices' rows prices each device with its own rows only (kernels_db/device_rows.py).

Truth: the same analysis with a per-device database. Before the filter, one file of eight GPUs priced BERT-large's
``aten.linear`` on ``h100-sxm`` by interpolating every GPU's rows together (1.42 ms per call instead of 0.39 ms).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boomfx.analysis.analysis import analyze
from boomfx.cli.main import main
from boomfx.core.devices import get_device
from boomfx.kernels_db.blocks_db import BLOCK_OP, block_records
from boomfx.kernels_db.collectors import build_call, spec
from boomfx.kernels_db.device_rows import devices_in, is_of_device
from boomfx.kernels_db.host_overheads import EVENTS, HostCosts, host_key
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.lookup import KernelPricer
from boomfx.kernels_db.schema import DeviceFingerprint, KernelKey, KernelRecord, canonical_json
from boomfx.kernels_db.store import Store
from boomfx.passes.costs.registry import Cost

aten = torch.ops.aten
F32 = torch.float32
PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu-kernel-measurements"
needs_public = pytest.mark.skipif(not PUBLIC.exists(), reason="the public GPU measurements are not next to this checkout")


# ---------------------------------------------------------------------------------------------------
# The property: another device's rows never change a price (exact, interpolated, host rows, blocks, workspace)
# ---------------------------------------------------------------------------------------------------
TARGET = get_device("h100-sxm")
TARGET_FP = DeviceFingerprint("h100-sxm", "cuda", "2.13.0", "12.4", "550", "gpuhost", 8, "")
TARGET_RAW_FP = DeviceFingerprint("NVIDIA H100 80GB HBM3", "cuda", "2.12.0", "12.4", "550", "other", 8, "")
OTHER_FPS = (
    DeviceFingerprint("p4", "cuda", "2.13.0", "12.4", "550", "gpuhost", 8, ""),
    DeviceFingerprint("NVIDIA A100-PCIE-40GB", "cuda", "2.13.0", "12.4", "550", "gpuhost", 8, ""),
    DeviceFingerprint("h100-pcie", "cuda", "2.13.0", "12.4", "550", "gpuhost", 8, ""),   # same family, other part
    DeviceFingerprint("cpu", "cpu", "2.13.0", "", "", "gpuhost", 8, "x86"),
)


def mm(m: int, k: int, n: int):
    return build_call(aten.mm.default, (spec((m, k), F32), spec((k, n), F32)))


def relu(numel: int):
    return build_call(aten.relu.default, (spec((numel,), F32),))


def _block_key(i: int) -> KernelKey:
    return KernelKey(BLOCK_OP, "float32", canonical_json({"op": BLOCK_OP, "signature": f"sig{i}", "phases": [],
                                                          "nodes": 3, "inputs": []}))


# a pool of keys both devices may hold: kernels, host events, block rows
KERNEL_CALLS = [mm(64, 64, 64), mm(128, 128, 128), mm(256, 256, 256), relu(1 << 14), relu(1 << 16), relu(1 << 18)]
POOL = [kernel_key(c) for c in KERNEL_CALLS] + [host_key(e) for e in EVENTS[:3]] + [_block_key(0), _block_key(1)]
QUERIES = [(mm(64, 64, 64), Cost(2 * 64 ** 3, 8 * 64 ** 2, 4 * 64 ** 2)),
           (mm(100, 100, 100), Cost(2 * 100 ** 3, 8 * 100 ** 2, 4 * 100 ** 2)),
           (mm(200, 256, 256), Cost(2 * 200 * 256 * 256, 4 * (200 + 256) * 256, 4 * 200 * 256)),
           (relu(1 << 15), Cost(1 << 15, 4 << 15, 4 << 15)),
           (relu(1 << 17), Cost(1 << 17, 4 << 17, 4 << 17))]


def _record(fp: DeviceFingerprint, key: KernelKey, median_ns: float, workspace: int, created_at: str) -> KernelRecord:
    return KernelRecord(fp, key, median_ns, median_ns, median_ns, 5, 2_000.0, workspace, "measured:cuda",
                        created_at)


TARGET_ROWS = ([(TARGET_FP, POOL[i], t, w) for i, t, w in ((0, 5_000.0, 0), (2, 20_000.0, 4096), (3, 2_000.0, 0),
                                                         (4, 4_500.0, 1024))]
               + [(TARGET_RAW_FP, POOL[5], 9_000.0, 0)]                    # a raw CUDA name is the same device
               + [(TARGET_FP, POOL[6], 40_000.0, 0), (TARGET_FP, POOL[9], 77_000.0, 0)])  # a host row, a block row

other_rows = st.lists(st.tuples(st.sampled_from(OTHER_FPS), st.sampled_from(POOL),
                                st.floats(min_value=1.0, max_value=1e8), st.integers(0, 1 << 30)), max_size=12)


def _prices(path: Path) -> tuple:
    pricer = KernelPricer(Store(path), TARGET)
    prices = [pricer.price(call, cost) for call, cost in QUERIES]
    host = HostCosts.from_records(list(pricer.host_records.values()), "cuda", l2_bytes=1 << 20)
    return prices, host, block_records(Store(path), TARGET)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(others=other_rows)
def test_another_devices_rows_never_change_a_price(others: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        alone, mixed = Path(tmp) / "alone.sqlite", Path(tmp) / "mixed.sqlite"
        target = [_record(fp, key, t, w, "2026-01-01T00:00:00+00:00") for fp, key, t, w in TARGET_ROWS]
        # the other device's rows are newer: without the filter the newest row of a key would win
        foreign = [_record(fp, key, t, w, "2026-06-01T00:00:00+00:00") for fp, key, t, w in others]
        with Store(alone) as store:
            store.put_many(target)
        with Store(mixed) as store:
            store.put_many(target + foreign)
        expected, got = _prices(alone), _prices(mixed)
    assert got == expected
    prices, host, blocks = expected
    assert prices[0].source == "measured" and prices[0].time_ns == 5_000.0   # the target's own row
    assert host.values[EVENTS[0]] == 40_000.0 and len(blocks) == 1


def test_raw_cuda_names_and_aliases_are_one_device() -> None:
    assert is_of_device(TARGET_RAW_FP, TARGET) and is_of_device(TARGET_FP, get_device("h100"))
    assert not any(is_of_device(fp, TARGET) for fp in OTHER_FPS)
    assert is_of_device(OTHER_FPS[3], get_device("cpu"))


# ---------------------------------------------------------------------------------------------------
# The public data: one file of several GPUs against per-device files
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def public_dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("dbs")
    paths = {"both": str(out / "both.sqlite")}
    for device in ("h100-sxm", "p4"):
        paths[device] = str(out / f"{device}.sqlite")
        assert main(["kernels", "import", str(PUBLIC), "--device", device, "--db", paths[device]]) == 0
        assert main(["kernels", "import", str(PUBLIC), "--device", device, "--db", paths["both"]]) == 0
    return paths


def _bertish(tmp_path: Path) -> str:
    from torch.export import Dim

    from models import GPT
    with torch.device("meta"):
        model = GPT(vocab=4096, d=1024, layers=2, heads=16, max_seq=1024)
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    ep = torch.export.export(model, (idx,), dynamic_shapes={"idx": {0: Dim("batch", min=1, max=64),
                                                                     1: Dim("seq", min=2, max=1024)}})
    path = tmp_path / "gpt.pt2"
    torch.export.save(ep, str(path))
    return str(path)


def _by_node(report) -> dict[str, tuple[float, str]]:
    return {k.node: (k.time_ns, k.source) for k in report.kernels}


@needs_public
def test_a_file_of_two_gpus_prices_each_with_its_own_rows(public_dbs: dict[str, str], tmp_path: Path) -> None:
    path = _bertish(tmp_path)
    for device in ("h100-sxm", "p4"):
        own = analyze(path, device=device, db=public_dbs[device], batch=16, seq=512)
        both = analyze(path, device=device, db=public_dbs["both"], batch=16, seq=512)
        assert _by_node(both) == _by_node(own)
        assert both.time.total_ns == own.time.total_ns and not both.warnings
        assert any(src in ("measured", "interpolated") for _, src in _by_node(own).values())
    # the two GPUs' own rows differ by far (P4: 5.5 TF fp32, H100: 67 TF), so mixing them would show
    h100 = analyze(path, device="h100-sxm", db=public_dbs["both"], batch=16, seq=512)
    p4 = analyze(path, device="p4", db=public_dbs["both"], batch=16, seq=512)
    assert p4.time.total_ns > 5 * h100.time.total_ns


@needs_public
def test_a_file_without_the_target_says_so_once(public_dbs: dict[str, str], tmp_path: Path, capsys) -> None:
    path = _bertish(tmp_path)
    with_p4 = analyze(path, device="h100-sxm", db=public_dbs["p4"], batch=4, seq=128)
    without = analyze(path, device="h100-sxm", db="none", batch=4, seq=128)
    assert _by_node(with_p4) == _by_node(without)          # the model and the roofline, as with no database
    lines = [w for w in with_p4.warnings if "no rows measured on h100-sxm" in w]
    assert len(lines) == 1 and "p4 (1760 rows)" in lines[0]
    assert main(["analyze", path, "--device", "h100-sxm", "--db", public_dbs["p4"], "--batch", "4", "--seq", "128",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sum("no rows measured on h100-sxm" in w for w in report["warnings"]) == 1


@needs_public
def test_kernels_info_lists_each_device_with_its_row_count(public_dbs: dict[str, str], capsys) -> None:
    expected = {}
    for device in ("h100-sxm", "p4"):
        with Store(public_dbs[device]) as store:
            expected[device] = store.count()
    assert {d.device_name: d.rows for d in devices_in(Store(public_dbs["both"]))} == expected
    assert main(["kernels", "info", "--db", public_dbs["both"]]) == 0
    out = capsys.readouterr().out
    assert f"{sum(expected.values())} rows of 2 devices" in out
    for device, n in expected.items():
        assert f"  {device} (cuda): {n} rows, 1 fingerprint" in out


@needs_public
def test_from_db_of_several_gpus_transfers_from_each_gpus_own_rows(public_dbs: dict[str, str],
                                                                    tmp_path: Path) -> None:
    path = _bertish(tmp_path)
    # H200: same architecture as the H100 (sm90), so the H100's rows are the nearest source in the file
    via_h100 = analyze(path, device="h200", from_db=public_dbs["h100-sxm"], batch=8, seq=256)
    via_both = analyze(path, device="h200", from_db=public_dbs["both"], batch=8, seq=256)
    assert _by_node(via_both) == _by_node(via_h100)
    assert any(src == "transferred" for _, src in _by_node(via_both).values())
