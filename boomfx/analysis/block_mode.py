"""Block mode at evaluation time: instances of repeated blocks whose whole-block time the database holds
(``boomfx kernels collect --blocks``, kernels_db/blocks_db.py) take that time instead of the sum of their
kernels' prices."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import sympy

from boomfx.kernels_db.block_runner import extract_block
from boomfx.kernels_db.blocks_db import SOURCE_BLOCK_MEASURED, BlockAnalysis, block_key, block_records
from boomfx.kernels_db.schema import KernelRecord
from boomfx.kernels_db.store import Store


def measured_block_times(analysis: BlockAnalysis, db: Optional[str],
                         bindings: Mapping[sympy.Symbol, int]) -> dict[int, KernelRecord]:
    """class index -> the block row measured for it at ``bindings`` on the analysis' device (if any)."""
    from boomfx.kernels_db.db_path import resolve_db_path
    if not analysis.blocks.classes:
        return {}
    path = resolve_db_path(db, analysis.device)
    if path is None:
        return {}
    rows = block_records(Store(path), analysis.device.name)
    if not rows:
        return {}
    ev = analysis.evaluator(bindings)
    found = {}
    for c, cls in enumerate(analysis.blocks.classes):
        key = block_key(extract_block(analysis.program, cls, ev, build=False))
        if key.key_hash in rows:
            found[c] = rows[key.key_hash]
    return found


def apply_block_measurements(analysis: BlockAnalysis, db: Optional[str], bindings: Mapping[sympy.Symbol, int],
                             kernels: Sequence[Any],
                             scheduled: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``kernels`` (KernelReport) and ``scheduled`` (ScheduledKernel, index-aligned) with every instance of a
    measured block scaled to the measured time: kernel i of an instance gets
    ``measured_ns * t_i / sum(t)`` (equal shares when the per-kernel prices sum to 0), source "block-measured".
    """
    kernels, scheduled = list(kernels), list(scheduled)
    if not kernels:
        return kernels, scheduled
    rows = measured_block_times(analysis, db, bindings)
    if not rows:
        return kernels, scheduled
    groups: dict[tuple[int, int], list[int]] = {}
    for i, k in enumerate(kernels):
        ref = analysis.blocks.node_to_block.get(k.node)
        if ref is not None and ref.class_index in rows:
            groups.setdefault((ref.class_index, ref.instance), []).append(i)
    on_cpu = analysis.device.kind == "cpu"
    for (c, _), members in groups.items():
        rec = rows[c]
        total = sum(kernels[i].time_ns for i in members)
        for i in members:
            share = kernels[i].time_ns / total if total > 0 else 1.0 / len(members)
            time_ns = rec.median_ns * share
            kernels[i] = dataclasses.replace(kernels[i], time_ns=time_ns, source=SOURCE_BLOCK_MEASURED)
            # the measured time is the whole instance: on a CPU it already holds dispatch (no host added)
            device_ns = time_ns if (rec.host_in_time or not on_cpu) else time_ns + kernels[i].host_ns
            scheduled[i] = dataclasses.replace(scheduled[i], device_ns=device_ns)
    return kernels, scheduled
