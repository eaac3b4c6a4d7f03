"""A deep stack's per-rank numbers from two shallow builds of it: how ``--search`` prices an 80-layer plan.

Why: building a plan's per-rank programs (the FSDP/TP/pipeline rewrites and one ``Analysis`` per rank class)
costs time linear in the layer count (5-15 s per plan at 80 layers here), and a search builds dozens. A
stack of identical layers adds the same work per layer: the same kernels, the same collectives on the same
streams, the same saved activations and shards. So the search builds the plan at two depths of its stack
(``ProgramOptions.stack_depth``: layers synthesised from the one truncated trace, ``training/truncate.py``)
and carries each rank class's numbers on to the model's depth along the line through them:

- step time, exposed and hidden communication: linear in the depth (per stage: ``pp x k`` layers, ``k``
  per stage, so every stage grows alike);
- live bytes: linear per training phase (forward, backward, recompute, optimizer): the peak is the largest
  of the phases' peaks at full depth, so a peak that moves from the optimizer to the backward as layers are
  added is followed rather than extrapolated through;
- the allocator's reserve above the live peak (rounding, cached blocks) and the memory outside the
  allocator: as the deeper probe has them (it does not grow with depth the way live bytes do; measured
  on the 80-layer model: 3.6 GiB at 6 layers, 4.7 GiB at 80, so the total is low by ~1-2% there).

``tests/test_depth_probe.py`` compares the carried numbers with the full-depth build; a search re-checks at
full depth every plan whose carried total lies within ``FIT_MARGIN`` of the device's memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

# the shallowest stack the truncated trace synthesises (layers 0, 1, 2 and the last)
MIN_DEPTH = 4
# a carried total within this fraction of the device's memory is checked at full depth
FIT_MARGIN = 0.05


@dataclass(frozen=True)
class ProbeDepths:
    """The two depths a plan is built at, and the model's."""

    shallow: int
    deep: int
    full: int

    def carry(self, shallow_value: float, deep_value: float) -> float:
        """The value at ``full`` on the line through the two probes."""
        return shallow_value + (deep_value - shallow_value) * (self.full - self.shallow) / (self.deep - self.shallow)


def probe_depths(layers: int, pp: int) -> Optional[ProbeDepths]:
    """The probe depths for ``layers`` split over ``pp`` stages, or None where building the model whole
    costs no more (two probes of ``pp x k`` layers each must together be well under the model)."""
    if pp < 1 or layers % pp:
        return None
    per_stage = max(1, math.ceil(MIN_DEPTH / pp))
    shallow, deep = pp * per_stage, pp * (per_stage + (2 if pp == 1 else 1))
    if shallow + deep > 0.75 * layers:
        return None
    return ProbeDepths(shallow, deep, layers)


def phase_peaks(timeline: Sequence[int], order: Sequence[str], phases: Mapping[str, str]) -> dict[str, int]:
    """The largest live bytes in each phase of a step (steps outside a phase under ``""``)."""
    peaks: dict[str, int] = {}
    for name, live in zip(order, timeline):
        phase = phases.get(name, "")
        if live > peaks.get(phase, -1):
            peaks[phase] = live
    return peaks


def carried_peak(shallow: Mapping[str, int], deep: Mapping[str, int], depths: ProbeDepths) -> float:
    """The live peak at full depth: each phase's peak carried on, the largest of them."""
    return max((depths.carry(shallow.get(p, 0), deep[p]) for p in deep), default=0.0)


@dataclass(frozen=True)
class CarriedClass:
    """One rank class at the model's depth, from its two probes."""

    step_ns: float
    live_peak_bytes: float
    total_device_bytes: float
    exposed_comm_ns: float
    hidden_comm_ns: float


def carry_class(depths: ProbeDepths, shallow: Mapping[str, Any], deep: Mapping[str, Any]) -> CarriedClass:
    """``shallow``/``deep``: a class's ``step_ns``, ``phase_peaks``, ``total_device_bytes``,
    ``exposed_comm_ns`` and ``hidden_comm_ns`` at each probe."""
    live = carried_peak(shallow["phase_peaks"], deep["phase_peaks"], depths)
    reserve = deep["total_device_bytes"] - max(deep["phase_peaks"].values(), default=0)
    return CarriedClass(depths.carry(shallow["step_ns"], deep["step_ns"]), live, live + reserve,
                        depths.carry(shallow["exposed_comm_ns"], deep["exposed_comm_ns"]),
                        depths.carry(shallow["hidden_comm_ns"], deep["hidden_comm_ns"]))
