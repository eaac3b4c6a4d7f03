"""Price one collective for a group and a device: measured > interpolated > model, with provenance.

``price_collective(op, message_bytes, group, device, store=None)`` is the entry point the distributed
analysis calls. It returns a ``CollectivePrice`` whose ``source`` is a ``PriceSource`` as for kernels:

1. **measured**: the database holds a row of this op, world, ranks per node and backend at exactly these bytes
   (measured here by ``boomfx kernels collect --collectives``, or imported from nccl-tests tables or the public
   NCCL data by ``boomfx kernels import``). Rows of other devices are ignored.
2. **interpolated**: rows of the same (op, world, ranks per node, backend) bracket the size; time is linear in
   log-log between the two neighbours (the kernel pricer interpolates throughput the same way), only when
   the nearer neighbour is within ``MAX_NEIGHBOUR_RATIO`` (x4) of the size.
3. **model**: ``collective_model.model_time``: NCCL-style ring/tree x LL/LL128/Simple on the device's
   interconnect (``boomfx/core/devices.py``) and network (``boomfx/core/networks.py``), calibrated on public data.

Message size convention (nccl-tests' ``size`` column, and the ``message_bytes`` of every function here):
the *whole* buffer of the collective, i.e. all-reduce: the tensor (input = output); all-gather: the gathered
**output** (world x the per-rank input, ``all_gather_into_tensor``'s output tensor); reduce-scatter: the
**input** (world x the per-rank output, ``reduce_scatter_tensor``'s input tensor); all-to-all: one rank's
send buffer; broadcast: the tensor; send/recv: the tensor each rank sends to its peer (nccl-tests' sendrecv:
every rank sends to the next and receives from the previous at once).

Example::

    >>> from boomfx.core.devices import get_device
    >>> price = price_collective("all_reduce", 64 << 20, CollectiveGroup.of(8), get_device("h100-sxm"))
    >>> price.source.value, price.algorithm, price.protocol
    ('model', 'ring', 'Simple')

Known limitations:
- No interpolation across world sizes or ranks-per-node: a group size that was not measured is priced by
  the model, even when neighbouring group sizes were measured.
- Rows of any dtype price a size (time depends on bytes; int8 reductions were measured ~3-10% slower), the
  caller's dtype first when rows of several dtypes exist (``DTYPE_PREFERENCE`` otherwise).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from typing import Optional

from boomfx.core.devices import DeviceSpec
from boomfx.core.errors import CollectiveError
from boomfx.kernels_db.collective_model import (
    COLLECTIVE_OP,
    ClusterTopology,
    CollectiveCalibration,
    CollectiveGroup,
    bus_factor,
    canonical_op,
    model_time,
)
from boomfx.kernels_db.price import PriceSource
from boomfx.kernels_db.schema import KernelKey, KernelRecord, canonical_json
from boomfx.kernels_db.store import Store

MAX_NEIGHBOUR_RATIO = 4.0
# Rows of several dtypes at one size (the public table has half and int8): the caller's dtype, else the first of
# these (training collectives move floats; int8 reductions were measured a few % slower), else by name.
DTYPE_PREFERENCE = ("bfloat16", "float16", "float32", "float64")


def backend_for(device: DeviceSpec) -> str:
    """The torch.distributed backend a device's process groups use: NCCL on CUDA, gloo on CPU."""
    return "nccl" if device.kind == "cuda" else "gloo"


def collective_key(op: str, message_bytes: int, world: int, ranks_per_node: int, backend: str,
                   dtype: str = "any") -> KernelKey:
    """The database key of one collective measurement (no tensors: the op, its size and the group's shape)."""
    args = {"collective": canonical_op(op), "bytes": int(message_bytes), "world": int(world),
            "ranks_per_node": int(ranks_per_node), "backend": backend}
    data = {"op": COLLECTIVE_OP, "args": args, "tensors": [], "context": {"dtype": dtype}}
    return KernelKey(COLLECTIVE_OP, dtype, canonical_json(data))


def key_fields(key: KernelKey) -> tuple[str, int, int, int, str]:
    """(collective, bytes, world, ranks_per_node, backend) of a collective key."""
    args = json.loads(key.key_json)["args"]
    return args["collective"], args["bytes"], args["world"], args["ranks_per_node"], args["backend"]


@dataclass(frozen=True)
class CollectivePrice:
    """Time of one collective, where it came from, what NCCL would run, and the bytes each rank's link moves.

    ``algorithm``/``protocol`` are the model's choice for model prices and the model's choice at that size
    for measured/interpolated ones (what NCCL most likely ran).
    """

    time_ns: float
    source: PriceSource
    algorithm: str
    protocol: str
    bus_bytes: float
    detail: str = ""


def _validate(op: str, message_bytes: int, group: CollectiveGroup) -> str:
    name = canonical_op(op)
    if not isinstance(message_bytes, numbers.Integral) or isinstance(message_bytes, bool):
        raise CollectiveError(f"{name}: message_bytes must be an integer, got {message_bytes!r}")
    if message_bytes < 0:
        raise CollectiveError(f"{name}: message_bytes must be >= 0, got {message_bytes}")
    if not isinstance(group, CollectiveGroup):
        raise CollectiveError(f"{name}: group must be a CollectiveGroup, got {type(group).__name__}")
    return name


class CollectivePricer:
    """Prices collectives for one device from a store's collective rows (read once) and the model."""

    def __init__(self, store: Optional[Store], device: DeviceSpec,
                 calibration: Optional[CollectiveCalibration] = None) -> None:
        self.device = device
        self.backend = backend_for(device)
        self.calibration = calibration
        names = {device.name, *device.aliases}
        self._rows: dict[tuple[str, int, int, str], dict[int, dict[str, KernelRecord]]] = {}
        if store is not None:
            with store:
                for rec in store.records(op=COLLECTIVE_OP):   # oldest first: newer rows overwrite
                    if rec.fingerprint.device_name not in names:
                        continue
                    op, nbytes, world, per_node, backend = key_fields(rec.key)
                    group = self._rows.setdefault((op, world, per_node, backend), {})
                    group.setdefault(nbytes, {})[rec.key.dtype] = rec

    def __len__(self) -> int:
        return sum(len(recs) for by_size in self._rows.values() for recs in by_size.values())

    def price(self, op: str, message_bytes: int, group: CollectiveGroup,
              dtype: Optional[str] = None) -> CollectivePrice:
        """Price one collective; ``dtype`` (torch's name, e.g. "bfloat16") picks among rows of several dtypes."""
        name = _validate(op, message_bytes, group)
        message_bytes = int(message_bytes)   # numpy / sympy integers
        model = model_time(name, message_bytes, group, self.device, self.calibration)
        by_size = self._rows.get((name, group.world, group.ranks_per_node, self.backend))
        if by_size:
            rows = {nbytes: _pick(recs, dtype) for nbytes, recs in by_size.items()}
            rec = rows.get(message_bytes)
            if rec is not None:
                return CollectivePrice(rec.median_ns, PriceSource.MEASURED, model.algorithm, model.protocol,
                                       model.bus_bytes, f"{rec.source} n={rec.n_runs}")
            interpolated = _interpolate(rows, message_bytes)
            if interpolated is not None:
                time_ns, lo, hi = interpolated
                return CollectivePrice(time_ns, PriceSource.INTERPOLATED, model.algorithm, model.protocol,
                                       model.bus_bytes, f"between measured {lo} and {hi} bytes")
        return CollectivePrice(model.time_ns, PriceSource.MODEL, model.algorithm, model.protocol, model.bus_bytes,
                               model.detail)


def _pick(records: dict[str, KernelRecord], dtype: Optional[str]) -> KernelRecord:
    if dtype in records:
        return records[dtype]
    for name in DTYPE_PREFERENCE:
        if name in records:
            return records[name]
    return records[min(records)]


def _interpolate(rows: dict[int, KernelRecord], message_bytes: int) -> Optional[tuple[float, int, int]]:
    """Log-log linear time between the bracketing measured sizes, or None outside them / too far apart."""
    if message_bytes <= 0:
        return None
    sizes = sorted(b for b in rows if b > 0)
    lower = [b for b in sizes if b < message_bytes]
    upper = [b for b in sizes if b > message_bytes]
    if not lower or not upper:
        return None
    lo, hi = lower[-1], upper[0]
    if min(message_bytes / lo, hi / message_bytes) > MAX_NEIGHBOUR_RATIO:
        return None
    t_lo, t_hi = max(rows[lo].median_ns, 1e-3), max(rows[hi].median_ns, 1e-3)
    w = (math.log(message_bytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp((1 - w) * math.log(t_lo) + w * math.log(t_hi)), lo, hi


def price_collective(op: str, message_bytes: int, group: CollectiveGroup, device: DeviceSpec,
                     store: Optional[Store] = None, dtype: Optional[str] = None) -> CollectivePrice:
    """Time of one collective ``op`` of ``message_bytes`` (nccl-tests' size: the whole buffer, see the module
    docstring) over ``group`` on ``device``; ``store``'s collective rows of this device price it when they can.

    Raises ``CollectiveError`` (a ``BoomfxError``) for an unknown op, a negative size, or a bad group.
    A caller pricing many collectives should keep one ``CollectivePricer`` (the store is read once per pricer).
    """
    pricer = CollectivePricer(store, device)
    return pricer.price(op, message_bytes, group, dtype)


__all__ = ["COLLECTIVE_OP", "ClusterTopology", "CollectiveGroup", "CollectivePrice", "CollectivePricer", "bus_factor",
           "collective_key", "price_collective"]
