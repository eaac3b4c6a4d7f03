"""The time of one NCCL-style collective from the topology alone: ring and tree algorithms, three protocols.

How NCCL itself prices a collective (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime``;
``src/enqueue.cc`` picks the algorithm/protocol pair of least predicted time) and what we keep of it:

1. **Bus bytes.** A ring all-reduce of S bytes on n ranks moves ``2(n-1)/n * S`` through every rank's link,
   all-gather and reduce-scatter ``(n-1)/n * S`` (nccl-tests' ``busbw`` factors, ``BUS_FACTOR``), so
   ``time_bw = bus_bytes / bus_bandwidth`` for every op at the same link speed.
2. **Latency per step.** A ring of n ranks takes ``2(n-1)`` steps (all-reduce) or ``n-1`` (all-gather,
   reduce-scatter), each paying a hop latency on top of a base latency per protocol
   (``RING_STEPS``; NCCL: ``baseLat + nsteps * hwLat``). A tree all-reduce (only across nodes here) pays
   ``2 * ((ranks_per_node - 1) * intra_hop + log2(nodes) * net_hop)``.
3. **Protocols.** LL (8-byte flag+data stores: lowest latency, a fraction of the link), LL128 (128-byte
   lines, 120 of payload: nearly full bandwidth, NVLink only), Simple (bulk copies with fences: full
   bandwidth, highest latency). NCCL enables LL128 only over NVLink (``typeIntra <= PATH_NVB``).
4. **Choice.** Every (algorithm, protocol) candidate is priced and the fastest wins, as ``enqueue.cc`` does
   with NCCL's own estimates; the winner is returned with the time.

The per-protocol base and hop latencies and achieved fractions of the link are not NCCL's constants but
fitted on the public single-node measurements (``benchmarks/collective_heldout.py`` fits them and leaves
each system out; ``kernels_db/data/collective_calibration.json`` holds the fit on all four), since NCCL's
constants only rank candidates and the measured times differ from them by up to 2x. Simple's efficiency
falls with fewer ranks (measured: 2 GPUs reach ~0.73 of the 8-GPU bus bandwidth on every system), modelled
as ``efficiency * (1 - rank_loss / n)``. The link's rate is its datasheet rate times the share NCCL's own
topology model gives it (``NCCL_NVLINK_USABLE``: 0.80 for NVLink3, 0.824 for NVLink4, 0.802 for NVLink5).
Each interconnect family seen in the fit (``nvlink3`` = A100, ...) gets a latency and a bandwidth scale
(their geometric mean is 1); an unseen family gets 1. Held out by system, the usable share moved A100's
median |error| (>= 1 MiB) from 11.2% to 10.2% and the fit on all four from 0.0977 to 0.0889 mean |log error|.

Multi-node (not checked against measurements: the public data is single-node): a rank's ring traffic
leaves the node through the group's share of the NICs (rails, one NIC per GPU by default), so the bus
bandwidth is ``min(intra-node link, NICs x NIC bandwidth x NETWORK_EFFICIENCY)`` and ring steps that cross
nodes pay NCCL's network hop latency (``NCCL_NET_HOP_NS``) instead of the NVLink hop.

Known limitations:
- NVLS (NVLink SHARP, H100+ NVSwitch) and CollNet/SHARP in-network reductions are not modelled: an
  8-GPU H100 all-reduce of large messages is predicted ~15-20% slow (NVLS reaches ~450 GB/s bus bandwidth).
- All-to-all is priced as n-1 pipelined steps; broadcast and send/recv borrow all-gather's and
  all-to-all's Simple efficiency (no public measurements of them here).
- PCIe boards: PCIe x16 rate per generation times the fitted efficiencies, NCCL's PCI/NVLink hop-latency
  ratio; not checked against measurements.
- NVLink bridges (PCIe boards) only join pairs: groups of more than two ranks on them use PCIe.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from boomfx.core.devices import DeviceSpec
from boomfx.core.errors import CollectiveError
from boomfx.core.networks import NetworkSpec, get_network

CALIBRATION_PATH = Path(__file__).parent / "data" / "collective_calibration.json"
COLLECTIVE_OP = "boomfx::collective"   # KernelKey.op of collective rows (collectives.py); kernel lookups skip them

# ---------------------------------------------------------------------------------------------------------
# Ops and NCCL's step counts
# ---------------------------------------------------------------------------------------------------------

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
BROADCAST = "broadcast"
SEND_RECV = "send_recv"
OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, SEND_RECV)
OP_ALIASES: Mapping[str, str] = {
    "allreduce": ALL_REDUCE,
    "allgather": ALL_GATHER, "all_gather_into_tensor": ALL_GATHER, "_allgather_base": ALL_GATHER,
    "reducescatter": REDUCE_SCATTER, "reduce_scatter_tensor": REDUCE_SCATTER, "_reduce_scatter_base": REDUCE_SCATTER,
    "alltoall": ALL_TO_ALL, "all_to_all_single": ALL_TO_ALL, "alltoall_base": ALL_TO_ALL,
    "sendrecv": SEND_RECV, "send": SEND_RECV, "recv": SEND_RECV, "isend": SEND_RECV, "irecv": SEND_RECV,
}
PROTOCOLS = ("LL", "LL128", "Simple")
RING, TREE, P2P = "ring", "tree", "p2p"


def canonical_op(op: str) -> str:
    """The model's name of a collective; raises CollectiveError.

    Accepts the model's names, torch.distributed's ('all_gather_into_tensor', 'reduce_scatter_tensor',
    'all_to_all_single'), nccl-tests' ('alltoall', 'sendrecv') and graph targets of the functional collectives
    ('_c10d_functional.all_reduce_.default' -> 'all_reduce').
    """
    key = str(op).strip().lower().replace("-", "_")
    for suffix in (".default",):
        key = key[: -len(suffix)] if key.endswith(suffix) else key
    key = key.rsplit(".", 1)[-1].rstrip("_")   # namespace ('_c10d_functional.'), in-place marker ('all_reduce_')
    key = OP_ALIASES.get(key, key)
    if key not in OPS:
        raise CollectiveError(f"unknown collective '{op}' (known: {', '.join(OPS)})")
    return key


def bus_factor(op: str, n: int) -> float:
    """Bus bytes per message byte (nccl-tests ``busbw = algbw * factor``)."""
    if n <= 1:
        return 0.0
    if op == ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return (n - 1) / n
    return 1.0  # broadcast (pipelined ring: every rank receives S) and send/recv (S over one link)


def ring_steps(op: str, n: int) -> int:
    """Ring steps whose latency adds up (NCCL ``nsteps``); send/recv is one step."""
    if n <= 1:
        return 0
    if op == ALL_REDUCE:
        return 2 * (n - 1)
    if op == SEND_RECV:
        return 1
    return n - 1


def _factor_and_steps(op: str, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``bus_factor`` and ``ring_steps`` over an array of rank counts (all > 1)."""
    if op == ALL_REDUCE:
        return 2.0 * (n - 1) / n, 2.0 * (n - 1)
    if op in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return (n - 1) / n, n - 1
    if op == SEND_RECV:
        return np.ones_like(n), np.ones_like(n)
    return np.ones_like(n), n - 1


# ---------------------------------------------------------------------------------------------------------
# Facts from NCCL and the PCI-SIG (sources in comments)
# ---------------------------------------------------------------------------------------------------------

# NCCL src/graph/tuning.cc hwLat (us) for ring, per protocol LL/LL128/Simple: NVLink .6/1.9/3.4, PCI
# 1.0/2.5/5.7, network 2.7/4.0/14.0; tree over the network 5.0/8.5/28. We keep NCCL's network hops as they
# are and its PCI/NVLink ratio to turn the fitted NVLink hop into a PCIe one.
NCCL_NET_HOP_NS: Mapping[str, float] = {"LL": 2_700.0, "LL128": 4_000.0, "Simple": 14_000.0}
NCCL_TREE_NET_HOP_NS: Mapping[str, float] = {"LL": 5_000.0, "LL128": 8_500.0, "Simple": 28_000.0}
NCCL_PCI_OVER_NVLINK_HOP: Mapping[str, float] = {"LL": 1.0 / 0.6, "LL128": 2.5 / 1.9, "Simple": 5.7 / 3.4}
# NCCL tuning.cc: tree busBw = min(busBw * .92, ...), algorithm bandwidth = busBw * 0.5 for trees.
NCCL_TREE_BANDWIDTH_FACTOR = 0.92
# PCIe x16 per direction after 128b/130b coding (PCI-SIG: 8, 16, 32, 64 GT/s per lane for gen 3-6).
PCIE_X16_BYTES_PER_S: Mapping[int, float] = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9, 6: 126.0e9}
# Achieved fraction of the NICs' line rate for ring traffic across nodes. NB: assumed (LL128's 120/128 payload
# share, NCCL tuning.cc), not fitted: the public data is single-node.
NETWORK_EFFICIENCY = 0.92


# ---------------------------------------------------------------------------------------------------------
# Groups and topology
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterTopology:
    """Nodes x GPUs per node, the network between nodes and its NICs per node (default: one per GPU)."""

    nodes: int
    gpus_per_node: int
    network: str = "ib-ndr"
    nics_per_node: Optional[int] = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise CollectiveError(f"a cluster needs at least one node of one GPU, got {self.nodes} x "
                                  f"{self.gpus_per_node}")
        if self.nics_per_node is not None and self.nics_per_node < 1:
            raise CollectiveError(f"nics_per_node must be at least 1, got {self.nics_per_node}")
        get_network(self.network)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def network_spec(self) -> NetworkSpec:
        return get_network(self.network)

    @property
    def nics(self) -> int:
        return self.nics_per_node if self.nics_per_node is not None else self.gpus_per_node


@dataclass(frozen=True)
class CollectiveGroup:
    """The global ranks of a process group and the cluster they lie on (rank r is GPU r % gpus_per_node of
    node r // gpus_per_node, torchrun's order).

    Example: a data-parallel group of a TP=8 layout on 4 nodes is ``CollectiveGroup((0, 8, 16, 24),
    ClusterTopology(4, 8))``: 4 nodes, one rank on each.
    """

    ranks: tuple[int, ...]
    topology: ClusterTopology

    def __post_init__(self) -> None:
        ranks = tuple(int(r) for r in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if not ranks:
            raise CollectiveError("a collective group needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise CollectiveError(f"a collective group lists a rank twice: {ranks}")
        world = self.topology.world
        bad = [r for r in ranks if r < 0 or r >= world]
        if bad:
            raise CollectiveError(f"ranks {bad} are outside a cluster of {self.topology.nodes} x "
                                  f"{self.topology.gpus_per_node} = {world} GPUs")

    @classmethod
    def of(cls, world: int, ranks_per_node: Optional[int] = None, network: str = "ib-ndr",
           nics_per_node: Optional[int] = None) -> "CollectiveGroup":
        """``world`` consecutive ranks, ``ranks_per_node`` on each node (default: all on one node)."""
        per_node = world if ranks_per_node is None else ranks_per_node
        if world < 1 or per_node < 1 or world % per_node:
            raise CollectiveError(f"a world of {world} ranks does not split into nodes of {per_node}")
        return cls(tuple(range(world)), ClusterTopology(world // per_node, per_node, network, nics_per_node))

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return len({r // self.topology.gpus_per_node for r in self.ranks})

    @property
    def ranks_per_node(self) -> int:
        """The most ranks of the group on one node (NCCL assumes nRanks / nNodes on each)."""
        per = self.topology.gpus_per_node
        counts: dict[int, int] = {}
        for r in self.ranks:
            counts[r // per] = counts.get(r // per, 0) + 1
        return max(counts.values())


# ---------------------------------------------------------------------------------------------------------
# Calibration (fitted parameters as data)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProtocolParams:
    base_ns: float
    hop_ns: float
    efficiency: float = 1.0    # achieved fraction of the link for LL / LL128; Simple uses SimpleParams


@dataclass(frozen=True)
class SimpleParams:
    efficiency: float
    rank_loss: float           # efficiency * (1 - rank_loss / n)


@dataclass(frozen=True)
class FamilyScale:
    latency_scale: float = 1.0
    bandwidth_scale: float = 1.0


@dataclass(frozen=True)
class HostLinkParams:
    """A CPU process group (gloo over loopback TCP): one protocol, latency and bandwidth of this host kind."""

    base_ns: float
    hop_ns: float
    bandwidth_bytes_per_s: float
    source: str = ""


@dataclass(frozen=True)
class CollectiveCalibration:
    protocols: Mapping[str, ProtocolParams]
    simple: Mapping[str, SimpleParams]
    families: Mapping[str, FamilyScale] = field(default_factory=dict)
    host: Optional[HostLinkParams] = None
    source: str = ""

    def simple_for(self, op: str) -> SimpleParams:
        """Simple's parameters; broadcast borrows all-gather's, send/recv all-to-all's (no measurements)."""
        borrowed = {BROADCAST: ALL_GATHER, SEND_RECV: ALL_TO_ALL}.get(op, op)
        return self.simple[borrowed]

    def family(self, name: str) -> FamilyScale:
        return self.families.get(name, FamilyScale())

    @classmethod
    def from_json(cls, data: Mapping) -> "CollectiveCalibration":
        protocols = {p: ProtocolParams(**data["protocols"][p]) for p in PROTOCOLS}
        simple = {op: SimpleParams(**v) for op, v in data["simple"].items()}
        families = {k: FamilyScale(**v) for k, v in data.get("families", {}).items()}
        host = HostLinkParams(**data["host"]) if data.get("host") else None
        return cls(protocols, simple, families, host, data.get("source", ""))

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "protocols": {p: vars(v) for p, v in self.protocols.items()},
            "simple": {op: vars(v) for op, v in self.simple.items()},
            "families": {k: vars(v) for k, v in self.families.items()},
            "host": vars(self.host) if self.host else None,
        }


_CALIBRATION: Optional[CollectiveCalibration] = None


def default_calibration() -> CollectiveCalibration:
    """The shipped calibration (read once, on first use; never at import)."""
    global _CALIBRATION
    if _CALIBRATION is None:
        _CALIBRATION = CollectiveCalibration.from_json(json.loads(CALIBRATION_PATH.read_text()))
    return _CALIBRATION


# ---------------------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------------------


# The share of a link's datasheet rate NCCL's topology model gives it, per NVLink generation (src/graph/topo.h:
# SM70/SM80_NVLINK_BW 20.0, SM90 20.6, SM100 40.1 GB/s per link and direction, against 25, 25, 25 and 50 on the
# datasheets): what its ring and tree bandwidths are built on. A generation the public measurements do not
# cover (V100's NVLink2) is priced from the others' fitted scale at this share of its own links.
NCCL_NVLINK_USABLE: Mapping[int, float] = {2: 20.0 / 25.0, 3: 20.0 / 25.0, 4: 20.6 / 25.0, 5: 40.1 / 50.0}


@dataclass(frozen=True)
class IntraLink:
    """How the ranks of one node reach each other: bandwidth per GPU and direction, and its family."""

    bandwidth_bytes_per_s: float
    family: str                 # "nvlink4", "pcie5", "loopback"
    kind: str                   # "nvlink", "pcie", "host"


def intra_link(device: DeviceSpec, ranks_per_node: int) -> IntraLink:
    """NVLink when it joins every rank of the node (NVSwitch, a mesh such as DGX-1's, or a bridged pair of two
    ranks), else the PCIe host link. NB: a mesh's rings are priced at the full per-GPU NVLink rate."""
    if device.kind == "cpu":
        return IntraLink(0.0, "loopback", "host")
    nvlink_reaches_all = device.nvswitch or not device.nvlink_bridge or ranks_per_node <= 2
    if device.nvlink_bytes_per_s > 0 and nvlink_reaches_all:
        usable = NCCL_NVLINK_USABLE.get(device.nvlink_generation, 1.0)
        return IntraLink(device.nvlink_bytes_per_s * usable, f"nvlink{device.nvlink_generation}", "nvlink")
    gen = device.pcie_generation or 4
    return IntraLink(PCIE_X16_BYTES_PER_S[gen], f"pcie{gen}", "pcie")


# ---------------------------------------------------------------------------------------------------------
# Formulas (numpy-friendly: the fitter calls ring_candidates on arrays of measurements)
# ---------------------------------------------------------------------------------------------------------


def protocol_efficiency(cal: CollectiveCalibration, protocol: str, op: str,
                        n: "np.ndarray | int") -> "np.ndarray | float":
    """Achieved fraction of the link's bandwidth by a protocol for ``op`` on n ranks."""
    if protocol == "Simple":
        simple = cal.simple_for(op)
        return simple.efficiency * (1.0 - simple.rank_loss / np.asarray(n, dtype=float))
    return cal.protocols[protocol].efficiency


def ring_candidates(cal: CollectiveCalibration, op: str, n: "np.ndarray | int", message_bytes: "np.ndarray | float",
                    link_bytes_per_s: "np.ndarray | float", family: FamilyScale,
                    hop_ratio: Optional[Mapping[str, float]] = None) -> dict[str, "np.ndarray | float"]:
    """Single-node ring time (ns) per protocol::

        t = latency_scale * (base + steps * hop * hop_ratio) + bus_bytes / (link * eff * bandwidth_scale)
    """
    n_arr = np.asarray(n, dtype=float)
    factor, steps = _factor_and_steps(op, n_arr)
    bus_bytes = np.asarray(message_bytes, dtype=float) * factor
    out: dict[str, "np.ndarray | float"] = {}
    for protocol in PROTOCOLS:
        params = cal.protocols[protocol]
        ratio = 1.0 if hop_ratio is None else hop_ratio[protocol]
        latency_ns = family.latency_scale * (params.base_ns + steps * params.hop_ns * ratio)
        bandwidth = link_bytes_per_s * protocol_efficiency(cal, protocol, op, n_arr) * family.bandwidth_scale
        out[protocol] = latency_ns + bus_bytes / bandwidth * 1e9
    return out


@dataclass(frozen=True)
class ModelEstimate:
    time_ns: float
    algorithm: str
    protocol: str
    bus_bytes: float
    detail: str = ""


def _fastest(candidates: Sequence[tuple[float, str, str]]) -> tuple[float, str, str]:
    return min(candidates, key=lambda c: c[0])


def model_time(op: str, message_bytes: int, group: CollectiveGroup, device: DeviceSpec,
               cal: Optional[CollectiveCalibration] = None) -> ModelEstimate:
    """The model's time of one collective; ``message_bytes`` follows nccl-tests' size (see ``price_collective``)."""
    cal = cal or default_calibration()
    op = canonical_op(op)
    n, nodes, per_node = group.world, group.nodes, group.ranks_per_node
    bus_bytes = message_bytes * bus_factor(op, n)
    if n <= 1 or message_bytes == 0:
        return ModelEstimate(0.0, "none", "none", 0.0, "one rank or an empty message: nothing moves")
    link = intra_link(device, per_node)
    if link.kind == "host":
        return _host_time(op, message_bytes, group, cal)
    family = cal.family(link.family)
    hop_ratio = NCCL_PCI_OVER_NVLINK_HOP if link.kind == "pcie" else None
    if nodes == 1:
        times = ring_candidates(cal, op, n, float(message_bytes), link.bandwidth_bytes_per_s, family, hop_ratio)
        allowed = [p for p in PROTOCOLS if link.kind == "nvlink" or p != "LL128"]  # NCCL: LL128 needs NVLink
        algorithm = P2P if op in (ALL_TO_ALL, SEND_RECV) else RING
        best = _fastest([(float(times[p]), algorithm, p) for p in allowed])
        return ModelEstimate(best[0], best[1], best[2], bus_bytes, f"{link.family}, {n} ranks in one node")
    return _multi_node_time(op, message_bytes, group, device, cal, link, family, hop_ratio)


def _multi_node_time(op: str, message_bytes: int, group: CollectiveGroup, device: DeviceSpec,
                     cal: CollectiveCalibration, link: IntraLink, family: FamilyScale,
                     hop_ratio: Optional[Mapping[str, float]]) -> ModelEstimate:
    """Rings (and, for all-reduce, trees) whose node-crossing steps go through the group's NICs."""
    n, nodes, per_node = group.world, group.nodes, group.ranks_per_node
    topo = group.topology
    net = topo.network_spec
    nics = max(1.0, topo.nics * per_node / topo.gpus_per_node)   # the group's share of the rails
    net_bytes_per_s = nics * net.bandwidth_bytes_per_s * NETWORK_EFFICIENCY
    bus_bytes = message_bytes * bus_factor(op, n)
    steps = ring_steps(op, n)
    inter_steps = {ALL_REDUCE: 2 * nodes}.get(op, nodes - 1) if op != SEND_RECV else 1  # NCCL nInterSteps
    inter_steps = min(inter_steps, steps)
    allowed = [p for p in PROTOCOLS if p != "LL128" or (link.kind == "nvlink" and net.rdma)]
    candidates: list[tuple[float, str, str]] = []
    for p in allowed:
        params = cal.protocols[p]
        ratio = 1.0 if hop_ratio is None else hop_ratio[p]
        intra_hop = family.latency_scale * params.hop_ns * ratio
        net_hop = NCCL_NET_HOP_NS[p] + net.extra_hop_ns
        base = family.latency_scale * params.base_ns
        eff = float(protocol_efficiency(cal, p, op, n))
        intra_bw = link.bandwidth_bytes_per_s * eff * family.bandwidth_scale
        proto_net_bw = net_bytes_per_s * (eff if p != "Simple" else 1.0)
        if op == ALL_TO_ALL:
            inside = message_bytes * (per_node - 1) / n / intra_bw
            outside = message_bytes * (n - per_node) / n * per_node / proto_net_bw
            latency = base + (steps - inter_steps) * intra_hop + inter_steps * net_hop
            candidates.append((latency + max(inside, outside) * 1e9, P2P, p))
            continue
        if op == SEND_RECV:  # one message between two ranks on different nodes
            candidates.append((base + net_hop + message_bytes / min(intra_bw, proto_net_bw) * 1e9, P2P, p))
            continue
        bus_bw = min(intra_bw, proto_net_bw)
        latency = base + (steps - inter_steps) * intra_hop + inter_steps * net_hop
        candidates.append((latency + bus_bytes / bus_bw * 1e9, RING, p))
        if op == ALL_REDUCE:
            tree_latency = base + 2 * ((per_node - 1) * intra_hop
                                       + math.log2(nodes) * (NCCL_TREE_NET_HOP_NS[p] + net.extra_hop_ns))
            tree_bw = bus_bw * NCCL_TREE_BANDWIDTH_FACTOR * 0.5
            candidates.append((tree_latency + message_bytes / tree_bw * 1e9, TREE, p))
    best = _fastest(candidates)
    return ModelEstimate(best[0], best[1], best[2], bus_bytes,
                         f"{nodes} nodes x {per_node} ranks, {link.family} + {net.name} x {nics:g} NICs")


def _host_time(op: str, message_bytes: int, group: CollectiveGroup, cal: CollectiveCalibration) -> ModelEstimate:
    """CPU process groups (gloo): one protocol, ``base + steps * hop + bus_bytes / bandwidth``."""
    host = cal.host
    if host is None:
        raise CollectiveError("the collective calibration has no host (gloo) parameters")
    n = group.world
    bus_bytes = message_bytes * bus_factor(op, n)
    time_ns = host.base_ns + ring_steps(op, n) * host.hop_ns + bus_bytes / host.bandwidth_bytes_per_s * 1e9
    return ModelEstimate(time_ns, P2P if op in (ALL_TO_ALL, SEND_RECV) else RING, "gloo", bus_bytes,
                         f"host loopback ({host.source})")
