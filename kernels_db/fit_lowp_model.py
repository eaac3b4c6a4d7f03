"""Fit the tensor-core GEMM parameters (and the attention curves) on the public low-precision data.

Run ``python -m boomfx.kernels_db.fit_lowp_model [--data DIR] [--out FILE]`` to regenerate
``kernels_db/data/lowp_calibration.json`` (about a minute on 2 cores).

GEMM, per device and precision (bf16, fp8):

1. ``mem_efficiency`` is measured directly: the median achieved share of datasheet bandwidth of the
   GEMV-like rows (``m <= MEMORY_BOUND_MAX_M`` and at least ``MEMORY_BOUND_MIN_BYTES`` of weights), which
   stream the weight matrix once and do next to no arithmetic.
2. ``e_max``, ``floor_ns``, ``k_half``, ``tile_alpha``: the fp32 fit (``fit_gpu_model.fit_gemm_arrays``, grid
   over the shape parameters, relative least squares for the scale and floor) on a fixed random subsample
   of ``FIT_ROWS`` rows (the rows are a regular grid of shapes, so a subsample sees every regime).
3. Shape table: ``log(measured / formula)`` at the measured shapes with ``m`` a power of two
   (``tensor_core_gemm.ShapeTable``); missing grid points filled from their neighbours along ``m``.
4. Generic parameters (GPUs without measurements and no architecture sibling): geometric median of
   e_max, medians of the others; the generic table is the median of the measured tables.

Attention: see ``attention_model.fit_attention`` (called from here so one command writes one file).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from boomfx.core.devices import get_device
from boomfx.kernels_db.fit_gpu_model import K_HALF_GRID, TILE_ALPHA_GRID, fit_gemm_arrays
from boomfx.kernels_db.gpu_model_core import GemmParams
from boomfx.kernels_db.lowp_data import DEFAULT_LOWP_DIR, SOURCE, GemmTable, load_gemms
from boomfx.kernels_db.tensor_core_gemm import (
    FAMILIES, LOWP_CALIBRATION_PATH, ShapeTable, formula_ns, precision_peak_flops_per_s,
)

FIT_ROWS = 6000
FIT_SEED = 0
MEMORY_BOUND_MAX_M = 4
MEMORY_BOUND_MIN_BYTES = 64e6


def measured_mem_efficiency(table: GemmTable, device_name: str, precision: str) -> float:
    """Median achieved share of datasheet bandwidth of the weight-streaming rows (step 1)."""
    family = FAMILIES[precision]
    weight_bytes = family.in_itemsize * table.n * table.k
    rows = (table.m <= MEMORY_BOUND_MAX_M) & (weight_bytes >= MEMORY_BOUND_MIN_BYTES)
    if not rows.any():
        return float("nan")
    nbytes = weight_bytes[rows] + family.in_itemsize * table.m[rows] * table.k[rows] + \
        family.out_itemsize * table.m[rows] * table.n[rows]
    achieved = nbytes / (table.latency_ns[rows] * 1e-9)
    return float(min(np.median(achieved) / get_device(device_name).memory_bandwidth_bytes_per_s, 1.0))


def subsample(table: GemmTable, rows: int = FIT_ROWS, seed: int = FIT_SEED) -> GemmTable:
    if len(table) <= rows:
        return table
    index = np.sort(np.random.default_rng(seed).choice(len(table), rows, replace=False))
    return table.take(index)


def fit_device_gemm(table: GemmTable, device_name: str, precision: str, mem_efficiency: Optional[float] = None,
                    k_half_grid: Sequence[float] = K_HALF_GRID,
                    tile_alpha_grid: Sequence[float] = TILE_ALPHA_GRID) -> GemmParams:
    """Steps 1-2 for one device and precision."""
    device = get_device(device_name)
    if mem_efficiency is None:
        mem_efficiency = measured_mem_efficiency(table, device_name, precision)
    fit = subsample(table)
    return fit_gemm_arrays(np.ones_like(fit.m), fit.m, fit.n, fit.k, fit.latency_ns, device, mem_efficiency,
                           k_half_grid, tile_alpha_grid,
                           peak_flops_per_s=precision_peak_flops_per_s(device, precision),
                           family=FAMILIES[precision])


def generic_params(per_device: Sequence[GemmParams]) -> GemmParams:
    """Step 3: the device-independent parameters of one precision."""
    return GemmParams(
        e_max=float(np.exp(np.median(np.log([p.e_max for p in per_device])))),
        k_half=float(np.median([p.k_half for p in per_device])),
        tile_alpha=float(np.median([p.tile_alpha for p in per_device])),
        floor_ns=float(np.median([p.floor_ns for p in per_device])),
        mem_efficiency=float(np.median([p.mem_efficiency for p in per_device])),
    )


TABLE_DECIMALS = 4


def shape_table(table: GemmTable, device_name: str, precision: str, params: GemmParams) -> ShapeTable:
    """Step 3: the formula's log error on the measured grid (``m`` at powers of two)."""
    on_grid = np.isclose(np.log2(table.m), np.round(np.log2(table.m)))
    t = table.take(np.flatnonzero(on_grid))
    axes = [np.unique(np.log2(x)) for x in (t.m, t.n, t.k)]
    grid = np.full([len(a) for a in axes], np.nan)
    ratio = np.log(t.latency_ns / formula_ns(precision, 1, t.m, t.n, t.k, get_device(device_name), params))
    idx = [np.searchsorted(a, np.log2(x)) for a, x in zip(axes, (t.m, t.n, t.k))]
    grid[idx[0], idx[1], idx[2]] = ratio
    grid = _fill_along_m(grid)
    return ShapeTable(*(tuple(float(v) for v in a) for a in axes), _rounded(grid))


def _fill_along_m(grid: np.ndarray) -> np.ndarray:
    """Missing points take the value of the nearest measured ``m`` at the same (n, k); else 0 (the formula)."""
    out = grid.copy()
    for j in range(grid.shape[1]):
        for l in range(grid.shape[2]):
            col = grid[:, j, l]
            have = np.flatnonzero(~np.isnan(col))
            if len(have) == 0:
                out[:, j, l] = 0.0
            else:
                nearest = have[np.abs(np.arange(len(col))[:, None] - have[None, :]).argmin(axis=1)]
                out[:, j, l] = col[nearest]
    return out


def _rounded(grid: np.ndarray) -> tuple:
    return tuple(tuple(tuple(round(float(v), TABLE_DECIMALS) for v in row) for row in plane) for plane in grid)


def generic_table(tables: Sequence[ShapeTable]) -> ShapeTable:
    """Step 4: the median log ratio of ``tables`` on the union of their grids (each clamped at its edges)."""
    axes = [sorted({v for t in tables for v in getattr(t, name)}) for name in ("log2_m", "log2_n", "log2_k")]
    mesh = np.meshgrid(*[2.0 ** np.asarray(a) for a in axes], indexing="ij")
    logs = np.stack([np.log(t.correction(*mesh)) for t in tables])
    return ShapeTable(*(tuple(float(v) for v in a) for a in axes), _rounded(np.median(logs, axis=0)))


def fit_lowp_gemms(tables: Mapping[tuple[str, str], GemmTable]) -> dict:
    """Per-device parameters and shape tables, generic parameters and tables, of every precision."""
    devices: dict[str, dict[str, GemmParams]] = {}
    shape: dict[str, dict[str, ShapeTable]] = {}
    for (name, precision), table in sorted(tables.items()):
        params = fit_device_gemm(table, name, precision)
        devices.setdefault(name, {})[precision] = params
        shape.setdefault(name, {})[precision] = shape_table(table, name, precision, params)
    return calibration_json(devices, shape)


def calibration_json(devices: Mapping[str, Mapping[str, GemmParams]],
                     shape: Mapping[str, Mapping[str, ShapeTable]]) -> dict:
    """The JSON section of a set of fitted devices (generic parts derived from them)."""
    precisions = sorted({p for d in devices.values() for p in d})
    generic = {p: generic_params([d[p] for d in devices.values() if p in d]) for p in precisions}
    generic_tables = {p: generic_table([d[p] for d in shape.values() if p in d]) for p in precisions}
    return {
        "devices": {name: {p: asdict(v) for p, v in d.items()} for name, d in devices.items()},
        "generic": {p: asdict(v) for p, v in generic.items()},
        "tables": {name: {p: asdict(v) for p, v in d.items()} for name, d in shape.items()},
        "generic_tables": {p: asdict(v) for p, v in generic_tables.items()},
        "capability": {name: list(get_device(name).compute_capability) for name in devices},
    }


def write_lowp_calibration(doc: Mapping, path: Path = LOWP_CALIBRATION_PATH) -> None:
    out = {
        "about": ("Fitted parameters of kernels_db/tensor_core_gemm.py and kernels_db/attention_model.py, "
                  "regenerated by `python -m boomfx.kernels_db.fit_lowp_model`. GEMM e_max is a fraction of the "
                  "dense datasheet peak of the precision (boomfx/devices.py); floor_ns excludes host dispatch "
                  "(the source timed inside CUDA graphs)."),
        "source": SOURCE,
        **doc,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(out, fh, sort_keys=True, separators=(",", ":"))   # compact: the shape tables are large
        fh.write("\n")


def fit_all(data_dir: Optional[Path | str] = None) -> dict:
    from boomfx.kernels_db.attention_model import fit_attention
    return {"gemm": fit_lowp_gemms(load_gemms(data_dir)), "attention": fit_attention(data_dir)}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_LOWP_DIR))
    parser.add_argument("--out", default=str(LOWP_CALIBRATION_PATH))
    args = parser.parse_args(argv)
    doc = fit_all(args.data)
    write_lowp_calibration(doc, Path(args.out))
    print(f"wrote {args.out}: {', '.join(sorted(doc['gemm']['devices']))}")


if __name__ == "__main__":
    main()
