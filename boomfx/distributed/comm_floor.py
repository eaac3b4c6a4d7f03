"""A floor of a plan's step time from the data-parallel collectives it cannot avoid, known before any per-rank
program is built: ``--search`` (plan_search.py) visits plans in the order of their step-time floor and stops
when the next floor exceeds the slowest plan it lists, so a floor that leaves communication out lets every
communication-bound plan through to a per-rank build (on 8 x 8 GPUs most plans are).

Collectives of one process group run one after another on that group's stream (``rank_schedule.py``), so a
rank's step lasts at least the sum of its collectives on any one group. What a data-parallel rank moves,
whatever the rewrite's details (``fsdp.py``, ``pp_fsdp.py``):

- FSDP2 (``dp_shard > 1``), per unit (each layer of the main layer list, then the root; or the whole
  model with ``fsdp_wrap="root"``): an all-gather of the unit's parameters in the all-gather dtype
  (``MixedPrecisionPolicy.param_dtype``, else the parameters'), a second one in the backward when the unit
  reshards after its forward (never the root), and a reduce-scatter of its gradients (``reduce_dtype``, else
  the compute dtype). With pipeline stages each unit is reduce-scattered once after the last micro-batch
  and gathered once a step, or when it reshards after forward at least twice (its first forward and its
  first backward: every schedule runs a forward right before its first backward; ``pp_fsdp.py``). HSDP
  (``dp_replicate > 1`` too) then all-reduces the reduce-scatter's output, the unit's shard, over ``dp_replicate``: another group, another stream.
- DDP (``dp_replicate > 1`` alone): an all-reduce of every gradient over ``dp_replicate``, priced here as one
  message of their total. The collective model's time is the fastest of NCCL's algorithm/protocol candidates,
  each affine in the bytes with a non-negative latency (``kernels_db/collective_model.py``), so it is concave
  and subadditive: one message of the sum costs at most what the buckets cost together.

Every message here is at most the rewrite's: FSDP pads shards (only adds), a tensor-parallel rank holds at least
``1/tp`` of a unit's parameters (the norms stay whole), and the dtypes taken are the smallest the policy allows.
With ``pp`` the busiest stage moves at least the mean of the stages (the root's parameters, split between the
first and the last stage, are left out). The price is monotone in the bytes, so each term is a floor of the
schedule's.

Collectives also cost compute: FSDP copies each gathered flat buffer out into the parameters and concatenates
the gradients into each reduce-scatter's input (``copy_bytes``, at least the message read and written), and
the compute stream runs slower while a collective runs (``overlapped_step_floor_ns``). ``plan_search.py``
adds both to the compute stream's work for single-stage plans. ``tests/test_parallel_search.py`` checks the
step floor against the full evaluation of every modelled plan of a small model, and over a slow network where
the collectives decide it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from boomfx.kernels_db.collective_model import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

# (collective, message bytes, mesh dimension, dtype) -> ns, as the rank schedule would price it
Price = Callable[[str, int, str, torch.dtype], float]


@dataclass(frozen=True)
class DataParallelComm:
    """A floor of what a plan's data parallelism adds to one rank's step."""

    by_group: Mapping[str, float]    # ns of collectives on each mesh dimension's stream
    copy_bytes: int = 0              # bytes FSDP's copy-outs and ``_chunk_cat`` read and write on the compute stream

    @property
    def busiest_ns(self) -> float:
        """The longest stream: the step lasts at least this."""
        return max(self.by_group.values(), default=0.0)


def smallest_dtype(*dtypes: Optional[torch.dtype]) -> torch.dtype:
    """The narrowest of the dtypes given (None: not given): a floor's bytes per element."""
    return min((d for d in dtypes if d is not None), key=lambda d: d.itemsize)


def data_parallel_comm(layer_elems: tuple[int, ...], root_elems: int, param_dtype: torch.dtype,
                       dp_replicate: int, dp_shard: int, tp: int, pp: int, reshards: bool, one_unit: bool,
                       price: Price, fsdp_param_dtype: Optional[torch.dtype] = None,
                       fsdp_reduce_dtype: Optional[torch.dtype] = None) -> DataParallelComm:
    """The module docstring's collectives, summed per stream, and FSDP's copies around them (each all-gather
    copied out of its flat buffer, each reduce-scatter's input concatenated from the gradients: at least the
    message read and written once). ``layer_elems``/``root_elems``: the single-device parameters' elements
    per layer and outside the layers; ``reshards``: the plan's ``reshard_after_forward``; ``one_unit``: FSDP
    wraps the whole model as one unit (``fsdp_wrap="root"``: gathered once, never resharded)."""
    if dp_replicate * dp_shard == 1:
        return DataParallelComm({})
    units = [(e + tp - 1) // tp for e in layer_elems if e]
    root = (root_elems + tp - 1) // tp if pp == 1 else 0
    if dp_shard == 1:     # DDP: every gradient, all-reduced
        grads = (sum(units) // pp + root) * param_dtype.itemsize
        return DataParallelComm({"dp_replicate": price(ALL_REDUCE, grads, "dp_replicate", param_dtype)})
    gather = smallest_dtype(fsdp_param_dtype, param_dtype)
    reduce = smallest_dtype(fsdp_reduce_dtype, fsdp_param_dtype, param_dtype)
    gathers_per_layer = 2 if reshards else 1
    if one_unit:
        units, root, gathers_per_layer = [sum(units) + root], 0, 1
    shard_ns = replicate_ns = 0.0
    copied = 0
    for elems, gathers in [(e, gathers_per_layer) for e in units] + ([(root, 1)] if root else []):
        shard_ns += gathers * price(ALL_GATHER, elems * gather.itemsize, "dp_shard", gather)
        shard_ns += price(REDUCE_SCATTER, elems * reduce.itemsize, "dp_shard", reduce)
        copied += 2 * elems * (gathers * gather.itemsize + reduce.itemsize)
        if dp_replicate > 1:
            replicate_ns += price(ALL_REDUCE, elems // dp_shard * reduce.itemsize, "dp_replicate", reduce)
    if pp > 1:      # the busiest stage holds at least the mean of the layers' units
        shard_ns, replicate_ns, copied = shard_ns / pp, replicate_ns / pp, copied // pp
    groups = {"dp_shard": shard_ns, **({"dp_replicate": replicate_ns} if dp_replicate > 1 else {})}
    return DataParallelComm(groups, copied)


def overlapped_step_floor_ns(work_ns: float, idle_ns: float, comm_busy_ns: float, slowdown: float) -> float:
    """A floor of a single-stage step from its compute stream's work at full speed (``work_ns``), the
    collectives it sits idle through (``idle_ns``: TP's forward all-reduces) and a floor of the time some
    collective is running (``comm_busy_ns``, at least ``idle_ns``), under ``simulate/streams.py``'s model:
    compute runs ``slowdown`` times slower while a collective runs. Over a step of length T, compute
    progresses at most ``T - busy`` outside collectives and ``(busy - idle) / slowdown`` beside them, so
    ``T >= work + idle + (busy - idle) (1 - 1 / slowdown)``."""
    busy = max(comm_busy_ns, idle_ns)
    return work_ns + idle_ns + (busy - idle_ns) * (1.0 - 1.0 / slowdown)
