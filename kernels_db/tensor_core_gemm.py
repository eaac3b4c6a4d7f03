"""Tensor-core GEMMs (bf16/fp16, per-tensor scaled fp8): the kernel families and the fitted parameters.

The time formula is the fp32 one (``gpu_model_core.gemm_time_ns``: tiles spread over the SMs in waves,
``e = e_max * e_tile * e_depth``, split-K with an fp32 reduction, never faster than DRAM), with the
candidate kernels of the tensor-core libraries and the precision's own dense peak:

* bf16/fp16: cuBLAS ``*_s16816gemm`` / sm90 ``wgmma`` CTA tiles 256x128 .. 64x64 and skinny 128x32 /
  32x128 / 64x32 / 32x64, split-K 1..16; 2-byte operands and output. fp16 uses the bf16 parameters
  (same tensor-core rate and kernels on every GPU here; the data has no fp16 rows).
* fp8 (``aten._scaled_mm``, CUTLASS ``cutlass_scaled_mm``): the same tiles and split-K; 1-byte operands,
  2-byte (bf16) output; rates against the dense fp8 peak.

``e_max`` is a fraction of the dense datasheet peak of the precision (``DeviceSpec.peak_for``), so a
GPU without measurements is placed by datasheet: the generic parameters (geometric median of the
measured GPUs' e_max, medians of the rest) applied to its own peak, bandwidth and SM count.

Shape effects the formula misses (which kernel cuBLAS/CUTLASS's heuristic picks for a shape, Hopper's
stream-K scheduling, epilogue costs at tiny K) are kept as a *shape table*: per measured device and
precision, ``log(measured / formula)`` on the grid of measured ``(m, n, k)`` (``m`` at powers of two),
interpolated linearly in ``log2`` sizes and clamped at the grid's edges. The libraries choose kernels
per GPU architecture, so a GPU without measurements borrows the table *and* the parameters of a measured
GPU of its architecture (same compute capability) -- the transfer this
project already does between kernel databases -- and otherwise the generic parameters with the median
table of all measured GPUs.

Parameters live in ``kernels_db/data/lowp_calibration.json``, written by ``fit_lowp_model.py``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from boomfx.core.devices import DeviceSpec
from boomfx.kernels_db import gpu_model_core as core
from boomfx.kernels_db.gpu_model_core import GemmParams, KernelFamily

LOWP_CALIBRATION_PATH = Path(__file__).parent / "data" / "lowp_calibration.json"

TENSOR_CORE_TILES: tuple[tuple[int, int], ...] = (
    (256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64),
    (128, 32), (32, 128), (64, 32), (32, 64),
)
TENSOR_CORE_SPLIT_K: tuple[int, ...] = (1, 2, 4, 8, 16)
TENSOR_CORE_REFERENCE_INTENSITY = 256 * 128 / (256 + 128)   # the largest tile reaches e_max

FAMILIES: Mapping[str, KernelFamily] = {
    "bf16": KernelFamily(TENSOR_CORE_TILES, TENSOR_CORE_SPLIT_K, TENSOR_CORE_REFERENCE_INTENSITY, 2, 2),
    "fp8": KernelFamily(TENSOR_CORE_TILES, TENSOR_CORE_SPLIT_K, TENSOR_CORE_REFERENCE_INTENSITY, 1, 2),
}
# dtype of the GEMM operands -> precision key; the peak is the dtype's own dense tensor-core figure.
PRECISION_OF: Mapping[torch.dtype, str] = {
    torch.bfloat16: "bf16", torch.float16: "bf16",
    torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8",
}
PEAK_DTYPE: Mapping[str, torch.dtype] = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def precision_peak_flops_per_s(device: DeviceSpec, precision: str, dtype: Optional[torch.dtype] = None) -> Optional[float]:
    """The dense tensor-core peak for ``dtype`` (default: the precision's), None if the GPU lacks one."""
    dtype = dtype or PEAK_DTYPE[precision]
    if dtype not in device.peak_flops_per_s:
        return None
    return float(device.peak_flops_per_s[dtype])


@dataclass(frozen=True)
class ShapeTable:
    """``log(measured / formula)`` on a grid of ``log2`` sizes (``log_ratio[i, j, l]`` at ``m[i], n[j], k[l]``)."""

    log2_m: tuple[float, ...]
    log2_n: tuple[float, ...]
    log2_k: tuple[float, ...]
    log_ratio: tuple[tuple[tuple[float, ...], ...], ...]

    def correction(self, m: Any, n: Any, k: Any) -> np.ndarray:
        """``exp`` of the trilinear interpolation at ``(m, n, k)``; constant beyond the grid."""
        grid = np.asarray(self.log_ratio, dtype=np.float64)
        point = [np.log2(np.maximum(np.asarray(x, dtype=np.float64), 1.0)) for x in (m, n, k)]
        point = np.broadcast_arrays(*point)
        weights = []
        for axis, x in zip((self.log2_m, self.log2_n, self.log2_k), point):
            ax = np.asarray(axis)
            x = np.clip(x, ax[0], ax[-1])
            hi = np.clip(np.searchsorted(ax, x, side="right"), 1, len(ax) - 1) if len(ax) > 1 else np.zeros_like(x, int)
            lo = np.maximum(hi - 1, 0)
            span = np.where(ax[hi] > ax[lo], ax[hi] - ax[lo], 1.0)
            frac = np.where(ax[hi] > ax[lo], (x - ax[lo]) / span, 0.0)
            weights.append((lo, hi, frac))
        (i0, i1, fi), (j0, j1, fj), (l0, l1, fl) = weights
        out = np.zeros(point[0].shape)
        for ii, wi in ((i0, 1 - fi), (i1, fi)):
            for jj, wj in ((j0, 1 - fj), (j1, fj)):
                for ll, wl in ((l0, 1 - fl), (l1, fl)):
                    out = out + wi * wj * wl * grid[ii, jj, ll]
        return np.exp(out)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "ShapeTable":
        return ShapeTable(tuple(d["log2_m"]), tuple(d["log2_n"]), tuple(d["log2_k"]),
                          tuple(tuple(tuple(row) for row in plane) for plane in d["log_ratio"]))


@dataclass(frozen=True)
class LowpCalibration:
    """Per-device parameters and shape tables, generic parameters, by precision; and each measured
    device's compute capability (to pick an architecture sibling for GPUs without measurements)."""

    devices: Mapping[str, Mapping[str, GemmParams]] = field(default_factory=dict)
    generic: Mapping[str, GemmParams] = field(default_factory=dict)
    tables: Mapping[str, Mapping[str, ShapeTable]] = field(default_factory=dict)
    generic_tables: Mapping[str, ShapeTable] = field(default_factory=dict)
    capability: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> "LowpCalibration":
        g = doc["gemm"]
        devices = {name: {p: GemmParams(**v) for p, v in d.items()} for name, d in g["devices"].items()}
        generic = {p: GemmParams(**v) for p, v in g["generic"].items()}
        tables = {name: {p: ShapeTable.from_json(v) for p, v in d.items()} for name, d in g.get("tables", {}).items()}
        generic_tables = {p: ShapeTable.from_json(v) for p, v in g.get("generic_tables", {}).items()}
        capability = {name: tuple(cc) for name, cc in g.get("capability", {}).items()}
        return LowpCalibration(devices, generic, tables, generic_tables, capability)

    @staticmethod
    def load(path: Optional[Path | str] = None) -> "LowpCalibration":
        with open(path or LOWP_CALIBRATION_PATH) as fh:
            return LowpCalibration.from_json(json.load(fh))

    def without_device(self, name: str, generic: Optional[Mapping[str, GemmParams]] = None,
                       generic_tables: Optional[Mapping[str, ShapeTable]] = None) -> "LowpCalibration":
        """The calibration as if ``name`` had never been measured (its generic parts refitted by the caller)."""
        drop = lambda d: {k: v for k, v in d.items() if k != name}   # noqa: E731
        return LowpCalibration(drop(self.devices), generic or self.generic, drop(self.tables),
                               generic_tables or self.generic_tables, drop(self.capability))

    def source_device(self, precision: str, device: DeviceSpec) -> Optional[str]:
        """The measured device whose parameters and shape table price ``device``: itself, else a measured
        GPU of the same compute capability (first by name). Same major version only is not enough: held
        out, the A100 priced from the L40S (8.9) was off by 27% (median), worse than the generic 18%."""
        measured = [n for n, d in self.devices.items() if precision in d]
        if device.name in measured:
            return device.name
        hits = sorted(n for n in measured if self.capability.get(n) == device.compute_capability)
        return hits[0] if hits else None

    def params(self, precision: str, device: DeviceSpec) -> Optional[GemmParams]:
        source = self.source_device(precision, device)
        if source is not None:
            return self.devices[source][precision]
        return self.generic.get(precision)

    def table(self, precision: str, device: DeviceSpec) -> Optional[ShapeTable]:
        source = self.source_device(precision, device)
        if source is not None and precision in self.tables.get(source, {}):
            return self.tables[source][precision]
        return self.generic_tables.get(precision)

    def gemm_ns(self, precision: str, b: Any, m: Any, n: Any, k: Any, device: DeviceSpec,
                dtype: Optional[torch.dtype] = None, floor_ns: Optional[float] = None) -> Optional[np.ndarray]:
        """Predicted ns of ``[b, m, k] @ [b, k, n]`` at ``precision``; None when the GPU has no peak for
        it (fp8 before Ada/Hopper) or no parameters exist. ``floor_ns`` replaces the fitted floor."""
        params = self.params(precision, device)
        peak = precision_peak_flops_per_s(device, precision, dtype)
        if params is None or peak is None or device.sm_count <= 0:
            return None
        if floor_ns is not None:
            params = GemmParams(params.e_max, params.k_half, params.tile_alpha, floor_ns, params.mem_efficiency)
        t = formula_ns(precision, b, m, n, k, device, params, dtype)
        table = self.table(precision, device)
        if table is not None:
            t = t * table.correction(m, n, k)
        # never faster than the datasheet roofline
        return np.maximum(t, roofline_gemm_ns(precision, b, m, n, k, device, dtype))


def formula_ns(precision: str, b: Any, m: Any, n: Any, k: Any, device: DeviceSpec, params: GemmParams,
               dtype: Optional[torch.dtype] = None) -> np.ndarray:
    """The tile/wave formula alone (no shape table)."""
    return core.gemm_time_ns(b, m, n, k, peak_flops_per_s=precision_peak_flops_per_s(device, precision, dtype),
                             bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
                             sm_count=device.sm_count, params=params, family=FAMILIES[precision])


def roofline_gemm_ns(precision: str, b: Any, m: Any, n: Any, k: Any, device: DeviceSpec,
                     dtype: Optional[torch.dtype] = None) -> np.ndarray:
    """``max(2bmnk / dense peak, bytes / bandwidth)`` with the precision's element sizes."""
    b, m, n, k = (np.asarray(x, dtype=np.float64) for x in (b, m, n, k))
    fam = FAMILIES[precision]
    nbytes = b * (fam.in_itemsize * (m * k + k * n) + fam.out_itemsize * m * n)
    flops = 2.0 * b * m * n * k
    return np.maximum(flops / precision_peak_flops_per_s(device, precision, dtype),
                      nbytes / device.memory_bandwidth_bytes_per_s) * 1e9
