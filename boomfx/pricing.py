"""Where a kernel gets its price: the kernel database lookup (measured > interpolated > transferred >
GPU model > roofline), built once per analysis. Every price carries its source for the report."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from boomfx.devices import DeviceSpec
from boomfx.passes.costs.registry import Cost, OpCall


@dataclass(frozen=True)
class KernelPrice:
    time_ns: float
    host_ns: float
    workspace_bytes: int
    source: str
    detail: str = ""


class Pricer(Protocol):
    def price(self, call: OpCall, cost: Cost) -> Any: ...


def make_pricer(device: DeviceSpec, db_path: Optional[str] = None, from_db: Optional[str] = None) -> Pricer:
    """The pricer for ``device``: its own database (if any), a source GPU's database to transfer
    from (if any), the GPU kernel model for CUDA devices, and the roofline as the last resort."""
    from boomfx.kernels_db.lookup import build_pricer
    return build_pricer(device, db_path=db_path, from_db=from_db)
