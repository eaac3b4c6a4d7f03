"""Held-out error of the low-precision GPU kernel model (bf16/fp8 GEMMs, prefill/decode attention).

Run ``python benchmarks/gpu_lowp_heldout.py`` (about a minute); writes ``benchmarks/results/gpu_lowp_heldout.{json,md}``
next to the fp32 ``gpu_heldout.*``. Data: ``shared/data/lowp-kernel-measurements`` (aiconfigurator, vLLM).

GEMMs, per GPU and precision, absolute percentage error of predicted vs measured latency (median / p90) and
the median signed error:
  (a) held-out shapes: parameters and shape table fitted on the rows with ``m`` a power of two, scored on the
      others (``m`` = 3, 5, .., 33, 3329, ..: between the grid points, at wave boundaries);
  (b) held-out GPU: the GPU's rows dropped from the fit; it is priced as a GPU without measurements would be
      (a measured GPU of the same compute capability, else the generic parameters and median table);
  baselines: the datasheet roofline ``max(2mnk/dense peak, bytes/bandwidth)`` and the tile/wave formula
  without the shape table.
Attention (bf16 KV, each GPU's default vLLM kernel): (a) own fit, (b) held-out GPU, and the roofline.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Mapping

import numpy as np

from boomfx.core.devices import get_device
from boomfx.kernels_db import attention_model as am
from boomfx.kernels_db import fit_lowp_model as fit
from boomfx.kernels_db.lowp_data import load_attention, load_gemms
from boomfx.kernels_db.tensor_core_gemm import LowpCalibration, formula_ns, roofline_gemm_ns

RESULTS = Path(__file__).parent / "results"


def _stats(pred: np.ndarray, measured: np.ndarray) -> dict:
    err = pred / measured - 1.0
    return {"n": int(len(err)), "median_abs_pct": float(np.median(np.abs(err)) * 100),
            "p90_abs_pct": float(np.percentile(np.abs(err), 90) * 100), "median_signed_pct": float(np.median(err) * 100)}


def gemm_results() -> dict:
    tables = load_gemms()
    params, shapes = {}, {}
    for (name, prec), table in tables.items():
        params.setdefault(name, {})[prec] = p = fit.fit_device_gemm(table, name, prec)
        shapes.setdefault(name, {})[prec] = fit.shape_table(table, name, prec, p)
    out: dict = {}
    for (name, prec), table in sorted(tables.items()):
        device = get_device(name)
        row: dict = {}
        # (a) held-out shapes
        grid = np.isclose(np.log2(table.m), np.round(np.log2(table.m)))
        train, test = table.take(np.flatnonzero(grid)), table.take(np.flatnonzero(~grid))
        p_a = fit.fit_device_gemm(train, name, prec)
        cal_a = LowpCalibration.from_json({"gemm": fit.calibration_json(
            {name: {prec: p_a}}, {name: {prec: fit.shape_table(train, name, prec, p_a)}})})
        row["heldout_shapes"] = _stats(cal_a.gemm_ns(prec, 1, test.m, test.n, test.k, device), test.latency_ns)
        # (b) held-out GPU
        rest = {n: v for n, v in params.items() if n != name}
        rest_shapes = {n: v for n, v in shapes.items() if n != name}
        cal_b = LowpCalibration.from_json({"gemm": fit.calibration_json(rest, rest_shapes)})
        row["heldout_gpu"] = _stats(cal_b.gemm_ns(prec, 1, table.m, table.n, table.k, device), table.latency_ns)
        row["heldout_gpu"]["priced_from"] = cal_b.source_device(prec, device) or "generic"
        generic = cal_b.params(prec, device)
        row["heldout_gpu_formula_only"] = _stats(formula_ns(prec, 1, table.m, table.n, table.k, device, generic),
                                                 table.latency_ns)
        row["roofline"] = _stats(roofline_gemm_ns(prec, 1, table.m, table.n, table.k, device), table.latency_ns)
        out[f"{name}/{prec}"] = row
    return out


def attention_results() -> dict:
    context = load_attention("attention_context.csv")
    generation = load_attention("attention_generation.csv")
    own = {n: am.fit_device_attention(context, generation, n) for n in sorted(am.PREFILL_KERNELS)}
    out: dict = {}
    for name in sorted(own):
        device = get_device(name)
        rest = am.AttentionModel.from_json({"attention": am.curves_json({n: c for n, c in own.items() if n != name})})
        work, t = am.measured_prefill(context, name)
        kv, td = am.measured_decode(generation, name)
        roof = np.maximum(work.flops / am.bf16_peak(device), work.nbytes / device.memory_bandwidth_bytes_per_s) * 1e9
        held = rest.curves(device)
        out[name] = {
            "prefill_kernel": am.PREFILL_KERNELS[name], "decode_kernel": am.DECODE_KERNELS[name],
            "prefill_own": _stats(am.prefill_time_ns(work, device, own[name].prefill), t),
            "prefill_heldout_gpu": _stats(am.prefill_time_ns(work, device, held.prefill), t),
            "prefill_roofline": _stats(roof, t),
            "decode_own": _stats(am.decode_time_ns(kv, device, own[name].decode), td),
            "decode_heldout_gpu": _stats(am.decode_time_ns(kv, device, held.decode), td),
            "decode_roofline": _stats(kv / device.memory_bandwidth_bytes_per_s * 1e9, td),
        }
    return out


def _cell(s: Mapping) -> str:
    return f"{s['median_abs_pct']:.1f} / {s['p90_abs_pct']:.1f} ({s['median_signed_pct']:+.1f})"


def render(doc: Mapping) -> str:
    lines = ["# Low-precision GPU kernel model: held-out error on public measurements", "",
             f"Generated by `python benchmarks/gpu_lowp_heldout.py` ({doc['seconds']:.0f} s, load average "
             f"{doc['loadavg'][0]:.1f}). |error| median / p90 % (median signed %); signed > 0 = predicted slower.", "",
             "## GEMMs (bf16 cuBLAS, fp8 CUTLASS scaled_mm)", "",
             "| GPU / precision | n | held-out shapes | held-out GPU | priced from | held-out GPU, formula only | roofline |",
             "|---|---|---|---|---|---|---|"]
    for key, r in doc["gemm"].items():
        lines.append(f"| {key} | {r['heldout_gpu']['n']} | {_cell(r['heldout_shapes'])} | {_cell(r['heldout_gpu'])} | "
                     f"{r['heldout_gpu']['priced_from']} | {_cell(r['heldout_gpu_formula_only'])} | {_cell(r['roofline'])} |")
    lines += ["", "## Attention (vLLM, bf16 KV cache)", "",
              "| GPU | kernels | prefill own | prefill held-out GPU | prefill roofline | decode own | decode held-out GPU | decode roofline |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in doc["attention"].items():
        lines.append(f"| {name} | {r['prefill_kernel']} / {r['decode_kernel']} | {_cell(r['prefill_own'])} | "
                     f"{_cell(r['prefill_heldout_gpu'])} | {_cell(r['prefill_roofline'])} | {_cell(r['decode_own'])} | "
                     f"{_cell(r['decode_heldout_gpu'])} | {_cell(r['decode_roofline'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    start = time.time()
    doc = {"gemm": gemm_results(), "attention": attention_results()}
    doc["seconds"] = time.time() - start
    doc["loadavg"] = list(os.getloadavg())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_lowp_heldout.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / "gpu_lowp_heldout.md").write_text(render(doc))
    sys.stdout.write(render(doc))


if __name__ == "__main__":
    main()
