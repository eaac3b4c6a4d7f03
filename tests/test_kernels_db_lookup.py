"""Lookup contracts: exact hit -> measured, inside the hull -> interpolated between neighbours,
outside / unknown -> model hook or roofline, always labelled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boomfx.core.devices import get_device
from boomfx.kernels_db.collectors import build_call, spec
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.lookup import KernelPricer
from boomfx.kernels_db.price import PriceSource
from boomfx.kernels_db.roofline import op_class, roofline_ns
from boomfx.kernels_db.schema import DeviceFingerprint, KernelRecord
from boomfx.kernels_db.store import Store
from boomfx.passes.costs.registry import Cost

aten = torch.ops.aten
F32 = torch.float32
FP = DeviceFingerprint("NVIDIA H100", "cuda", "2.13.0", "12.4", "550", "gpuhost", 8, "")


def mm(m: int, k: int, n: int):
    return build_call(aten.mm.default, (spec((m, k), F32), spec((k, n), F32)))


def relu(numel: int):
    return build_call(aten.relu.default, (spec((numel,), F32),))


def mm_cost(m: int, k: int, n: int) -> Cost:
    return Cost(2 * m * k * n, 4 * (m * k + k * n), 4 * m * n)


def relu_cost(numel: int) -> Cost:
    return Cost(numel, 4 * numel, 4 * numel)


def record(call, median_ns: float, workspace_bytes: int = 0) -> KernelRecord:
    return KernelRecord(
        FP, kernel_key(call), median_ns, median_ns, median_ns, 5, 3000.0, workspace_bytes, "measured:cuda"
    )


@pytest.fixture()
def pricer(tmp_path: Path) -> KernelPricer:
    rows = [
        record(mm(64, 64, 64), 5_000.0),
        record(mm(256, 256, 256), 20_000.0),
        record(relu(1 << 14), 2_000.0),
        record(relu(1 << 16), 4_500.0, workspace_bytes=1024),
    ]
    with Store(tmp_path / "k.sqlite") as store:
        store.put_many(rows)
        return KernelPricer(store, get_device("h100"))


def test_exact_hit_returns_the_measured_median(pricer: KernelPricer) -> None:
    price = pricer.price(mm(64, 64, 64), mm_cost(64, 64, 64))
    assert price.source == PriceSource.MEASURED == "measured"
    assert (price.time_ns, price.host_ns) == (5_000.0, 3000.0)
    assert not price.host_in_time


def test_matmul_interpolation_lies_between_neighbours(pricer: KernelPricer) -> None:
    # 128^3 is the log-space midpoint of 64^3 and 256^3: equal inverse-distance weights give the geometric
    # mean throughput, so time = sqrt(5000 * 20000) = 10000 ns.
    price = pricer.price(mm(128, 128, 128), mm_cost(128, 128, 128))
    assert price.source == PriceSource.INTERPOLATED
    assert 5_000.0 < price.time_ns < 20_000.0
    assert price.time_ns == pytest.approx(10_000.0, rel=1e-9)


def test_memory_interpolation_is_log_linear_in_size(pricer: KernelPricer) -> None:
    # 2^15 elements: halfway between 2^14 and 2^16 in log size, so log time is halfway too:
    # sqrt(2000 * 4500) = 3000 ns.
    price = pricer.price(relu(1 << 15), relu_cost(1 << 15))
    assert price.source == PriceSource.INTERPOLATED
    assert price.time_ns == pytest.approx(3_000.0, rel=1e-9)


def test_no_interpolation_across_an_unmeasured_gap(tmp_path: Path) -> None:
    # Rows 2^10 and 2^20 apart: a query at 2^15 is inside the hull but 32x from either row.
    with Store(tmp_path / "k.sqlite") as store:
        store.put_many([record(relu(1 << 10), 2_000.0), record(relu(1 << 20), 40_000.0)])
        pricer = KernelPricer(store, get_device("h100"))
    price = pricer.price(relu(1 << 15), relu_cost(1 << 15))
    assert price.source == PriceSource.ROOFLINE and "neighbour" in price.detail


def test_small_extrapolation_margin_then_roofline(pricer: KernelPricer) -> None:
    inside = pricer.price(relu(int((1 << 16) * 1.2)), relu_cost(int((1 << 16) * 1.2)))
    assert inside.source == PriceSource.INTERPOLATED  # within the x1.25 margin: constant throughput
    outside = pricer.price(relu(1 << 24), relu_cost(1 << 24))
    assert outside.source == PriceSource.ROOFLINE
    assert "hull" in outside.detail


def test_unknown_op_falls_back_to_roofline(pricer: KernelPricer) -> None:
    call = build_call(aten.sigmoid.default, (spec((4096,), F32),))
    price = pricer.price(call, relu_cost(4096))
    assert price.source == PriceSource.ROOFLINE
    device = get_device("h100")
    assert price.time_ns == pytest.approx(roofline_ns(call, relu_cost(4096), device))
    assert price.host_ns == device.host_issue_ns


def test_model_hook_is_consulted_before_roofline(tmp_path: Path) -> None:
    seen = []

    def model(call, device):
        seen.append(call.op)
        return 1234.0 if call.op is aten.mm.default else None

    with Store(tmp_path / "empty.sqlite") as store:
        pricer = KernelPricer(store, get_device("h100"), model=model, model_source=PriceSource.TRANSFERRED)
    assert pricer.price(mm(32, 32, 32), mm_cost(32, 32, 32)).source == PriceSource.TRANSFERRED
    assert pricer.price(relu(10), relu_cost(10)).source == PriceSource.ROOFLINE
    assert seen == [aten.mm.default, aten.relu.default]


def test_roofline_by_hand() -> None:
    device = get_device("h100")
    call = build_call(aten.mm.default, (spec((1024, 1024), torch.float16), spec((1024, 1024), torch.float16)))
    cost = Cost(2 * 1024**3, 2 * 2 * 1024**2, 2 * 1024**2)
    # compute: 2*1024^3 FLOPs / (fp16 peak * matmul eff); memory: 3 * 2 MiB / (bandwidth * memory eff)
    compute_ns = 2 * 1024**3 / (device.peak_flops_per_s[torch.float16] * device.efficiency["matmul"]) * 1e9
    memory_ns = 3 * 2 * 1024**2 / (device.memory_bandwidth_bytes_per_s * device.efficiency["memory"]) * 1e9
    assert op_class(aten.mm.default) == "matmul" and op_class(aten.relu.default) == "memory"
    assert roofline_ns(call, cost, device) == pytest.approx(
        max(compute_ns, memory_ns) + device.kernel_launch_ns
    )


def test_no_store_means_roofline() -> None:
    pricer = KernelPricer(None, get_device("a100"))
    assert pricer.price(mm(64, 64, 64), mm_cost(64, 64, 64)).source == PriceSource.ROOFLINE
