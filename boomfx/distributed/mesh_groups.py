"""The process groups of one rank on torchtitan's device mesh ``[pp, dp_replicate, dp_shard, tp]`` (tp innermost),
as the ``CollectiveGroup``s the collective model prices: which global ranks, on which nodes.

The rank-program rewrites name each collective's group by its mesh dimension (``"dp_shard"``, ``"tp"``...);
``mesh_groups`` maps those names to the ranks that share every other coordinate with ``rank``, on a cluster of
``nodes x gpus_per_node`` with torchrun's numbering (rank r on node r // gpus_per_node). With TP innermost a TP
group of up to a node's GPUs stays in one node; data-parallel groups stride across nodes.

Example::

    >>> g = mesh_groups({"dp_shard": 4, "tp": 8}, rank=9, topology=ClusterTopology(4, 8))
    >>> g["tp"].ranks, g["dp_shard"].ranks, g["dp_shard"].nodes
    ((8, 9, 10, 11, 12, 13, 14, 15), (1, 9, 17, 25), 4)
"""
from __future__ import annotations

import math
from typing import Mapping

from boomfx.core.errors import OptionError
from boomfx.kernels_db.collective_model import ClusterTopology, CollectiveGroup

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")     # outermost first
# the first and last pipeline ranks of a rank's pp group (Megatron's embedding group): a weight tied
# across those stages has its gradient all-reduced over it (pipeline_stages.py, pp_tied_weights.py)
PP_TIED_GROUP = "pp_tied"


def mesh_coords(degrees: Mapping[str, int], rank: int) -> dict[str, int]:
    """``rank``'s index along each mesh dimension (tp varies fastest)."""
    out: dict[str, int] = {}
    rest = rank
    for name in reversed(MESH_ORDER):
        size = int(degrees.get(name, 1))
        out[name] = rest % size
        rest //= size
    return out


def mesh_rank(degrees: Mapping[str, int], coords: Mapping[str, int]) -> int:
    rank = 0
    for name in MESH_ORDER:
        rank = rank * int(degrees.get(name, 1)) + coords[name]
    return rank


def mesh_groups(degrees: Mapping[str, int], rank: int, topology: ClusterTopology) -> dict[str, CollectiveGroup]:
    """Mesh dimension name -> the ``CollectiveGroup`` of ``rank`` along it (every dimension, size 1 included),
    and ``PP_TIED_GROUP`` -> the first and last ranks of its pp group."""
    unknown = set(degrees) - set(MESH_ORDER)
    if unknown:
        raise OptionError(f"unknown mesh dimensions {sorted(unknown)} (known: {', '.join(MESH_ORDER)})")
    world = math.prod(int(degrees.get(n, 1)) for n in MESH_ORDER)
    if world != topology.world:
        raise OptionError(f"the mesh has {world} ranks, the cluster {topology.nodes} x {topology.gpus_per_node} = "
                          f"{topology.world}")
    if not 0 <= rank < world:
        raise OptionError(f"rank {rank} is outside the world of {world}")
    here = mesh_coords(degrees, rank)
    groups = {}
    for name in MESH_ORDER:
        ranks = tuple(mesh_rank(degrees, {**here, name: i}) for i in range(int(degrees.get(name, 1))))
        groups[name] = CollectiveGroup(ranks, topology)
    ends = (0, int(degrees.get("pp", 1)) - 1)
    groups[PP_TIED_GROUP] = CollectiveGroup(tuple(dict.fromkeys(groups["pp"].ranks[i] for i in ends)), topology)
    return groups
