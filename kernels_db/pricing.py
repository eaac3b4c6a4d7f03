"""Where a kernel gets its price. Built once per analysis, in this order of preference:

1. the target device's own kernel database: measured > interpolated (``kernels_db.lookup``);
2. with ``--from-db``, kernels measured on other GPUs, transferred kernel by kernel to the target
   through the GPU kernel model (labelled "transferred"), each source GPU priced by its own rows;
3. for CUDA targets, the GPU kernel model fitted on public measurements (labelled "model"); for a CPU
   target, the CPU kernel model over this host's measured rates (``cpu_model``, ``host_probe``; "model")
   whenever a database is asked for (the CLI's ``--db auto`` and ``--db none`` included): without one
   (``db=None``, the Python API's default) CPU prices stay a pure function of the graph and the device;
4. the datasheet roofline (labelled "roofline").
Every price carries its source; the report totals the share of time each source priced. Host time
outside the prices (a compiled step's graph entries, a CPU's cold starts) comes from ``host_costs``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from boomfx.core.devices import DeviceSpec, get_device
from boomfx.core.errors import OptionError
from boomfx.passes.costs.registry import Cost, OpCall

from boomfx.kernels_db.db_path import AUTO_DB, NO_DB, resolve_db_path
from boomfx.kernels_db.price import DATABASE_SOURCES, KernelPrice, Pricer, PriceSource
from boomfx.kernels_db.schema import KernelRecord

if TYPE_CHECKING:
    from boomfx.kernels_db.gpu_model import GpuKernelModel
    from boomfx.kernels_db.host_probe import HostProfile
    from boomfx.kernels_db.host_overheads import HostCosts

__all__ = ["AUTO_DB", "NO_DB", "resolve_db_path", "make_pricer", "host_costs", "db_label", "set_step_footprint", "cpu_host_model"]


@dataclass
class _TransferModel:
    """Prices a call on the target from source GPUs' rows: source price x model ratio.

    ``sources`` holds one (pricer, device) per GPU of the ``--from-db`` file, each pricer reading only that
    GPU's rows (``kernels_db/device_rows.py``), nearest to the target first (``_source_order``): the first
    source that measured or can interpolate the call prices it.
    """

    sources: list[tuple[Any, DeviceSpec]]
    gpu_model: "GpuKernelModel"

    def __call__(self, call: OpCall, target: DeviceSpec) -> Optional[float]:
        from boomfx.kernels_db.roofline import roofline_ns
        cost = _call_cost(call)
        for pricer, source in self.sources:
            price = pricer.price(call, cost)
            if price.source not in DATABASE_SOURCES:
                continue
            ratio_model = self.gpu_model.transfer_ns(price.time_ns, call, source, target)
            if ratio_model is not None:
                return ratio_model
            return price.time_ns * roofline_ns(call, cost, target) / roofline_ns(call, cost, source)
        return None


def _call_cost(call: OpCall) -> Cost:
    from boomfx.passes.costs.registry import price_call
    return price_call(call).cost


def _source_order(source: DeviceSpec, target: DeviceSpec) -> tuple:
    """Nearest source first: the target itself, then the same architecture (compute capability), then the
    closest memory bandwidth (most kernels of a step are memory-bound), then by name (deterministic)."""
    import math
    bandwidth_gap = abs(math.log(source.memory_bandwidth_bytes_per_s / target.memory_bandwidth_bytes_per_s))
    return (source.name != target.name, source.compute_capability != target.compute_capability,
            bandwidth_gap, source.name)


def _source_pricers(store_path: Path, target: DeviceSpec) -> list[tuple[Any, DeviceSpec]]:
    """One pricer per known GPU of the ``--from-db`` file, each over that GPU's rows only, nearest first."""
    from boomfx.kernels_db.device_rows import devices_in
    from boomfx.kernels_db.lookup import KernelPricer
    from boomfx.kernels_db.store import Store
    held = devices_in(Store(store_path))
    specs = []
    for d in held:
        try:
            spec = get_device(d.device_name)
        except KeyError:
            continue
        if spec.kind == "cuda":
            specs.append(spec)
    if not specs:
        names = ", ".join(d.device_name for d in held) or "none"
        raise OptionError(f"--from-db {store_path}: its devices ({names}) are not known GPUs")
    specs.sort(key=lambda spec: _source_order(spec, target))
    return [(KernelPricer(Store(store_path), spec), spec) for spec in specs]


class _ModelBackedPricer:
    """A database pricer whose roofline answers are replaced by the GPU kernel model's, when it has one."""

    def __init__(self, inner: Pricer, gpu_model: "GpuKernelModel", device: DeviceSpec) -> None:
        self.inner = inner
        self.gpu_model = gpu_model
        self.device = device
        self.warnings = inner.warnings

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
        profile = _host_profile(device) if db_path is not None else None   # db=None: a pure function
        if profile is None:
            return _calibrated(KernelPricer(store, device), path)
        from boomfx.kernels_db.cpu_model import CpuKernelModel
        probed = dataclasses.replace(device, host_issue_ns=profile.dispatch_ns)
        return _calibrated(KernelPricer(store, probed, model=CpuKernelModel(profile)), path)
    from boomfx.kernels_db.gpu_model import GpuKernelModel
    gpu_model = GpuKernelModel.load()
    transfer = None
    if from_db:
        src_path = Path(from_db)
        if not src_path.exists():
            raise OptionError(f"--from-db: no kernel database at {src_path}")
        transfer = _TransferModel(_source_pricers(src_path, device), gpu_model)
    inner = KernelPricer(store, device, model=transfer, model_source=PriceSource.TRANSFERRED)
    return _calibrated(_ModelBackedPricer(inner, gpu_model, device), path)


def _calibrated(pricer: Any, path: Optional[Path]) -> Any:
    """``pricer`` with the database's in-situ factors per op class (``boomfx validate --calibrate``), if any."""
    from boomfx.kernels_db.calibration import CalibratedPricer, read_calibration
    factors = read_calibration(path)
    return CalibratedPricer(pricer, factors) if factors else pricer


def host_costs(pricer: Pricer, device: DeviceSpec) -> "HostCosts":
    """The host costs outside kernel prices (``kernels_db/host_overheads.py``: compiled graphs' entries,
    cold starts): the rows the database measured on its host, else (a CPU target) this host's probe
    (``host_probe``), else the defaults for ``device``'s kind."""
    import dataclasses
    from boomfx.kernels_db.host_overheads import HostCosts
    model = cpu_host_model(pricer)
    costs = HostCosts.from_records(list(pricer.host_records.values()), device.kind,
                                   probed=model.profile.host_costs if model is not None else None)
    if model is not None and model.profile.in_step:     # its prices are in-step prices (cpu_model.py)
        costs = dataclasses.replace(costs, in_step_sources=costs.in_step_sources | {PriceSource.MODEL.value})
    return costs


def set_step_footprint(pricer: Any, nbytes: Optional[int]) -> None:
    """Tell a CPU pricer's host model (``cpu_model.CpuKernelModel``) the footprint of the step it prices
    next: the cache level its kernels find their operands at. A no-op for other pricers."""
    model = cpu_host_model(pricer)
    if model is not None:
        model.footprint_bytes = nbytes


def cpu_host_model(pricer: Any) -> Any:
    """The ``CpuKernelModel`` a (possibly wrapped) pricer consults, or None."""
    from boomfx.kernels_db.cpu_model import CpuKernelModel
    inner = pricer
    while inner is not None:
        model = getattr(inner, "model", None)
        if isinstance(model, CpuKernelModel):
            return model
        inner = getattr(inner, "inner", None)
    return None


def _host_profile(device: DeviceSpec) -> "Optional[HostProfile]":
    """This host's probe (``kernels_db/host_probe.py``) when ``device`` is this host's CPU, else None."""
    if device.kind != "cpu":
        return None
    from boomfx.kernels_db.host_probe import host_profile
    return host_profile()


def db_label(db: Optional[str]) -> Optional[str]:
    return None if db in (None, NO_DB) else os.fspath(db)
