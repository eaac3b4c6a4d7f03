"""What every pricer returns, and the one vocabulary of where a number came from.

A price chain (``kernels_db/pricing.py``) is a sequence of pricers that each satisfy ``Pricer``; each
answer is a ``KernelPrice`` labelled with a ``PriceSource``. The report (boomfx/report/model.py) lists
the sources in this enum's order, best first.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Mapping, Protocol

if TYPE_CHECKING:  # typing only: the price types sit below the cost formulas' users
    from boomfx.kernels_db.schema import KernelRecord
    from boomfx.passes.costs.registry import Cost, OpCall


class PriceSource(str, Enum):
    """Where a kernel's time came from, best first."""

    MEASURED = "measured"                 # an exact row of the device's database
    MEASURED_IN_STEP = "measured-in-step"  # an exact row timed inside its program's step (kernels_db/in_step.py)
    BLOCK_MEASURED = "block-measured"     # a whole repeated block timed on the device (kernels_db/blocks_db.py)
    INTERPOLATED = "interpolated"         # rows of the same signature, inside their hull (kernels_db/lookup.py)
    TRANSFERRED = "transferred"           # another GPU's row scaled by the GPU kernel model (--from-db)
    MODEL = "model"                       # the GPU kernel model fitted on public data (kernels_db/gpu_model.py)
    ROOFLINE = "roofline"                 # the datasheet roofline (kernels_db/roofline.py)


DATABASE_SOURCES = (PriceSource.MEASURED, PriceSource.MEASURED_IN_STEP, PriceSource.INTERPOLATED)   # priced from rows of the database


@dataclass(frozen=True)
class KernelPrice:
    """Time of one kernel, its host issue time and workspace, and where the numbers came from.

    ``host_in_time`` is True when ``time_ns`` already includes ``host_ns`` (CPU measurements, where
    issue and execution share one thread); a simulator must not add the two then.
    """

    time_ns: float
    host_ns: float
    workspace_bytes: int
    source: PriceSource
    detail: str = ""
    host_in_time: bool = False


class Pricer(Protocol):
    """Anything that prices a bound call: the database pricer, the model-backed and transfer wrappers."""

    @property
    def host_records(self) -> Mapping[str, "KernelRecord"]:
        """Measured host-overhead rows (kernels_db/host_overheads.py) of the database behind it."""
        ...

    def price(self, call: "OpCall", cost: "Cost") -> KernelPrice:
        ...
