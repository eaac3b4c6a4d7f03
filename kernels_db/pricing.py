"""Where a kernel gets its price. Built once per analysis, in this order of preference:

1. the target device's own kernel database: measured > interpolated (``kernels_db.lookup``);
2. with ``--from-db``, kernels measured on another GPU, transferred kernel by kernel to the target
   through the GPU kernel model (labelled "transferred");
3. for CUDA targets, the GPU kernel model fitted on public measurements (labelled "model");
4. the datasheet roofline (labelled "roofline").
Every price carries its source; the report totals the share of time each source priced. Host time
outside the prices (a compiled step's graph entries, a CPU's cold starts) comes from ``host_costs``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

from boomfx.core.devices import DeviceSpec, get_device
from boomfx.core.errors import OptionError
from boomfx.passes.costs.registry import Cost, OpCall

from boomfx.kernels_db.db_path import AUTO_DB, NO_DB, resolve_db_path
from boomfx.kernels_db.price import KernelPrice, Pricer, PriceSource
from boomfx.kernels_db.schema import KernelRecord

if TYPE_CHECKING:
    from boomfx.kernels_db.gpu_model import GpuKernelModel
    from boomfx.kernels_db.host_overheads import HostCosts

__all__ = ["AUTO_DB", "NO_DB", "resolve_db_path", "make_pricer", "host_costs", "db_label"]


@dataclass
class _TransferModel:
    """Prices a call on the target from the source GPU's database: source price x model ratio."""

    source_pricer: Pricer
    source: DeviceSpec
    gpu_model: "GpuKernelModel"

    def __call__(self, call: OpCall, target: DeviceSpec) -> Optional[float]:
        from boomfx.kernels_db.roofline import roofline_ns
        price = self.source_pricer.price(call, _call_cost(call))
        if price.source not in (PriceSource.MEASURED, PriceSource.INTERPOLATED):
            return None
        ratio_model = self.gpu_model.transfer_ns(price.time_ns, call, self.source, target)
        if ratio_model is not None:
            return ratio_model
        cost = _call_cost(call)
        return price.time_ns * roofline_ns(call, cost, target) / roofline_ns(call, cost, self.source)


def _call_cost(call: OpCall) -> Cost:
    from boomfx.passes.costs.registry import price_call
    return price_call(call).cost


def _source_device(store_path: Path) -> DeviceSpec:
    from boomfx.kernels_db.store import Store
    with Store(store_path) as store:
        names = sorted({fp.device_name for fp in store.fingerprints()})
    for name in names:
        try:
            return get_device(name)
        except KeyError:
            continue
    raise OptionError(f"--from-db {store_path}: its device ({', '.join(names) or 'none'}) is not a known device")


class _ModelBackedPricer:
    """A database pricer whose roofline answers are replaced by the GPU kernel model's, when it has one."""

    def __init__(self, inner: Pricer, gpu_model: "GpuKernelModel", device: DeviceSpec) -> None:
        self.inner = inner
        self.gpu_model = gpu_model
        self.device = device

    @property
    def host_records(self) -> Mapping[str, KernelRecord]:
        return self.inner.host_records

    def price(self, call: OpCall, cost: Cost) -> KernelPrice:
        price = self.inner.price(call, cost)
        if price.source != PriceSource.ROOFLINE:
            return price
        time_ns = self.gpu_model.predict_ns(call, self.device, launch_floor=True)
        if time_ns is None:
            return price
        return KernelPrice(float(time_ns), self.device.host_issue_ns, 0, PriceSource.MODEL, "GPU kernel model")


def make_pricer(device: DeviceSpec, db_path: Optional[str] = None, from_db: Optional[str] = None) -> Pricer:
    """The pricer for ``device`` with the database, transfer and model hooks that apply."""
    from boomfx.kernels_db.lookup import KernelPricer
    from boomfx.kernels_db.store import Store
    path = resolve_db_path(db_path, device)
    store = Store(path) if path is not None else None
    if device.kind != "cuda":
        if from_db:
            raise OptionError("--from-db transfers GPU measurements; it needs a CUDA target device")
        return KernelPricer(store, device)
    from boomfx.kernels_db.gpu_model import GpuKernelModel
    gpu_model = GpuKernelModel.load()
    transfer = None
    if from_db:
        src_path = Path(from_db)
        if not src_path.exists():
            raise OptionError(f"--from-db: no kernel database at {src_path}")
        src_device = _source_device(src_path)
        transfer = _TransferModel(KernelPricer(Store(src_path), src_device), src_device, gpu_model)
    inner = KernelPricer(store, device, model=transfer, model_source=PriceSource.TRANSFERRED)
    return _ModelBackedPricer(inner, gpu_model, device)


def host_costs(pricer: Pricer, device: DeviceSpec) -> "HostCosts":
    """The host costs outside kernel prices (``kernels_db/host_overheads.py``: compiled graphs' entries,
    cold starts): the rows the database measured on its host, else the defaults for ``device``'s kind."""
    from boomfx.kernels_db.host_overheads import HostCosts
    return HostCosts.from_records(list(pricer.host_records.values()), device.kind)


def db_label(db: Optional[str]) -> Optional[str]:
    return None if db in (None, NO_DB) else os.fspath(db)
