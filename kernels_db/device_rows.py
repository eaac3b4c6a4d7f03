"""Which rows of a kernel database belong to the target device.

One file may hold rows of several devices (``boomfx kernels import <public data> --db one.sqlite`` writes
eight GPUs' rows into it; the user guide allows it). Every lookup (exact, interpolated, transferred,
block-measured, host-overhead rows, workspace) reads only the rows whose fingerprint is of the device
being priced: a row keyed only by its kernel would otherwise price an H100 with a P4's time (BERT-large
on ``h100-sxm`` with the eight-GPU file: 422 ms per step instead of 124 ms, ``aten.linear`` at 1.42 ms
per call instead of 0.39 ms, measured when this module was written).

A fingerprint is of a device when its kind matches and its ``device_name`` names the same registry
device (aliases and raw CUDA names resolved: "h100", "NVIDIA H100 80GB HBM3" and "h100-sxm" are one device). Every CPU fingerprint is of
the ``cpu`` target (the registry has one CPU, "this host").

Known limitations:
- Several fingerprints of one device (other torch versions, thread counts, hosts) are all used, the
  newest row of a key winning, as before this filter existed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from boomfx.core.devices import DeviceSpec, UnknownDeviceError, get_device
from boomfx.kernels_db.schema import DeviceFingerprint
from boomfx.kernels_db.store import Store, device_slug


def canonical_device_name(device_name: str) -> str:
    """The registry name of a fingerprint's device name ('h100' -> 'h100-sxm', and a raw CUDA name such as
    'NVIDIA H100 80GB HBM3' as ``measure.registry_device_name`` reads it); unknown names as a slug."""
    from boomfx.kernels_db.measure import registry_device_name
    try:
        return get_device(device_name).name
    except UnknownDeviceError:
        return registry_device_name(device_name) or device_slug(device_name)


def is_of_device(fingerprint: DeviceFingerprint, device: DeviceSpec) -> bool:
    """True when rows of ``fingerprint`` were measured on ``device`` (kind and registry name agree)."""
    if fingerprint.device_kind != device.kind:
        return False
    if device.kind == "cpu":
        return True
    return canonical_device_name(fingerprint.device_name) == canonical_device_name(device.name)


def device_fingerprints(store: Store, device: DeviceSpec) -> list[DeviceFingerprint]:
    """The fingerprints of ``store`` measured on ``device``."""
    with store:
        return [fp for fp in store.fingerprints() if is_of_device(fp, device)]


@dataclass(frozen=True)
class DeviceRows:
    """How many rows of one device a file holds (``kernels info``, the no-rows warning)."""

    device_name: str        # registry name (or the slug of an unknown device)
    device_kind: str
    rows: int
    fingerprints: int


def devices_in(store: Store) -> list[DeviceRows]:
    """Each device of the file with its row and fingerprint counts, most rows first."""
    counts: dict[tuple[str, str], list[int]] = {}
    with store:
        for fp in store.fingerprints():
            name = "cpu" if fp.device_kind == "cpu" else canonical_device_name(fp.device_name)
            entry = counts.setdefault((name, fp.device_kind), [0, 0])
            entry[0] += store.count(fp)
            entry[1] += 1
    rows = [DeviceRows(name, kind, n, f) for (name, kind), (n, f) in counts.items()]
    return sorted(rows, key=lambda d: (-d.rows, d.device_name))


def no_rows_warning(store: Store, device: DeviceSpec, fallback: str) -> Optional[str]:
    """One line when the file has rows but none of ``device``; None when it has some (or is empty)."""
    held = devices_in(store)
    if not held or any(d.device_name == canonical_device_name(device.name) and d.device_kind == device.kind
                       or (device.kind == "cpu" and d.device_kind == "cpu") for d in held):
        return None
    names = ", ".join(f"{d.device_name} ({d.rows} rows)" for d in held)
    return (f"kernel database {store.path} holds no rows measured on {device.name} (it holds {names}); "
            f"its rows are not used for {device.name}, which is priced by {fallback}")


__all__ = ["DeviceRows", "canonical_device_name", "device_fingerprints", "devices_in", "is_of_device",
           "no_rows_warning"]
