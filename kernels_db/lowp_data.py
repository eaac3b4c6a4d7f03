"""Public bf16/fp8 GEMM and vLLM attention latencies (NVIDIA aiconfigurator) as numpy arrays.

The data (``/work/shared/data/lowp-kernel-measurements/*.csv``, Apache-2.0, collected inside vLLM) holds
~35k ``y = x @ W^T`` shapes per GPU in bf16 (cuBLAS through ``torch.nn.functional.linear``) and per-tensor
scaled fp8 (CUTLASS) on A100-SXM4-80GB, H100 SXM, H200 SXM, L40S and B200, plus prefill and decode
attention kernels. This module is the one place that reads it; conventions fixed at ingest:

* ``latency_ns`` from the CSV's ``latency_ms``; timed inside a CUDA graph, so there is no host dispatch in
  it (unlike the NeuSight fp32 data) and weights are not L2-hot (six weight matrices in turn).
* GEMM sizes in boomfx's convention: output ``[m, n]``, contraction ``k`` (the CSV's own: x ``[m, k]``,
  W ``[n, k]``).
* Systems are mapped to boomfx device names (``SYSTEM_DEVICES``).

Example::

    gemms = load_gemms()                                  # {(device, "bf16"|"fp8"): GemmTable}
    ctx = load_attention("attention_context.csv")         # prefill rows, AttentionTable

Known limitations: one software stack per GPU (vLLM 0.14 on the A100, 0.24 elsewhere); attention rows
are vLLM's serving kernels (FlashAttention 2/3, FlashInfer, Triton over a paged KV cache), not
``scaled_dot_product_attention``.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

DEFAULT_LOWP_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "lowp-kernel-measurements"
SOURCE = ("NVIDIA aiconfigurator (ai-dynamo/aiconfigurator @095f58a51c4c, Apache-2.0) vLLM kernel "
          "measurements: bf16 cuBLAS / fp8 CUTLASS GEMMs, FlashAttention/FlashInfer prefill and decode")

SYSTEM_DEVICES: Mapping[str, str] = {
    "a100_sxm": "a100-80gb", "h100_sxm": "h100-sxm", "h200_sxm": "h200", "l40s": "l40s", "b200_sxm": "b200",
}
GEMM_PRECISIONS: Mapping[str, str] = {"bfloat16": "bf16", "fp8": "fp8"}
MS_TO_NS = 1e6


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMMs of one device and precision: arrays of equal length, ``latency_ns`` per GEMM."""

    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    latency_ns: np.ndarray

    def take(self, index: np.ndarray) -> "GemmTable":
        return GemmTable(self.m[index], self.n[index], self.k[index], self.latency_ns[index])

    def __len__(self) -> int:
        return len(self.latency_ns)


def load_gemms(data_dir: Optional[Path | str] = None) -> dict[tuple[str, str], GemmTable]:
    """Every GEMM row, grouped by (boomfx device name, precision "bf16" / "fp8")."""
    path = Path(data_dir or DEFAULT_LOWP_DIR) / "gemm.csv"
    cols: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            key = (SYSTEM_DEVICES[row["system"]], GEMM_PRECISIONS[row["gemm_dtype"]])
            cols.setdefault(key, []).append((float(row["m"]), float(row["n"]), float(row["k"]),
                                             float(row["latency_ms"]) * MS_TO_NS))
    out = {}
    for key, values in sorted(cols.items()):
        a = np.asarray(values, dtype=np.float64)
        out[key] = GemmTable(a[:, 0], a[:, 1], a[:, 2], a[:, 3])
    return out


@dataclass(frozen=True)
class AttentionTable:
    """Measured attention calls of one CSV: one entry per row; ``tokens`` is ``seq_len`` (prefill) or
    ``cached_tokens`` (decode). ``kernel`` and ``kv_dtype`` are strings as in the CSV."""

    device: np.ndarray
    kernel: np.ndarray
    kv_dtype: np.ndarray
    batch: np.ndarray
    tokens: np.ndarray
    heads: np.ndarray
    kv_heads: np.ndarray
    head_dim: np.ndarray
    window: np.ndarray
    latency_ns: np.ndarray

    def where(self, mask: np.ndarray) -> "AttentionTable":
        return AttentionTable(*(getattr(self, f)[mask] for f in self.__dataclass_fields__))

    def __len__(self) -> int:
        return len(self.latency_ns)


def load_attention(name: str, data_dir: Optional[Path | str] = None) -> AttentionTable:
    """``attention_context.csv`` (prefill) or ``attention_generation.csv`` (decode) as one table."""
    path = Path(data_dir or DEFAULT_LOWP_DIR) / name
    token_col = "seq_len" if "context" in name else "cached_tokens"
    text: dict[str, list[str]] = {"device": [], "kernel": [], "kv_dtype": []}
    nums: list[tuple[float, ...]] = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            text["device"].append(SYSTEM_DEVICES[row["system"]])
            text["kernel"].append(row["kernel_source"])
            text["kv_dtype"].append(row["kv_cache_dtype"])
            nums.append((float(row["batch_size"]), float(row[token_col]), float(row["num_heads"]),
                         float(row["num_key_value_heads"]), float(row["head_dim"]), float(row["window_size"]),
                         float(row["latency_ms"]) * MS_TO_NS))
    a = np.asarray(nums, dtype=np.float64)
    return AttentionTable(np.asarray(text["device"]), np.asarray(text["kernel"]), np.asarray(text["kv_dtype"]),
                          *(a[:, j] for j in range(7)))
