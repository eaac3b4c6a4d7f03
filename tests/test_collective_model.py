"""Collective time model: hand-computed ring and tree times, algorithm/protocol choice, topology, bad input."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from boomfx.core.devices import get_device
from boomfx.core.errors import BoomfxError, CollectiveError
from boomfx.kernels_db.collective_model import (
    PROTOCOLS,
    ClusterTopology,
    CollectiveCalibration,
    CollectiveGroup,
    ProtocolParams,
    SimpleParams,
    default_calibration,
    intra_link,
    model_time,
)
from boomfx.kernels_db.collectives import price_collective
from boomfx.core.networks import UnknownNetworkError, get_network

# A made-up calibration with round numbers, so every time below is arithmetic on the page.
CAL = CollectiveCalibration(
    protocols={"LL": ProtocolParams(5_000.0, 500.0, 0.25), "LL128": ProtocolParams(10_000.0, 1_000.0, 0.5),
               "Simple": ProtocolParams(20_000.0, 2_000.0)},
    simple={op: SimpleParams(0.8, 0.0) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")},
)
# An NVSwitch node with 100 GB/s NVLink per GPU, of a family the calibration has no scale for (scale 1).
NODE = dataclasses.replace(get_device("h100-sxm"), nvlink_bytes_per_s=100e9, nvlink_generation=9)


def test_ring_all_reduce_large_message_is_simple_with_the_hand_time():
    est = model_time("all_reduce", 64 << 20, CollectiveGroup.of(4), NODE, CAL)
    # bus bytes = 2*(4-1)/4 * 64 MiB = 1.5 * 67108864 = 100663296
    # Simple: 20000 + 2*(4-1)=6 steps * 2000 = 32000 ns; 100663296 B / (100e9 * 0.8) = 1258291.2 ns
    # LL128: 16000 + 100663296 / 50e9 = 2029265.92 ns; LL: 8000 + 100663296 / 25e9 = 4034531.84 ns
    assert est.bus_bytes == 100663296
    assert (est.algorithm, est.protocol) == ("ring", "Simple")
    assert est.time_ns == pytest.approx(32_000 + 1_258_291.2, rel=1e-12)


def test_ring_all_reduce_small_message_is_ll():
    est = model_time("all_reduce", 1024, CollectiveGroup.of(4), NODE, CAL)
    # bus bytes = 1.5 * 1024 = 1536; LL: 5000 + 6*500 = 8000 + 1536 / 25e9 s = 61.44 ns -> 8061.44
    # Simple: 32000 + 19.2 ns; LL128: 16000 + 30.72 ns
    assert (est.algorithm, est.protocol) == ("ring", "LL")
    assert est.time_ns == pytest.approx(8_061.44, rel=1e-12)


def test_all_gather_size_is_the_whole_output_buffer():
    est = model_time("all_gather_into_tensor", 8 << 20, CollectiveGroup.of(8), NODE, CAL)
    # output 8 MiB, each rank receives 7/8 of it: bus bytes 7340032; Simple 20000 + 7*2000 = 34000 ns
    # + 7340032 / 80e9 s = 91750.4 ns (LL128: 17000 + 146800.64; LL: 8500 + 293601.28)
    assert est.bus_bytes == 7 * (1 << 20)
    assert est.time_ns == pytest.approx(34_000 + 91_750.4, rel=1e-12)
    same = model_time("reduce_scatter_tensor", 8 << 20, CollectiveGroup.of(8), NODE, CAL)
    assert same.time_ns == pytest.approx(est.time_ns, rel=1e-12)   # same bus bytes and steps, same parameters


def test_tree_wins_small_all_reduce_across_nodes_and_ring_large():
    group = CollectiveGroup.of(8, ranks_per_node=4, network="ib-ndr")
    assert (group.nodes, group.ranks_per_node) == (2, 4)
    small = model_time("all_reduce", 1024, group, NODE, CAL)
    # tree LL: 5000 + 2*((4-1)*500 + log2(2)*5000) = 18000 ns; 1024 B / (25e9 * 0.92 * 0.5) = 89.04 ns
    # ring LL: 14 steps, 2*2=4 cross nodes: 5000 + 10*500 + 4*2700 = 20800 + 1792/25e9 = 20871.68 ns
    assert (small.algorithm, small.protocol) == ("tree", "LL")
    assert small.time_ns == pytest.approx(18_000 + 1024 / (25e9 * 0.92 * 0.5) * 1e9, rel=1e-12)
    large = model_time("all_reduce", 1 << 30, group, NODE, CAL)
    # 4 NICs of 50 GB/s at 0.92: 184 GB/s > NVLink 100 GB/s * 0.8 -> ring Simple on 80 GB/s:
    # 20000 + 10*2000 + 4*14000 = 96000 ns + 1.75 * 2^30 / 80e9 s = 23488102.4 ns
    assert (large.algorithm, large.protocol) == ("ring", "Simple")
    assert large.time_ns == pytest.approx(96_000 + 1.75 * 2**30 / 80e9 * 1e9, rel=1e-12)


def test_network_bandwidth_bounds_a_group_with_one_rank_per_node():
    """A data-parallel group of a TP=8 layout: one rank on each of 4 nodes, one NIC each (rails)."""
    group = CollectiveGroup((0, 8, 16, 24), ClusterTopology(4, 8, "ib-hdr"))
    assert (group.world, group.nodes, group.ranks_per_node) == (4, 4, 1)
    est = model_time("all_gather", 1 << 30, group, NODE, CAL)
    # one HDR NIC: 25e9 * 0.92 = 23 GB/s < NVLink; bus 3/4 GiB; Simple latency 20000 + 3 steps, all 3 cross
    # nodes: 3 * 14000 -> 62000 ns + 0.75 * 2^30 / 23e9 s
    assert est.time_ns == pytest.approx(62_000 + 0.75 * 2**30 / 23e9 * 1e9, rel=1e-12)
    assert "ib-hdr" in est.detail


def test_pcie_boards_use_pcie_without_ll128_and_bridges_join_pairs_only():
    l4 = get_device("l4")
    link = intra_link(l4, 4)
    assert (link.kind, link.family, link.bandwidth_bytes_per_s) == ("pcie", "pcie4", 31.5e9)
    assert intra_link(get_device("a100-pcie-80gb"), 2).kind == "nvlink"       # a bridged pair
    assert intra_link(get_device("a100-pcie-80gb"), 4).kind == "pcie"         # bridges do not join four
    assert intra_link(get_device("v100-32gb"), 8).family == "nvlink2"        # DGX-1's mesh rings span 8
    for size in (1 << 10, 1 << 20, 1 << 28):
        assert model_time("all_reduce", size, CollectiveGroup.of(4), l4, CAL).protocol != "LL128"
    est = model_time("all_reduce", 1 << 28, CollectiveGroup.of(4), l4, CAL)
    # PCIe hop = NVLink hop x NCCL's 5.7/3.4; 1.5 * 2^28 / (31.5e9 * 0.8) s
    assert est.time_ns == pytest.approx(20_000 + 6 * 2_000 * 5.7 / 3.4 + 1.5 * 2**28 / (31.5e9 * 0.8) * 1e9)


def test_more_data_never_takes_less_time():
    dev = get_device("h100-sxm")
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        times = [model_time(op, 1 << k, CollectiveGroup.of(8), dev).time_ns for k in range(8, 31)]
        assert all(b >= a for a, b in zip(times, times[1:])), op


def test_one_rank_or_empty_message_costs_nothing():
    assert model_time("all_reduce", 1 << 20, CollectiveGroup.of(1), NODE, CAL).time_ns == 0.0
    assert model_time("all_reduce", 0, CollectiveGroup.of(8), NODE, CAL).time_ns == 0.0


def test_the_fitted_model_is_the_product_path():
    """The fitter's vectorised prediction equals model_time row by row (one set of formulas)."""
    from boomfx.kernels_db.collective_import import CollectiveRow, PublicCollectiveRow
    from boomfx.kernels_db.fit_collective_model import prepare, predict
    cal = default_calibration()
    rows = [PublicCollectiveRow("x", "h200", "", CollectiveRow(op, 1 << k, n, n, "float16", 1.0, 1.0, 1.0))
            for op in ("all_reduce", "all_gather", "all_to_all") for n in (2, 8) for k in (9, 20, 28)]
    fit_rows = prepare(rows)
    fam = cal.family(fit_rows.families[0])
    for op in ("all_reduce", "all_gather", "all_to_all"):
        fast, _ = predict(cal, np.array([fam.latency_scale]), np.array([fam.bandwidth_scale]), fit_rows, op)
        slow = [model_time(op, r.row.message_bytes, CollectiveGroup.of(r.row.world), get_device("h200")).time_ns
                for r in rows if r.row.op == op]
        assert np.allclose(fast, slow, rtol=1e-12)


def test_every_protocol_has_fitted_numbers():
    cal = default_calibration()
    assert set(cal.protocols) == set(PROTOCOLS)
    assert all(p.base_ns > 0 and p.hop_ns > 0 and 0 < p.efficiency <= 1 for p in cal.protocols.values())
    assert set(cal.families) == {"nvlink3", "nvlink4", "nvlink5"}
    assert cal.host is not None and cal.host.bandwidth_bytes_per_s > 0


@pytest.mark.parametrize("call", [
    lambda: price_collective("all_shuffle", 1024, CollectiveGroup.of(2), NODE),           # unknown op
    lambda: price_collective("all_reduce", -1, CollectiveGroup.of(2), NODE),              # negative bytes
    lambda: price_collective("all_reduce", 1.5, CollectiveGroup.of(2), NODE),             # not an integer
    lambda: CollectiveGroup.of(0),                                                        # no ranks
    lambda: CollectiveGroup.of(8, ranks_per_node=3),                                      # 8 ranks, nodes of 3
    lambda: CollectiveGroup((0, 1, 1), ClusterTopology(1, 8)),                            # a rank twice
    lambda: CollectiveGroup((0, 9), ClusterTopology(1, 8)),                               # outside the cluster
    lambda: ClusterTopology(0, 8),                                                        # no nodes
])
def test_bad_input_raises_the_project_error(call):
    with pytest.raises(CollectiveError) as info:
        call()
    assert isinstance(info.value, BoomfxError) and str(info.value)


def test_networks_registry():
    assert get_network("NDR").bandwidth_bytes_per_s == 400e9 / 8
    assert get_network("ib_hdr").name == "ib-hdr"
    with pytest.raises(UnknownNetworkError):
        ClusterTopology(2, 8, network="token-ring")
