"""Held-out accuracy of the calibrated GPU kernel model against datasheet rooflines, on public measurements.

One command (about a minute on 2 CPU cores)::

    python benchmarks/gpu_heldout.py [--data DIR] [--out-dir benchmarks/results]

Three protocols, each fitting only on data it is allowed to see:

(a) held-out shapes: per GPU and op, a random 20% of shapes (seed 0) is held out; the model is fitted on
    the other 80% and predicts the held-out rows with that GPU's own parameters.
(b) held-out GPU: for each GPU, fit on the other 7 and predict it from its datasheet specs with the
    generic (device-independent) parameters.
(c) transfer: for a source -> target pair, ``transfer_ns`` scales each source measurement by
    model(target)/model(source) with the target held out of the fit (as in b), on shapes measured on both.

Baselines: ``roofline`` = max(flops/fp32 peak, bytes/bandwidth) (datasheet, no efficiency, no floor);
``pytorch`` = torch.utils._runtime_estimation's rule (FLOPs/2 at 75% of peak vs bytes/bandwidth);
for (c) also ``roofline_transfer`` = source measurement * roofline(target)/roofline(source).
Error = |predicted/measured - 1| in percent; medians and p90 per GPU and op class.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from boomfx.core.devices import DeviceSpec, get_device
from boomfx.kernels_db import gpu_model_core as core
from boomfx.kernels_db.fit_gpu_model import fit_calibration, memory_bytes
from boomfx.kernels_db.gpu_model import GpuKernelModel
from boomfx.kernels_db.public_data import DEFAULT_DATA_DIR, ELEMENTWISE_OPS, PublicKernelRow, load_public_rows

HOLDOUT_FRACTION = 0.2
SEED = 0
TRANSFER_PAIRS: tuple[tuple[str, str], ...] = (
    ("a100-pcie-40gb", "h100-sxm"), ("v100-pcie-32gb", "a100-pcie-40gb"), ("t4", "l4"),
    ("a100-pcie-80gb", "a100-pcie-40gb"), ("p100", "v100-pcie-32gb"),
)
METHODS = ("model", "roofline", "pytorch")


def op_class(row: PublicKernelRow) -> str:
    return "elementwise" if row.op in ELEMENTWISE_OPS else row.op


# ---------------------------------------------------------------------------------------------------
# Vectorised predictions for many rows (same formulas as GpuKernelModel.predict_ns; a test checks it)
# ---------------------------------------------------------------------------------------------------

def predict_rows(model: GpuKernelModel, rows: Sequence[PublicKernelRow], device: DeviceSpec) -> np.ndarray:
    out = np.empty(len(rows))
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[r.op].append(i)
    peak = device.peak_flops_per_s[torch.float32]
    bw = device.memory_bandwidth_bytes_per_s
    for op, idx in groups.items():
        sel = [rows[i] for i in idx]
        if op in ("linear", "bmm"):
            params = model.gemm_params(op, device)
            b, m, n, k = (np.array([getattr(r, a) for r in sel], dtype=np.float64) for a in "bmnk")
            out[idx] = core.gemm_time_ns(b, m, n, k, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw,
                                         sm_count=device.sm_count, params=params)
        else:
            params = model.memory_params(op, device)
            nbytes = np.array([memory_bytes(r) for r in sel])
            h = np.array([r.h for r in sel], dtype=np.float64)
            out[idx] = core.memory_time_ns(nbytes, h, bandwidth_bytes_per_s=bw, params=params)
    return out


def flops_bytes_rows(rows: Sequence[PublicKernelRow]) -> tuple[np.ndarray, np.ndarray]:
    flops = np.array([2.0 * r.b * r.m * r.n * r.k if r.is_matmul else 0.0 for r in rows])
    nbytes = np.array([4.0 * r.b * (r.m * r.k + r.k * r.n + r.m * r.n) + (4.0 * r.n if r.op == "linear" else 0.0)
                       if r.is_matmul else memory_bytes(r) for r in rows])
    return flops, nbytes


def roofline_rows(rows: Sequence[PublicKernelRow], device: DeviceSpec) -> np.ndarray:
    flops, nbytes = flops_bytes_rows(rows)
    return np.maximum(flops / device.peak_flops_per_s[torch.float32], nbytes / device.memory_bandwidth_bytes_per_s) * 1e9


def pytorch_rows(rows: Sequence[PublicKernelRow], device: DeviceSpec) -> np.ndarray:
    flops, nbytes = flops_bytes_rows(rows)
    compute = flops / 2.0 / (0.75 * device.peak_flops_per_s[torch.float32])
    return np.maximum(compute, nbytes / device.memory_bandwidth_bytes_per_s) * 1e9


# ---------------------------------------------------------------------------------------------------
# Error tables
# ---------------------------------------------------------------------------------------------------

def _stats(pred: np.ndarray, meas: np.ndarray) -> dict:
    ape = np.abs(pred / meas - 1.0) * 100.0
    return {"n": int(len(ape)), "median_ape": round(float(np.median(ape)), 2),
            "p90_ape": round(float(np.percentile(ape, 90)), 2)}


def error_table(rows: Sequence[PublicKernelRow], preds: Mapping[str, np.ndarray]) -> dict:
    """{device: {op_class: {method: stats}}} plus an ``all`` op class per device."""
    meas = np.array([r.latency_ns for r in rows])
    keys = [(r.device, op_class(r)) for r in rows]
    table: dict = defaultdict(dict)
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        groups[key].append(i)
        groups[(key[0], "all")].append(i)
    for (dev, cls), idx in sorted(groups.items()):
        table[dev][cls] = {m: _stats(p[idx], meas[idx]) for m, p in preds.items()}
    return dict(table)


def split_shapes(rows: Sequence[PublicKernelRow]) -> tuple[list[PublicKernelRow], list[PublicKernelRow]]:
    """Hold out a random 20% of distinct shapes per (device, op)."""
    rng = random.Random(SEED)
    keys: dict[tuple[str, str], list[tuple[int, ...]]] = defaultdict(list)
    for r in rows:
        keys[(r.device, r.op)].append(r.shape_key)
    held: set = set()
    for group, shapes in sorted(keys.items()):
        uniq = sorted(set(shapes))
        rng.shuffle(uniq)
        held.update((group, s) for s in uniq[: max(1, int(round(HOLDOUT_FRACTION * len(uniq))))])
    train = [r for r in rows if ((r.device, r.op), r.shape_key) not in held]
    test = [r for r in rows if ((r.device, r.op), r.shape_key) in held]
    return train, test


def _predict_all(rows: Sequence[PublicKernelRow], model_for: Callable[[str], GpuKernelModel]) -> dict:
    by_dev: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_dev[r.device].append(i)
    preds = {m: np.empty(len(rows)) for m in METHODS}
    for dev, idx in by_dev.items():
        spec = get_device(dev)
        sel = [rows[i] for i in idx]
        preds["model"][idx] = predict_rows(model_for(dev), sel, spec)
        preds["roofline"][idx] = roofline_rows(sel, spec)
        preds["pytorch"][idx] = pytorch_rows(sel, spec)
    return preds


def heldout_shapes(rows: Sequence[PublicKernelRow]) -> dict:
    train, test = split_shapes(rows)
    model = GpuKernelModel.from_json(fit_calibration(train))
    return error_table(test, _predict_all(test, lambda dev: model))


def heldout_gpus(rows: Sequence[PublicKernelRow]) -> tuple[dict, dict[str, GpuKernelModel]]:
    devices = sorted({r.device for r in rows})
    models = {d: GpuKernelModel.from_json(fit_calibration([r for r in rows if r.device != d])) for d in devices}
    return error_table(rows, _predict_all(rows, lambda dev: models[dev])), models


def transfer(rows: Sequence[PublicKernelRow], loo_models: Mapping[str, GpuKernelModel]) -> dict:
    """Source measurement -> target via the model fitted without the target (target uses generic params)."""
    result: dict = {}
    by_key = {(r.device, r.op, r.shape_key): r for r in rows}
    for src, dst in TRANSFER_PAIRS:
        pairs = [(by_key[(src, r.op, r.shape_key)], r) for r in rows
                 if r.device == dst and (src, r.op, r.shape_key) in by_key]
        if not pairs:
            continue
        s_rows = [p[0] for p in pairs]
        t_rows = [p[1] for p in pairs]
        s_spec, t_spec = get_device(src), get_device(dst)
        model = loo_models[dst]
        s_meas = np.array([r.latency_ns for r in s_rows])
        preds = {
            "model_transfer": s_meas * predict_rows(model, t_rows, t_spec) / predict_rows(model, s_rows, s_spec),
            "roofline_transfer": s_meas * roofline_rows(t_rows, t_spec) / roofline_rows(s_rows, s_spec),
            "roofline": roofline_rows(t_rows, t_spec),
            "pytorch": pytorch_rows(t_rows, t_spec),
        }
        result[f"{src}->{dst}"] = error_table(t_rows, preds)[dst]
    return result


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------

def _md_table(title: str, table: Mapping[str, Mapping[str, Mapping[str, dict]]], methods: Sequence[str]) -> str:
    head = "| GPU | op | n | " + " | ".join(f"{m} med / p90 %" for m in methods) + " |"
    lines = [f"### {title}", "", head, "|" + "---|" * (3 + len(methods))]
    for dev, classes in table.items():
        for cls, stats in classes.items():
            n = next(iter(stats.values()))["n"]
            cells = " | ".join(f"{stats[m]['median_ape']:.1f} / {stats[m]['p90_ape']:.1f}" for m in methods)
            label = f"**{cls}**" if cls == "all" else cls
            lines.append(f"| {dev} | {label} | {n} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = load_public_rows(args.data)
    shapes = heldout_shapes(rows)
    gpus, loo = heldout_gpus(rows)
    trans = transfer(rows, loo)
    doc = {
        "about": __doc__.split("\n\n")[0],
        "data": "NeuSight (ASPLOS'25) public data, fp32, TF32 off, torch 2.1.0, CUDA 12.1",
        "rows": len(rows), "seed": SEED, "holdout_fraction": HOLDOUT_FRACTION,
        "runtime_s": None,
        "heldout_shapes": shapes, "heldout_gpu": gpus, "transfer": trans,
    }
    doc["runtime_s"] = round(time.perf_counter() - start, 1)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_heldout.json", "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    md = ["# GPU kernel model: held-out error on public measurements", "",
          f"Generated by `python benchmarks/gpu_heldout.py` ({len(rows)} rows, {doc['runtime_s']} s). "
          "Absolute percentage error of predicted vs measured latency; median / p90. "
          "`roofline` = max(flops/fp32 peak, bytes/bandwidth); `pytorch` = torch's RuntimeEstimator rule "
          "(FLOPs/2 at 75% peak vs bytes/bandwidth).", "",
          _md_table("(a) Held-out shapes (20% per GPU and op, fit on the rest)", shapes, METHODS),
          _md_table("(b) Held-out GPU (fit on the other 7, datasheet specs for this one)", gpus, METHODS),
          _md_table("(c) Transfer source -> target (target held out of the fit)", trans,
                    ("model_transfer", "roofline_transfer", "roofline", "pytorch"))]
    (out / "gpu_heldout.md").write_text("\n".join(md))
    print("\n".join(md))
    return doc


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
