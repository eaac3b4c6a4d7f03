"""The GPU kernel time formulas, vectorised over numpy arrays so one code path serves fitting and prediction.

Two families, each a function of sizes, the device's datasheet figures and fitted parameters (data, never
literals in the formulas; the parameters live in ``kernels_db/data/gpu_calibration.json``):

Matmul (``gemm_time_ns``), Habitat-style numbered steps:
    1. For each candidate output tile ``tm x tn`` (cuBLAS/CUTLASS SIMT sgemm tiles), the grid has
       ``tiles = B * ceil(M/tm) * ceil(N/tn)`` blocks, spread over the SMs; tiles co-resident on one SM
       share its throughput, so the busiest SM runs ``ceil(tiles / sm_count)`` tiles.
    2. Each tile is ``2*tm*tn*K`` FLOPs at the SM's share of peak times an achieved efficiency
       ``e = e_max * e_tile * e_depth``:
       ``e_depth = K / (K + k_half)`` (prologue/epilogue amortised over the K loop) and
       ``e_tile = min(1, I_tile / 64) ** tile_alpha`` with ``I_tile = tm*tn/(tm+tn)`` (register-blocking
       intensity; 64 for 128x128).
       ``t = ceil(tiles / sm_count) * 2*tm*tn*K / (peak/sm_count * e)``.
    3. Split-K variants (K cut into ``s`` slices, ``s`` in ``SPLIT_K``) multiply the tiles by ``s``,
       divide the depth by ``s`` and add a reduction pass over ``s`` partial outputs at ``mem_efficiency``
       of bandwidth.
    4. A kernel can never beat DRAM: ``max(t, min_bytes / (bandwidth * mem_efficiency))``.
    5. cuBLAS picks a good kernel: take the minimum over candidates, then add ``floor_ns``.

Memory-bound ops (``memory_time_ns``): ``floor_ns + bytes / achieved_bandwidth(bytes, row)``, the
saturating curve ``achieved = bandwidth * e(row) * bytes / (bytes + floor_ns*bandwidth*e(row))``
written in its equivalent additive form; ``1/e`` is piecewise linear in ``log2(row length)`` (layer
norm and softmax switch kernels with row length; elementwise ops use one knot).

Invariants (tested): every efficiency is <= 1, so a prediction is never faster than
``max(flops/peak, bytes/bandwidth)``; every term is non-decreasing in B, M, N, K (the minimum of
non-decreasing functions is non-decreasing), so doubling a size never lowers the time; wave steps appear
when the tile grid crosses a multiple of ``sm_count``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

# (tm, tn): tile shapes of the SIMT sgemm kernels seen in the public data (ampere/volta/maxwell_sgemm_*,
# sm80_xmma tilesize*, cutlass simt 128x256/256x128).
TILES: tuple[tuple[int, int], ...] = (
    (256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64), (128, 32), (32, 128), (64, 32),
    (32, 64), (32, 32),
)
SPLIT_K: tuple[int, ...] = (1, 2, 4, 8, 16)
REFERENCE_TILE_INTENSITY = 64.0  # 128*128/(128+128)
FP32_BYTES = 4


@dataclass(frozen=True)
class GemmParams:
    """Fitted constants of the matmul formula for one device (or the generic, device-independent set)."""

    e_max: float           # asymptotic achieved fraction of datasheet fp32 peak (<= 1)
    k_half: float          # contraction depth at which the depth efficiency is 1/2
    tile_alpha: float      # exponent of the small-tile penalty
    floor_ns: float        # launch + host dispatch floor seen by these measurements
    mem_efficiency: float  # achieved fraction of datasheet bandwidth for the memory-bound bound (<= 1)

    def clipped(self) -> "GemmParams":
        """Physical bounds: efficiencies in (0, 1], non-negative times."""
        return GemmParams(float(min(max(self.e_max, 1e-3), 1.0)), float(max(self.k_half, 0.0)),
                          float(max(self.tile_alpha, 0.0)), float(max(self.floor_ns, 0.0)),
                          float(min(max(self.mem_efficiency, 1e-3), 1.0)))


@dataclass(frozen=True)
class MemoryParams:
    """Fitted constants of one memory-bound op class on one device.

    ``inv_efficiency[j]`` is datasheet bandwidth / achieved bandwidth at row length ``2**log2_row_knots[j]``
    (>= 1); linear interpolation in ``log2(row)`` in between, constant outside.
    """

    floor_ns: float
    log2_row_knots: tuple[float, ...]
    inv_efficiency: tuple[float, ...]


def _ceil_div(a: np.ndarray, b: float) -> np.ndarray:
    return np.ceil(a / b)


@dataclass(frozen=True)
class KernelFamily:
    """The candidate kernels of one precision: tiles, split-K factors, operand and output element sizes.

    ``reference_intensity`` is the tile intensity ``tm*tn/(tm+tn)`` that reaches ``e_max`` (smaller tiles
    pay ``(I/I_ref)**tile_alpha``); split-K partial sums are fp32 (``partial_itemsize``).
    """

    tiles: tuple[tuple[int, int], ...]
    split_k: tuple[int, ...]
    reference_intensity: float
    in_itemsize: int
    out_itemsize: int
    partial_itemsize: int = FP32_BYTES


SIMT_FP32 = KernelFamily(TILES, SPLIT_K, REFERENCE_TILE_INTENSITY, FP32_BYTES, FP32_BYTES)


def gemm_time_ns(b: np.ndarray, m: np.ndarray, n: np.ndarray, k: np.ndarray, *, peak_flops_per_s: float,
                 bandwidth_bytes_per_s: float, sm_count: int, params: GemmParams,
                 include_floor: bool = True, family: KernelFamily = SIMT_FP32) -> np.ndarray:
    """Predicted ns of GEMMs ``[b, m, k] @ [b, k, n]`` (arrays broadcast together); see module doc.

    ``family`` picks the candidate kernels: fp32 SIMT sgemm by default, tensor-core tiles for
    bf16/fp16/fp8 (``kernels_db/tensor_core_gemm.py``).
    """
    b, m, n, k = (np.asarray(x, dtype=np.float64) for x in (b, m, n, k))
    p = params.clipped()
    min_bytes = b * (family.in_itemsize * (m * k + k * n) + family.out_itemsize * m * n)
    dram_ns = min_bytes / (bandwidth_bytes_per_s * p.mem_efficiency) * 1e9
    sm_flops_per_ns = peak_flops_per_s / sm_count / 1e9
    best = np.full(np.broadcast(b, m, n, k).shape, np.inf)
    for tm, tn in family.tiles:
        intensity = tm * tn / (tm + tn)
        e_tile = min(1.0, intensity / family.reference_intensity) ** p.tile_alpha
        base_tiles = b * _ceil_div(m, tm) * _ceil_div(n, tn)
        for split in family.split_k:
            depth = np.ceil(k / split)
            # an empty contraction (k = 0: a weight gradient over zero tokens) has no tile work, only its
            # zeroed output to write; without the guard its efficiency 0 made the time 0/0 = NaN
            fill = np.divide(depth, depth + p.k_half, out=np.zeros_like(depth), where=depth > 0)
            e = np.maximum(p.e_max * e_tile * fill, 1e-12)
            tiles_per_sm = np.ceil(base_tiles * split / sm_count)   # the busiest SM's share of the grid
            tile_ns = 2.0 * tm * tn * depth / (sm_flops_per_ns * e)
            t = tiles_per_sm * tile_ns
            if split > 1:
                # reduction: read `split` partial [b, m, n] outputs, write one
                reduce_bytes = b * m * n * (family.partial_itemsize * split + family.out_itemsize)
                t = t + reduce_bytes / (bandwidth_bytes_per_s * p.mem_efficiency) * 1e9
                t = np.where(k >= split * 64, t, np.inf)   # cuBLAS only splits deep contractions
            best = np.minimum(best, np.maximum(t, dram_ns))
    return best + (p.floor_ns if include_floor else 0.0)


def gemm_roofline_ns(b, m, n, k, *, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> np.ndarray:
    """Datasheet roofline ``max(flops/peak, bytes/bandwidth)`` of the same GEMMs (no efficiency)."""
    b, m, n, k = (np.asarray(x, dtype=np.float64) for x in (b, m, n, k))
    flops = 2.0 * b * m * n * k
    nbytes = FP32_BYTES * b * (m * k + k * n + m * n)
    return np.maximum(flops / peak_flops_per_s, nbytes / bandwidth_bytes_per_s) * 1e9


# Candidate datasheet predictors of e_max (each a tuple of features, log-linear); the fit keeps the one with
# the smallest leave-one-device-out error. () is the plain median.
E_MAX_FEATURE_SETS: tuple[tuple[str, ...], ...] = (
    (), ("watts_per_tflop",), ("bytes_per_flop",), ("watts_per_tflop", "bytes_per_flop"),
)


def device_features(peak_flops_per_s: float, bandwidth_bytes_per_s: float,
                    board_power_w: Optional[float] = None) -> dict[str, float]:
    """Datasheet features that may predict a GPU's achieved SIMT sgemm efficiency (``e_max``).

    ``watts_per_tflop``: board power / fp32 peak. Low-power cards (L4 72 W, T4 70 W) cannot hold their boost
    clock under a sustained FFMA load, so they reach a smaller fraction of the datasheet peak.
    ``bytes_per_flop``: datasheet bandwidth / fp32 peak (machine balance).
    A feature is absent when its datasheet figure is unknown.
    """
    out = {"bytes_per_flop": bandwidth_bytes_per_s / peak_flops_per_s}
    if board_power_w:
        out["watts_per_tflop"] = board_power_w / (peak_flops_per_s / 1e12)
    return out


def trend_log_e_max(fit: Mapping, features: Mapping[str, float]) -> Optional[float]:
    """``log e_max = intercept + sum_i coef_i * log(feature_i)``, capped above at the largest fitted e_max.

    None when a feature the trend needs is unknown for this device. Not clipped below: the fitted devices
    span the power-limited regime only partly, and a card further into it is slower still
    (``GemmParams.clipped`` keeps e_max > 0).
    """
    names = fit["features"]
    if any(name not in features for name in names):
        return None
    value = fit["intercept"] + sum(c * float(np.log(features[name])) for c, name in zip(fit["coef"], names))
    return min(value, float(np.log(fit["e_max_max"])))


def inv_efficiency_at(log2_row: np.ndarray, params: MemoryParams) -> np.ndarray:
    knots = np.asarray(params.log2_row_knots, dtype=np.float64)
    values = np.maximum(np.asarray(params.inv_efficiency, dtype=np.float64), 1.0)
    if len(knots) == 1:
        return np.full(np.shape(log2_row), values[0])
    return np.interp(log2_row, knots, values)


def memory_time_ns(nbytes: np.ndarray, row: np.ndarray, *, bandwidth_bytes_per_s: float,
                   params: MemoryParams) -> np.ndarray:
    """Predicted ns of a memory-bound kernel moving ``nbytes`` over rows of length ``row``."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    log2_row = np.log2(np.maximum(np.asarray(row, dtype=np.float64), 1.0))
    return params.floor_ns + nbytes * inv_efficiency_at(log2_row, params) / bandwidth_bytes_per_s * 1e9


def hat_basis(log2_row: np.ndarray, knots: Sequence[float]) -> np.ndarray:
    """Columns = linear-interpolation weights of each knot (rows sum to 1); used to fit ``inv_efficiency``."""
    log2_row = np.asarray(log2_row, dtype=np.float64)
    eye = np.eye(len(knots))
    if len(knots) == 1:
        return np.ones((len(log2_row), 1))
    return np.stack([np.interp(log2_row, knots, eye[j]) for j in range(len(knots))], axis=1)
