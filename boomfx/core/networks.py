"""The registry of networks between nodes (and the CPU's loopback), with the source of every figure.

A collective that spans nodes leaves each node through its NICs; its bus bandwidth is then bounded by
the NIC bandwidth each GPU gets (``bandwidth_bytes_per_s`` per NIC and direction, times the NICs of a
node, over the ranks of the node), not by NVLink. On rail-optimised clusters (DGX SuperPOD, most
InfiniBand and RoCE training clusters) every GPU has its own NIC on its own leaf switch ("rail"), which
is the default the collective model assumes (one NIC per GPU). This module is part of the core layer:
it imports nothing else of boomfx.

``extra_hop_ns`` is the time a network adds per ring step beyond what NCCL's own tuning model already
charges for a network hop (NCCL ``src/graph/tuning.cc`` ``hwLat[NCCL_HW_NET]``: 2.7 / 4.0 / 14 us for
ring LL / LL128 / Simple), e.g. a kernel TCP stack instead of RDMA.

Example::

    >>> get_network("ib-ndr").bandwidth_bytes_per_s
    50000000000.0
"""
from __future__ import annotations

from dataclasses import dataclass

from boomfx.core.errors import BoomfxError

GBIT = 1e9 / 8   # bytes per second in one Gb/s


class UnknownNetworkError(BoomfxError):
    """A network name the registry does not know."""


@dataclass(frozen=True)
class NetworkSpec:
    """One network between nodes. Bandwidth is per NIC and per direction."""

    name: str
    description: str
    bandwidth_bytes_per_s: float
    rdma: bool                 # GPUDirect RDMA / RoCE: NCCL's IB transport; False: sockets
    extra_hop_ns: float = 0.0
    aliases: tuple[str, ...] = ()
    source: str = ""


NETWORKS: tuple[NetworkSpec, ...] = (
    NetworkSpec("ib-xdr", "InfiniBand XDR, 800 Gb/s per port (ConnectX-8)", 800 * GBIT, True,
                aliases=("xdr", "ib-800"),
                source="NVIDIA ConnectX-8 SuperNIC product brief: up to 800 Gb/s per port (HGX B300 / GB300)"),
    NetworkSpec("ib-ndr", "InfiniBand NDR, 400 Gb/s per port (ConnectX-7)", 400 * GBIT, True,
                aliases=("ndr", "ib-400"),
                source="NVIDIA DGX H100 user guide: 8x single-port ConnectX-7 400 Gb/s InfiniBand, one per GPU"),
    NetworkSpec("ib-hdr", "InfiniBand HDR, 200 Gb/s per port (ConnectX-6)", 200 * GBIT, True,
                aliases=("hdr", "ib-200"),
                source="NVIDIA DGX A100 user guide: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU"),
    NetworkSpec("ib-edr", "InfiniBand EDR, 100 Gb/s per port (ConnectX-5)", 100 * GBIT, True,
                aliases=("edr", "ib-100"),
                source="NVIDIA DGX-1 (V100) user guide: 4x 100 Gb/s EDR InfiniBand ports for 8 GPUs"),
    NetworkSpec("roce-400", "RoCE v2 over 400 GbE", 400 * GBIT, True, aliases=("roce",),
                source="400 GbE line rate (IEEE 802.3bs); NCCL drives RoCE through its IB verbs transport"),
    NetworkSpec("roce-200", "RoCE v2 over 200 GbE", 200 * GBIT, True,
                source="200 GbE line rate (IEEE 802.3bs)"),
    NetworkSpec("eth-100", "100 GbE with TCP sockets (no RDMA)", 100 * GBIT, False,
                extra_hop_ns=20_000.0, aliases=("tcp-100",),
                source="100 GbE line rate; NB: the 20 us per hop of a kernel TCP stack is an assumption, "
                       "measure with nccl-tests and import the table"),
    NetworkSpec("eth-25", "25 GbE with TCP sockets (no RDMA), typical cloud VM", 25 * GBIT, False,
                extra_hop_ns=20_000.0, aliases=("tcp-25",),
                source="25 GbE line rate; NB: per-hop cost assumed as for eth-100"),
)


def list_networks() -> list[NetworkSpec]:
    return list(NETWORKS)


def get_network(name: str) -> NetworkSpec:
    """Look a network up by name or alias (case-insensitive; '_' and ' ' read as '-')."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    for spec in NETWORKS:
        if key == spec.name or key in spec.aliases:
            return spec
    known = ", ".join(s.name for s in NETWORKS)
    raise UnknownNetworkError(f"unknown network '{name}' (known: {known})")
