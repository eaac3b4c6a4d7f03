"""Fit the GPU kernel model's parameters on public measurements and write them as data.

Run ``python -m boomfx.kernels_db.fit_gpu_model [--data DIR] [--out FILE]`` to regenerate
``kernels_db/data/gpu_calibration.json`` from the NeuSight CSVs (about half a minute on 2 cores).

Fitting uses numpy only:

* GEMM (per device and family, ``linear`` / ``bmm``): a grid search over the shape parameters
  (``k_half``, ``tile_alpha``); for each grid point the scale (``1/e_max``) and ``floor_ns`` come from a
  linear least-squares fit of ``t = floor + s * W`` in *relative* error (rows divided by the measured
  time), iterated because the DRAM bound does not scale with ``e_max``. The grid point with the smallest
  mean absolute log error wins.
* Memory-bound classes: ``t = floor + bytes/bandwidth * sum_j w_j(row) c_j`` is linear in
  ``(floor, c_j)``, solved by relative least squares; ``c_j`` (inverse efficiency) clipped to >= 1.
* Generic (device-independent) parameters, for GPUs with no measurements: the median of the per-device
  values (geometric median for efficiencies), applied to the target's datasheet peak, bandwidth and SMs.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from boomfx.devices import DeviceSpec, get_device
from boomfx.kernels_db import gpu_model_core as core
from boomfx.kernels_db.public_data import (
    BINARY_OPS, DEFAULT_DATA_DIR, ELEMENTWISE_OPS, MATMUL_OPS, NORM_OPS, PublicKernelRow, load_public_rows,
)
from boomfx.kernels_db.gpu_model_core import GemmParams, MemoryParams

CALIBRATION_PATH = Path(__file__).parent / "data" / "gpu_calibration.json"

K_HALF_GRID: tuple[float, ...] = (0.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
TILE_ALPHA_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 1.5)
NORM_KNOTS_LOG2: tuple[float, ...] = tuple(float(x) for x in range(9, 15))   # rows of 512 .. 16384
ELEMENTWISE_KNOTS_LOG2: tuple[float, ...] = (10.0,)
GENERIC_MEM_EFFICIENCY = 0.8   # fallback only when a device has no elementwise rows and no generic exists


# ---------------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------------

def memory_bytes(row: PublicKernelRow) -> float:
    """Bytes a memory-bound public row moves (fp32): inputs read once, outputs written once.

    binary: 2 reads + 1 write; scalar/unary: 1 read + 1 write; softmax: 1 + 1; layer norm: 1 + 1 plus
    weight and bias (h each) and mean/rstd (b each).
    """
    elems = row.b * row.h
    if row.op in BINARY_OPS:
        return 3.0 * elems * 4
    if row.op == "layer_norm":
        return (2.0 * elems + 2 * row.h + 2 * row.b) * 4
    return 2.0 * elems * 4


def _gemm_arrays(rows: Sequence[PublicKernelRow]) -> tuple[np.ndarray, ...]:
    b = np.array([r.b for r in rows], dtype=np.float64)
    m = np.array([r.m for r in rows], dtype=np.float64)
    n = np.array([r.n for r in rows], dtype=np.float64)
    k = np.array([r.k for r in rows], dtype=np.float64)
    t = np.array([r.latency_ns for r in rows], dtype=np.float64)
    return b, m, n, k, t


# ---------------------------------------------------------------------------------------------------
# GEMM fit
# ---------------------------------------------------------------------------------------------------

def _relative_lstsq(columns: Sequence[np.ndarray], target: np.ndarray) -> np.ndarray:
    """argmin_x sum((A x - t) / t)^2, the error metric the benchmark reports (relative, not absolute)."""
    a = np.stack([c / target for c in columns], axis=1)
    x, *_ = np.linalg.lstsq(a, np.ones_like(target), rcond=None)
    return x


def fit_gemm(rows: Sequence[PublicKernelRow], device: DeviceSpec, mem_efficiency: float) -> GemmParams:
    """Fit one device's GEMM parameters on ``rows`` (all the same device and family)."""
    b, m, n, k, t = _gemm_arrays(rows)
    peak = device.peak_flops_per_s[torch.float32]
    bw = device.memory_bandwidth_bytes_per_s
    best: Optional[tuple[float, GemmParams]] = None
    for k_half in K_HALF_GRID:
        for alpha in TILE_ALPHA_GRID:
            params = GemmParams(0.7, k_half, alpha, 0.0, mem_efficiency)
            for _ in range(3):
                work = core.gemm_time_ns(b, m, n, k, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw,
                                         sm_count=device.sm_count, params=params, include_floor=False)
                floor, scale = _relative_lstsq([np.ones_like(t), work], t)
                floor = max(float(floor), 0.0)
                if scale <= 0:
                    break
                params = GemmParams(params.e_max / scale, k_half, alpha, floor, mem_efficiency).clipped()
            pred = core.gemm_time_ns(b, m, n, k, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw,
                                     sm_count=device.sm_count, params=params)
            loss = float(np.mean(np.abs(np.log(pred / t))))
            if best is None or loss < best[0]:
                best = (loss, params)
    assert best is not None
    return best[1]


# ---------------------------------------------------------------------------------------------------
# Memory-bound fit
# ---------------------------------------------------------------------------------------------------

def fit_memory(rows: Sequence[PublicKernelRow], device: DeviceSpec, knots: Sequence[float]) -> MemoryParams:
    """Fit ``floor_ns`` and inverse efficiencies at ``knots`` (log2 row length) for one device and class."""
    nbytes = np.array([memory_bytes(r) for r in rows], dtype=np.float64)
    row_len = np.array([r.h for r in rows], dtype=np.float64)
    t = np.array([r.latency_ns for r in rows], dtype=np.float64)
    basis = core.hat_basis(np.log2(row_len), knots)
    stream_ns = nbytes / device.memory_bandwidth_bytes_per_s * 1e9
    used = basis.sum(axis=0) > 0
    cols = [np.ones_like(t)] + [basis[:, j] * stream_ns for j in range(len(knots)) if used[j]]
    x = _relative_lstsq(cols, t)
    floor = max(float(x[0]), 0.0)
    inv = np.full(len(knots), np.nan)
    inv[used] = x[1:]
    inv = _fill_missing(inv)
    inv = np.maximum(inv, 1.0)
    # H * inv(H) must not fall between neighbouring knots (time non-decreasing in row length).
    for j in range(1, len(inv)):
        ratio = 2.0 ** (knots[j] - knots[j - 1])
        inv[j] = max(inv[j], inv[j - 1] / ratio)
    return MemoryParams(floor, tuple(float(v) for v in knots), tuple(float(v) for v in inv))


def _fill_missing(values: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(~np.isnan(values))
    if len(idx) == 0:
        return np.ones_like(values)
    return np.interp(np.arange(len(values)), idx, values[idx])


# ---------------------------------------------------------------------------------------------------
# Whole calibration
# ---------------------------------------------------------------------------------------------------

def fit_calibration(rows: Iterable[PublicKernelRow]) -> dict:
    """Per-device and generic parameters from ``rows`` (any subset: the benchmark fits on its splits)."""
    by_device: dict[str, dict[str, list[PublicKernelRow]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_device[r.device][r.op].append(r)
        if r.op in ELEMENTWISE_OPS:
            by_device[r.device]["elementwise"].append(r)

    devices: dict[str, dict] = {}
    for name, ops in sorted(by_device.items()):
        spec = get_device(name)
        memory: dict[str, MemoryParams] = {}
        for op, op_rows in ops.items():
            if op in MATMUL_OPS or len(op_rows) < 4:
                continue
            knots = NORM_KNOTS_LOG2 if op in NORM_OPS else ELEMENTWISE_KNOTS_LOG2
            memory[op] = fit_memory(op_rows, spec, knots)
        devices[name] = {"memory": memory}
    generic_memory = _generic_memory([d["memory"] for d in devices.values()])
    for name, ops in sorted(by_device.items()):
        spec = get_device(name)
        elementwise = devices[name]["memory"].get("elementwise", generic_memory.get("elementwise"))
        mem_eff = 1.0 / elementwise.inv_efficiency[0] if elementwise else GENERIC_MEM_EFFICIENCY
        gemm: dict[str, GemmParams] = {}
        for op in sorted(MATMUL_OPS):
            if len(ops.get(op, [])) >= 8:
                gemm[op] = fit_gemm(ops[op], spec, mem_eff)
        devices[name]["gemm"] = gemm
    generic_gemm = _generic_gemm([d["gemm"] for d in devices.values()])
    generic = _params_to_json({"gemm": generic_gemm, "memory": generic_memory})
    generic["gemm_e_max_vs_balance"] = _e_max_vs_balance({n: d["gemm"] for n, d in devices.items()})
    return {"devices": {name: _params_to_json(d) for name, d in devices.items()}, "generic": generic}


def _e_max_vs_balance(per_device: Mapping[str, Mapping[str, GemmParams]]) -> dict:
    """log(e_max) = intercept + slope * log(bandwidth / fp32 peak), per GEMM family, across devices.

    Why: SIMT sgemm on GPUs with few bytes per FLOP (L4, T4: small power budget and bandwidth) reaches a
    lower fraction of peak; the datasheet balance is the only spec that tracks this. Clipped at predict
    time to the range of fitted e_max values. Needs >= 3 devices, else no entry (plain median used).
    """
    out: dict = {}
    families = sorted({f for d in per_device.values() for f in d})
    for fam in families:
        pts = [(np.log(_balance(get_device(n))), np.log(d[fam].e_max)) for n, d in per_device.items() if fam in d]
        if len(pts) < 3:
            continue
        x, y = np.array(pts).T
        slope, intercept = np.polyfit(x, y, 1)
        out[fam] = {"intercept": float(intercept), "slope": float(slope),
                    "e_max_min": float(np.exp(y.min())), "e_max_max": float(np.exp(y.max()))}
    return out


def _balance(device: DeviceSpec) -> float:
    """Datasheet bytes per FLOP (fp32)."""
    return device.memory_bandwidth_bytes_per_s / device.peak_flops_per_s[torch.float32]


def _geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.median(np.log(np.asarray(values, dtype=np.float64)))))


def _generic_gemm(per_device: Sequence[Mapping[str, GemmParams]]) -> dict[str, GemmParams]:
    out: dict[str, GemmParams] = {}
    families = sorted({f for d in per_device for f in d})
    for fam in families:
        ps = [d[fam] for d in per_device if fam in d]
        out[fam] = GemmParams(
            e_max=_geomean([p.e_max for p in ps]),
            k_half=float(np.median([p.k_half for p in ps])),
            tile_alpha=float(np.median([p.tile_alpha for p in ps])),
            floor_ns=float(np.median([p.floor_ns for p in ps])),
            mem_efficiency=float(np.median([p.mem_efficiency for p in ps])),
        )
    return out


def _generic_memory(per_device: Sequence[Mapping[str, MemoryParams]]) -> dict[str, MemoryParams]:
    out: dict[str, MemoryParams] = {}
    classes = sorted({c for d in per_device for c in d})
    for cls in classes:
        ps = [d[cls] for d in per_device if cls in d]
        inv = np.exp(np.median(np.log(np.array([p.inv_efficiency for p in ps])), axis=0))
        out[cls] = MemoryParams(float(np.median([p.floor_ns for p in ps])), ps[0].log2_row_knots,
                                tuple(float(v) for v in inv))
    return out


def _params_to_json(d: Mapping[str, Mapping[str, object]]) -> dict:
    return {section: {key: asdict(value) for key, value in entries.items()} for section, entries in d.items()}


def write_calibration(calibration: Mapping, path: Path = CALIBRATION_PATH) -> None:
    """Write the fitted parameters with their provenance, so the JSON says where its numbers came from."""
    doc = {
        "about": ("Fitted parameters of kernels_db/gpu_model.py, regenerated by "
                  "`python -m boomfx.kernels_db.fit_gpu_model`. Units are in the names (_ns); efficiencies are "
                  "fractions of the boomfx/devices.py datasheet figures; inv_efficiency = datasheet/achieved "
                  "bandwidth at row length 2**log2_row_knots. floor_ns includes torch 2.1 eager host dispatch, "
                  "since the source timed each op alone with CUDA events."),
        "source": "NeuSight (ASPLOS'25) public data: fp32, TF32 off, torch 2.1.0, CUDA 12.1",
        **calibration,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--out", default=str(CALIBRATION_PATH))
    args = parser.parse_args(argv)
    calibration = fit_calibration(load_public_rows(args.data))
    write_calibration(calibration, Path(args.out))
    print(f"wrote {args.out}: {', '.join(sorted(calibration['devices']))}")


if __name__ == "__main__":
    main()
