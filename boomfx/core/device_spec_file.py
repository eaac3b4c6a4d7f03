"""A device described in a small JSON file (``--device-spec FILE.json``): the fields of ``DeviceSpec``.

For a GPU the registry does not list. Units are in the field names, as in ``DeviceSpec``; peaks are dense
FLOP/s keyed by torch dtype name. Required: ``name``, ``kind`` ("cuda"/"cpu"), ``peak_flops_per_s`` with a
``float32`` entry, ``memory_bandwidth_bytes_per_s``, ``memory_bytes``, and for "cuda" ``sm_count``. Any other
``DeviceSpec`` field is optional and takes the registry's default. Example::

    {"name": "my-gpu", "kind": "cuda", "description": "a lab card",
     "peak_flops_per_s": {"float32": 40e12, "bfloat16": 160e12, "float16": 160e12},
     "memory_bandwidth_bytes_per_s": 900e9, "memory_bytes": 25769803776, "sm_count": 84,
     "l2_bytes": 6291456, "compute_capability": [8, 6], "memory_type": "GDDR6",
     "sources": {"all": "vendor datasheet"}}

A GPU described this way has no measurements: the GPU kernel model places it by its datasheet figures
(and borrows the shape effects of a measured GPU with the same ``compute_capability``).
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

import torch

from boomfx.core.devices import DEFAULT_EFFICIENCY, DeviceSpec
from boomfx.core.errors import OptionError

REQUIRED = ("name", "kind", "peak_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes")
NUMBER_FIELDS = ("memory_bandwidth_bytes_per_s", "tf32_flops_per_s", "kernel_launch_ns", "host_issue_ns")
INT_FIELDS = ("memory_bytes", "sm_count", "l2_bytes")
KINDS = ("cuda", "cpu")


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise OptionError(f"{where}: peak_flops_per_s key {name!r} is not a torch floating dtype name")
    return dtype


def _positive(value: Any, key: str, where: str, integer: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise OptionError(f"{where}: {key} must be {kind}, got {value!r}")
    return value


def device_spec_from_dict(d: Mapping[str, Any], where: str = "device spec") -> DeviceSpec:
    """Validate ``d`` and build the ``DeviceSpec``; any problem is one ``OptionError`` line."""
    if not isinstance(d, Mapping):
        raise OptionError(f"{where}: expected a JSON object with DeviceSpec fields")
    known = {f.name for f in fields(DeviceSpec)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise OptionError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    missing = [k for k in REQUIRED if k not in d] + (["sm_count"] if d.get("kind") == "cuda" and "sm_count" not in d else [])
    if missing:
        raise OptionError(f"{where}: missing required field(s) {', '.join(missing)}")
    if d["kind"] not in KINDS:
        raise OptionError(f"{where}: kind must be one of {', '.join(KINDS)}, got {d['kind']!r}")
    peaks = d["peak_flops_per_s"]
    if not isinstance(peaks, Mapping) or "float32" not in peaks:
        raise OptionError(f"{where}: peak_flops_per_s must be an object with at least a float32 entry")
    kwargs: dict[str, Any] = {"name": str(d["name"]), "kind": d["kind"], "description": str(d.get("description", d["name"])),
                              "peak_flops_per_s": {_dtype(k, where): float(_positive(v, f"peak_flops_per_s.{k}", where))
                                                   for k, v in peaks.items()}}
    if kwargs["peak_flops_per_s"][torch.float32] <= 0:
        raise OptionError(f"{where}: peak_flops_per_s.float32 must be positive")
    for key in NUMBER_FIELDS:
        if key in d:
            kwargs[key] = float(_positive(d[key], key, where))
    for key in INT_FIELDS:
        if key in d:
            kwargs[key] = int(_positive(d[key], key, where, integer=True))
    if kwargs["memory_bandwidth_bytes_per_s"] <= 0:
        raise OptionError(f"{where}: memory_bandwidth_bytes_per_s must be positive")
    if d["kind"] == "cuda" and kwargs["sm_count"] <= 0:
        raise OptionError(f"{where}: sm_count must be positive for a cuda device")
    if "compute_capability" in d:
        cc = d["compute_capability"]
        if not (isinstance(cc, (list, tuple)) and len(cc) == 2 and all(isinstance(x, int) for x in cc)):
            raise OptionError(f"{where}: compute_capability must be [major, minor], got {cc!r}")
        kwargs["compute_capability"] = (int(cc[0]), int(cc[1]))
    if "efficiency" in d:
        eff = d["efficiency"]
        if not isinstance(eff, Mapping) or set(eff) - set(DEFAULT_EFFICIENCY):
            raise OptionError(f"{where}: efficiency keys must be among {', '.join(DEFAULT_EFFICIENCY)}")
        kwargs["efficiency"] = {**DEFAULT_EFFICIENCY, **{k: float(_positive(v, f'efficiency.{k}', where)) for k, v in eff.items()}}
    if "nvlink_bytes_per_s" in d:       # interconnect (the collective model); zero means no NVLink
        value = d["nvlink_bytes_per_s"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise OptionError(f"{where}: nvlink_bytes_per_s must be a number >= 0, got {value!r}")
        kwargs["nvlink_bytes_per_s"] = float(value)
    for key in ("nvlink_generation", "pcie_generation"):
        if key in d:
            if not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 0:
                raise OptionError(f"{where}: {key} must be an integer >= 0, got {d[key]!r}")
            kwargs[key] = int(d[key])
    if "gpus_per_node" in d:
        kwargs["gpus_per_node"] = int(_positive(d["gpus_per_node"], "gpus_per_node", where, integer=True))
    for key in ("nvswitch", "nvlink_bridge"):
        if key in d:
            if not isinstance(d[key], bool):
                raise OptionError(f"{where}: {key} must be true or false, got {d[key]!r}")
            kwargs[key] = d[key]
    for key in ("memory_type",):
        if key in d:
            kwargs[key] = str(d[key])
    if "aliases" in d:
        kwargs["aliases"] = tuple(str(a) for a in d["aliases"])
    if "sources" in d:
        if not isinstance(d["sources"], Mapping):
            raise OptionError(f"{where}: sources must be an object of strings")
        kwargs["sources"] = {str(k): str(v) for k, v in d["sources"].items()}
    return DeviceSpec(**kwargs)


def device_spec_to_dict(spec: DeviceSpec) -> dict[str, Any]:
    """The JSON form ``device_spec_from_dict`` reads back to an equal ``DeviceSpec``."""
    return {
        "name": spec.name, "kind": spec.kind, "description": spec.description,
        "peak_flops_per_s": {str(dtype).removeprefix("torch."): v for dtype, v in spec.peak_flops_per_s.items()},
        "memory_bandwidth_bytes_per_s": spec.memory_bandwidth_bytes_per_s, "memory_bytes": spec.memory_bytes,
        "sm_count": spec.sm_count, "l2_bytes": spec.l2_bytes, "tf32_flops_per_s": spec.tf32_flops_per_s,
        "kernel_launch_ns": spec.kernel_launch_ns, "host_issue_ns": spec.host_issue_ns,
        "efficiency": dict(spec.efficiency), "compute_capability": list(spec.compute_capability),
        "memory_type": spec.memory_type, "aliases": list(spec.aliases), "sources": dict(spec.sources),
        "nvlink_bytes_per_s": spec.nvlink_bytes_per_s, "nvlink_generation": spec.nvlink_generation,
        "nvswitch": spec.nvswitch, "nvlink_bridge": spec.nvlink_bridge, "pcie_generation": spec.pcie_generation,
        "gpus_per_node": spec.gpus_per_node,
    }


def load_device_spec(path: str | Path) -> DeviceSpec:
    """Read a ``--device-spec`` file; a missing or malformed file is one ``OptionError`` line."""
    where = f"--device-spec {path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OptionError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OptionError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return device_spec_from_dict(doc, where)
