"""Fit the collective model's free parameters on measured collectives (the public NCCL table, or any rows).

Free parameters (``collective_model.CollectiveCalibration``): per protocol a base and a per-step hop latency
and (LL, LL128) an achieved fraction of the link; Simple's efficiency and rank loss per op; per
interconnect family a latency and a bandwidth scale, normalised to a geometric mean of 1 over the fitted
families so that an unseen family (a held-out system of a new NVLink generation) gets the mean. The
objective is the mean |log(predicted / measured)| over rows (every size weighs the same, small or large).
The minimiser is a restarted Nelder-Mead in numpy (no SciPy dependency).

Example::

    rows = list(iter_public_collectives(PUBLIC_CSV))
    cal = fit_calibration(rows)              # all systems
    cal = fit_calibration(rows, exclude={"h100_sxm"})   # leave one out
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from boomfx.core.devices import get_device
from boomfx.kernels_db.collective_import import CollectiveRow, PublicCollectiveRow
from boomfx.kernels_db.collective_model import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    PROTOCOLS,
    REDUCE_SCATTER,
    CollectiveCalibration,
    FamilyScale,
    HostLinkParams,
    ProtocolParams,
    SimpleParams,
    intra_link,
    ring_candidates,
)

FITTED_OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
# Starting point (us, fractions): NCCL's own constants where it has them (tuning.cc baseLat ring LL 6.6, LL128
# 14, Simple 8.4; hwLat NVLink .6/1.9/3.4; LL at 1/4 of the link), 0.7 of the link for Simple.
_START = {"LL": (6_600.0, 600.0, 0.25), "LL128": (14_000.0, 1_900.0, 0.5), "Simple": (8_400.0, 3_400.0, 1.0)}
_START_SIMPLE = (0.75, 0.4)


@dataclass(frozen=True)
class FitRows:
    """Measurements as arrays per op: ranks, bytes, link bandwidth, family index, time (ns)."""

    families: tuple[str, ...]
    by_op: dict


def prepare(rows: Iterable[PublicCollectiveRow]) -> FitRows:
    by_op: dict[str, list] = {op: [] for op in FITTED_OPS}
    families: list[str] = []
    links: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r.row.op not in by_op:
            continue
        if r.device not in links:
            link = intra_link(get_device(r.device), r.row.ranks_per_node)
            links[r.device] = (link.bandwidth_bytes_per_s, link.family)
        bw, fam = links[r.device]
        if fam not in families:
            families.append(fam)
        by_op[r.row.op].append((r.row.world, r.row.message_bytes, bw, families.index(fam), r.row.time_ns))
    arrays = {op: tuple(np.array(col, dtype=float) for col in zip(*vals)) for op, vals in by_op.items() if vals}
    return FitRows(tuple(families), arrays)


def _unpack(x: np.ndarray, nfam: int) -> tuple[CollectiveCalibration, np.ndarray, np.ndarray]:
    protocols = {}
    i = 0
    for p in PROTOCOLS:
        eff = float(np.exp(x[i + 2])) if p != "Simple" else 1.0
        protocols[p] = ProtocolParams(float(np.exp(x[i])), float(np.exp(x[i + 1])), eff)
        i += 3 if p != "Simple" else 2
    simple = {}
    for op in FITTED_OPS:
        simple[op] = SimpleParams(float(np.exp(x[i])), float(1.0 / (1.0 + np.exp(-x[i + 1]))))
        i += 2
    lat = x[i:i + nfam] - x[i:i + nfam].mean()
    bw = x[i + nfam:i + 2 * nfam] - x[i + nfam:i + 2 * nfam].mean()
    return CollectiveCalibration(protocols, simple), np.exp(lat), np.exp(bw)


def _x0(nfam: int) -> np.ndarray:
    x = []
    for p in PROTOCOLS:
        base, hop, eff = _START[p]
        x += [np.log(base), np.log(hop)] + ([np.log(eff)] if p != "Simple" else [])
    for _ in FITTED_OPS:
        x += [np.log(_START_SIMPLE[0]), np.log(_START_SIMPLE[1] / (1 - _START_SIMPLE[1]))]
    return np.array(x + [0.0] * (2 * nfam))


def predict(cal: CollectiveCalibration, lat_scale: np.ndarray, bw_scale: np.ndarray, fit_rows: FitRows,
            op: str, allowed: Sequence[str] = PROTOCOLS) -> tuple[np.ndarray, np.ndarray]:
    """(model time, measured time) of one op's rows (single node)."""
    n, size, bw, fam, measured = fit_rows.by_op[op]
    fam_i = fam.astype(int)
    scale = FamilyScale(lat_scale[fam_i], bw_scale[fam_i])
    times = ring_candidates(cal, op, n, size, bw, scale)
    return np.min(np.array([times[p] for p in allowed]), axis=0), measured


def objective(x: np.ndarray, fit_rows: FitRows) -> float:
    cal, lat, bw = _unpack(x, len(fit_rows.families))
    errs = []
    for op in fit_rows.by_op:
        pred, meas = predict(cal, lat, bw, fit_rows, op)
        errs.append(np.abs(np.log(pred / meas)))
    return float(np.mean(np.concatenate(errs)))


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.3, iters: int = 6000,
                tol: float = 1e-9) -> tuple[np.ndarray, float]:
    """Plain Nelder-Mead (reflection 1, expansion 2, contraction 0.5, shrink 0.5)."""
    dim = len(x0)
    simplex = np.vstack([x0] + [x0 + step * np.eye(dim)[i] for i in range(dim)])
    values = np.array([f(s) for s in simplex])
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        if values[-1] - values[0] < tol:
            break
        centroid = simplex[:-1].mean(axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
                values[1:] = [f(s) for s in simplex[1:]]
    best = int(np.argmin(values))
    return simplex[best], float(values[best])


def fit_calibration(rows: Sequence[PublicCollectiveRow], exclude: Iterable[str] = (), restarts: int = 4,
                    host: Optional[HostLinkParams] = None, source: str = "") -> CollectiveCalibration:
    """Fit on every row whose system is not in ``exclude``; returns the calibration with family scales."""
    excluded = set(exclude)
    fit_rows = prepare(r for r in rows if r.system not in excluded)
    nfam = len(fit_rows.families)
    x, value = _x0(nfam), float("inf")
    for attempt in range(restarts):
        x, value = nelder_mead(lambda v: objective(v, fit_rows), x, step=0.3 if attempt == 0 else 0.1)
    cal, lat, bw = _unpack(x, nfam)
    families = {fam: FamilyScale(float(lat[i]), float(bw[i])) for i, fam in enumerate(fit_rows.families)}
    systems = sorted({r.system for r in rows} - excluded)
    return CollectiveCalibration(cal.protocols, cal.simple, families, host,
                                 source or f"fit_collective_model on {', '.join(systems)}: mean |log error| "
                                           f"{value:.4f} over {sum(len(v[0]) for v in fit_rows.by_op.values())} rows")


def fit_host(rows: Sequence[CollectiveRow], source: str) -> HostLinkParams:
    """Fit ``base + steps * hop + bus_bytes / bandwidth`` (the CPU model) on measured gloo rows."""
    from boomfx.kernels_db.collective_model import bus_factor, ring_steps
    steps = np.array([ring_steps(r.op, r.world) for r in rows], dtype=float)
    bus = np.array([r.message_bytes * bus_factor(r.op, r.world) for r in rows], dtype=float)
    measured = np.array([r.time_ns for r in rows], dtype=float)

    def err(x: np.ndarray) -> float:
        pred = np.exp(x[0]) + steps * np.exp(x[1]) + bus / np.exp(x[2]) * 1e9
        return float(np.mean(np.abs(np.log(pred / measured))))

    x, _ = nelder_mead(err, np.log(np.array([50_000.0, 50_000.0, 2e9])))
    x, _ = nelder_mead(err, x, step=0.1)
    return HostLinkParams(float(np.exp(x[0])), float(np.exp(x[1])), float(np.exp(x[2])), source)
