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
  values (geometric median for efficiencies), applied to the target's datasheet peak, bandwidth and SMs;
  memory-bound efficiencies per DRAM class (HBM / GDDR) when leave-one-device-out says the class
  predicts better than the overall median (``_memory_by_class``).
  GEMM ``e_max`` instead comes from a log-linear trend in datasheet features (board power per fp32 TFLOP,
  bytes per FLOP; ``BOARD_POWER_W`` holds the TDPs with sources), fitted on each device's e_max refitted
  with the generic shape parameters, pooled over linear/bmm with a per-family offset; the feature set is
  chosen by leave-one-device-out error (``_e_max_trend``).
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

from boomfx.core.devices import DeviceSpec, get_device
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


def fit_gemm(rows: Sequence[PublicKernelRow], device: DeviceSpec, mem_efficiency: float,
             k_half_grid: Sequence[float] = K_HALF_GRID, tile_alpha_grid: Sequence[float] = TILE_ALPHA_GRID) -> GemmParams:
    """Fit one device's GEMM parameters on ``rows`` (all the same device and family)."""
    b, m, n, k, t = _gemm_arrays(rows)
    peak = device.peak_flops_per_s[torch.float32]
    bw = device.memory_bandwidth_bytes_per_s
    best: Optional[tuple[float, GemmParams]] = None
    for k_half in k_half_grid:
        for alpha in tile_alpha_grid:
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
    memory_by_class, memory_class_scores = _memory_by_class({n: d["memory"] for n, d in devices.items()})
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
    generic["memory_class_loo_mean_abs_log_error"] = memory_class_scores
    generic["memory_by_class"] = {cls: _params_to_json({"memory": params})["memory"]
                                  for cls, params in memory_by_class.items()}
    # e_max of each device refitted with the generic shape parameters: comparable across devices.
    shared: dict[str, dict[str, float]] = defaultdict(dict)
    for name, ops in sorted(by_device.items()):
        for op, params in devices[name]["gemm"].items():
            g = generic_gemm[op]
            shared[name][op] = fit_gemm(ops[op], get_device(name), params.mem_efficiency,
                                        k_half_grid=(g.k_half,), tile_alpha_grid=(g.tile_alpha,)).e_max
    power = {name: watts for name, (watts, _) in BOARD_POWER_W.items()}
    features = {name: device_features(get_device(name), power) for name in shared}
    generic["gemm_e_max_trend"] = _e_max_trend(shared, features)
    generic["gemm_e_max_shared"] = {n: dict(v) for n, v in shared.items()}
    generic["board_power_w"] = power
    generic["board_power_source"] = {name: src for name, (_, src) in BOARD_POWER_W.items()}
    return {"devices": {name: _params_to_json(d) for name, d in devices.items()}, "generic": generic}


# Datasheet board power (TDP, W) of the GPUs in boomfx/core/devices.py: data with its source, written into the
# calibration JSON so the model can place a GPU without measurements on the e_max trend.
BOARD_POWER_W: Mapping[str, tuple[float, str]] = {
    "v100-32gb": (300.0, "NVIDIA V100 datasheet: SXM2 300 W"),
    "v100-pcie-32gb": (250.0, "NVIDIA V100 datasheet: PCIe 250 W"),
    "p100": (250.0, "NVIDIA Tesla P100 datasheet: PCIe 250 W"),
    "p4": (75.0, "NVIDIA Tesla P4 datasheet: 50 W / 75 W configurable (75 W default)"),
    "t4": (70.0, "NVIDIA T4 datasheet: 70 W"),
    "a10": (150.0, "NVIDIA A10 datasheet: 150 W"),
    "l4": (72.0, "NVIDIA L4 datasheet: 72 W"),
    "a100-40gb": (400.0, "NVIDIA A100 datasheet: SXM4 400 W"),
    "a100-80gb": (400.0, "NVIDIA A100 datasheet: SXM4 400 W"),
    "a100-pcie-40gb": (250.0, "NVIDIA A100 PCIe 40 GB product brief: 250 W"),
    "a100-pcie-80gb": (300.0, "NVIDIA A100 datasheet: 80 GB PCIe 300 W"),
    "h100-sxm": (700.0, "NVIDIA H100 datasheet: SXM up to 700 W"),
    "h100-pcie": (350.0, "NVIDIA H100 datasheet: PCIe 300-350 W (350 W)"),
    "h200": (700.0, "NVIDIA H200 datasheet: SXM up to 700 W"),
    "rtx-3090": (350.0, "NVIDIA GeForce RTX 3090 specifications: 350 W total graphics power"),
    "rtx-4090": (450.0, "NVIDIA GeForce RTX 4090 specifications: 450 W total graphics power"),
}


def device_features(device: DeviceSpec, board_power_w: Mapping[str, float]) -> dict[str, float]:
    return core.device_features(device.peak_flops_per_s[torch.float32], device.memory_bandwidth_bytes_per_s,
                                board_power_w.get(device.name))


def _loglinear_fit(names: Sequence[str], feats: Sequence[str], y: np.ndarray,
                   features: Mapping[str, Mapping[str, float]]) -> dict:
    """Least squares ``y = intercept + sum coef * log(feature)`` over devices ``names``; () = the median."""
    if not feats:
        return {"features": [], "coef": [], "intercept": float(np.median(y)), "e_max_max": float(np.exp(y.max()))}
    x = np.array([[1.0] + [np.log(features[n][f]) for f in feats] for n in names])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return {"features": list(feats), "coef": [float(c) for c in coef[1:]], "intercept": float(coef[0]),
            "e_max_max": float(np.exp(y.max()))}


def _e_max_trend(shared: Mapping[str, Mapping[str, float]], features: Mapping[str, Mapping[str, float]]) -> dict:
    """Per GEMM family: ``log(e_max)`` log-linear in datasheet features, the feature set chosen by leave-one-out.

    ``shared[device][family]`` is e_max fitted with the generic shape parameters (so the values are
    comparable across devices). Each candidate set in ``core.E_MAX_FEATURE_SETS`` is scored by the mean
    |log error| of e_max when each device is predicted from the others (a mean, not a median, so that one
    far-off device such as the 72 W L4 counts); the best is kept, its score and the others' with it.
    Why: a GPU with no measurements gets e_max from its datasheet, and which datasheet figures track it
    is a question for the data. A set needs more devices than parameters + 2, else it is not a candidate.
    """
    out: dict = {}
    families = sorted({f for d in shared.values() for f in d})
    # Pool the families: the device effect (clock under load, power) is common to linear and bmm, and bmm
    # pins it better; each family keeps its own offset from the device mean.
    names = [n for n in shared if all(f in shared[n] for f in families)]
    if not names:
        return out
    device_mean = {n: float(np.mean([np.log(shared[n][f]) for f in families])) for n in names}
    offsets = {f: float(np.median([np.log(shared[n][f]) - device_mean[n] for n in names])) for f in families}
    scores: dict[str, float] = {}
    fits: dict[str, dict] = {}
    for feats in core.E_MAX_FEATURE_SETS:
        usable = [n for n in names if all(f in features[n] for f in feats)]
        if len(usable) < len(feats) + 3:
            continue
        errs = []
        for held in usable:
            rest = [n for n in usable if n != held]
            for f in families:
                y = np.array([device_mean[n] + offsets[f] for n in rest])
                fit = _loglinear_fit(rest, feats, y, features)
                fit["e_max_max"] = float(max(shared[n][f] for n in rest))
                errs.append(abs(core.trend_log_e_max(fit, features[held]) - np.log(shared[held][f])))
        key = "+".join(feats) or "median"
        scores[key] = float(np.mean(errs))
        fits[key] = {f: {**_loglinear_fit(usable, feats, np.array([device_mean[n] + offsets[f] for n in usable]),
                                         features),
                         "e_max_max": float(max(shared[n][f] for n in usable)), "devices": sorted(usable)}
                     for f in families}
    if not scores:
        return out
    best = min(scores, key=scores.get)
    return {f: {**fits[best][f], "loo_mean_abs_log_error": scores} for f in families}


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


def _memory_by_class(per_device: Mapping[str, Mapping[str, MemoryParams]]
                     ) -> tuple[dict[str, dict[str, MemoryParams]], dict[str, dict[str, float]]]:
    """Generic memory-bound parameters per DRAM class (``DeviceSpec.memory_class``), where they help.

    Scored as the e_max trend is: for each op class, each device's inverse efficiencies are predicted from
    the other devices, by the median of all of them or of those of its own DRAM class (the overall median
    when fewer than two others share it); an op class keeps per-DRAM-class parameters only when their
    leave-one-device-out mean |log error| is smaller. Why: HBM and GDDR boards reach different shares of
    their datasheet bandwidth on streaming kernels, and a GPU with no measurements has only its datasheet;
    whether that also holds for normalisations is a question for the data.
    """
    dram = {name: get_device(name).memory_class for name in per_device}
    kept: dict[str, dict[str, MemoryParams]] = defaultdict(dict)
    scores: dict[str, dict[str, float]] = {}
    for op in sorted({op for m in per_device.values() for op in m}):
        have = {n: np.log(np.asarray(m[op].inv_efficiency)) for n, m in per_device.items() if op in m}
        if len(have) < 3:
            continue
        errors: dict[str, list[float]] = {"median": [], "memory_class": []}
        for held, actual in have.items():
            rest = {n: v for n, v in have.items() if n != held}
            same = [v for n, v in rest.items() if dram[n] and dram[n] == dram[held]]
            overall = np.median(np.stack(list(rest.values())), axis=0)
            own = np.median(np.stack(same), axis=0) if len(same) >= 2 else overall
            errors["median"].append(float(np.mean(np.abs(overall - actual))))
            errors["memory_class"].append(float(np.mean(np.abs(own - actual))))
        scores[op] = {scheme: float(np.mean(e)) for scheme, e in errors.items()}
        if scores[op]["memory_class"] < scores[op]["median"]:
            for cls in sorted({c for c in dram.values() if c}):
                members = [{op: per_device[n][op]} for n in per_device if dram[n] == cls and op in per_device[n]]
                if members:
                    kept[cls][op] = _generic_memory(members)[op]
    return dict(kept), scores


def _params_to_json(d: Mapping[str, Mapping[str, object]]) -> dict:
    return {section: {key: asdict(value) for key, value in entries.items()} for section, entries in d.items()}


def write_calibration(calibration: Mapping, path: Path = CALIBRATION_PATH) -> None:
    """Write the fitted parameters with their provenance, so the JSON says where its numbers came from."""
    doc = {
        "about": ("Fitted parameters of kernels_db/gpu_model.py, regenerated by "
                  "`python -m boomfx.kernels_db.fit_gpu_model`. Units are in the names (_ns); efficiencies are "
                  "fractions of the boomfx/core/devices.py datasheet figures; inv_efficiency = datasheet/achieved "
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
