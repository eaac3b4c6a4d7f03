"""Is a measured kernel time believable? Checks that keep a busy machine's numbers out of the database.

A database collected while other jobs compete for the machine is poisoned without a sign: every kernel of
64K+ elements measured ~8 ms, with p90 close to the median (so the noise warning did not fire), and
``--db auto`` then used it for every later prediction (1.18 s predicted, 60 ms real). Two checks, each
against independent truth, refuse such rows at collection (``collect.collect_keys``) and flag them at
analysis (``analyze``'s warnings):

1. **Slower than the roofline allows**: ``median > SLOW_FACTOR x (roofline + overhead)``. The roofline is
   the datasheet one (``roofline.py``) at the measured thread count (a CPU's compute peak scaled by
   threads / cores); the overhead is the call's own measured dispatch time (capped, see below) or, on a
   GPU, the launch latency already inside the roofline. Work is the cost formula's FLOPs and bytes.
2. **Inconsistent across sizes**: within one signature (same op, dtypes, layouts, flags: ``lookup.key_point``),
   a call that does at least as much work can not be ``INVERSION_FACTOR`` times faster than a smaller one.
   Noise only adds time, so the smaller, slower row is the one refused.

Thresholds are named data with their evidence (``benchmarks/plausibility_thresholds.py`` recomputes it into
``benchmarks/results/plausibility_thresholds.json``):
``SLOW_FACTOR``: over the 27,335 public GPU rows (NeuSight, idle GPUs, 8 devices) ``median / (roofline + launch)``
is 1.06 at the median, 3.4 at the 99th percentile and 9.7 at most (an A100-PCIe fp32 bmm of 66 us). On the
shared 2-core development VM at load average 7-9 (2026-12-01), the rows of a ``kernels collect`` of
``examples/gpt_tiny.pt2 --train`` split in two: 25 at 0.1-3.0 rooflines and
21 at 209-3,661 (``aten.mm`` 512x64x64 at 84 ms, ``aten.sum`` at 56 ms: scheduler time slices); a sweep on the same
machine had 98 of 262 rows above 20 (54 inverted by more than 12x). 20 leaves a x2 margin over the slowest legitimate row of 27k.
``INVERSION_FACTOR``: tile and wave quantization make a larger GEMM faster than a smaller, unaligned one: in the
public data the largest such inversion within one signature is 5.6x (p99 3.0x); the busy VM's were up to 22,000x.
12 leaves a x2 margin.

Known limitations:
- The roofline uses datasheet peaks: a CPU without a registry entry gets ``cpu_spec``'s nominal AVX2 rate.
- Ops whose cost formula undercounts their work (data-dependent ones) are protected only by the margin.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch

from boomfx.core.devices import DeviceSpec, cpu_spec
from boomfx.kernels_db.keys import _materialise, op_from_name
from boomfx.kernels_db.roofline import roofline_ns
from boomfx.kernels_db.schema import DeviceFingerprint, KernelKey
from boomfx.passes.costs.registry import Cost, OpCall, price_call
from boomfx.passes.specs import TensorSpec

SLOW_FACTOR = 20.0             # x (roofline + overhead): see the module docstring for the evidence
INVERSION_FACTOR = 12.0        # a call with >= the work this many times faster: the smaller one is implausible
MAX_OVERHEAD_NS = 50_000.0     # cap on the dispatch allowance: a busy machine inflates the dispatch probe too
                               # (eager CPU dispatch here: 2-10 us; 50 us is a generous host)
SUSPECT_SHARE_OF_STEP = 0.02   # analysis warns when implausible rows price at least this share of a step


def device_of(fingerprint: DeviceFingerprint) -> Optional[DeviceSpec]:
    """The registry spec of a fingerprint's device (``cpu_spec`` for a CPU), None for an unknown GPU."""
    from boomfx.core.devices import UnknownDeviceError, get_device
    from boomfx.kernels_db.device_rows import canonical_device_name
    if fingerprint.device_kind == "cpu":
        return cpu_spec()
    if fingerprint.device_kind != "cuda":
        return None
    try:
        return get_device(canonical_device_name(fingerprint.device_name))
    except UnknownDeviceError:
        return None


def at_threads(device: DeviceSpec, threads: int) -> DeviceSpec:
    """A CPU spec whose compute peaks are those of ``threads`` of its cores (threads <= 0: all of them)."""
    if device.kind != "cpu" or threads <= 0:
        return device
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = min(threads, cores) / max(cores, 1)
    return dataclasses.replace(device, peak_flops_per_s={d: p * share for d, p in device.peak_flops_per_s.items()})


def call_from_key(key: KernelKey) -> Optional[OpCall]:
    """The OpCall a kernel key describes (outputs found on the meta device), or None when it can not be
    rebuilt there (block and host rows, data-dependent ops)."""
    try:
        data = key.data
        op = op_from_name(data["op"])
        specs = [TensorSpec(tuple(t["shape"]), tuple(t["stride"]), getattr(torch, t["dtype"]), t["offset"])
                 for t in data["tensors"]]
        meta = [torch.empty_strided(t["shape"], t["stride"], dtype=getattr(torch, t["dtype"]), device="meta")
                for t in data["tensors"]]
        args, kwargs, meta_args, meta_kwargs = [], {}, [], {}
        for a in op._schema.arguments:
            if a.name not in data["args"]:
                continue
            value = _materialise(data["args"][a.name], specs, torch.device("meta"))
            meta_value = _materialise(data["args"][a.name], meta, torch.device("meta"))
            if a.kwarg_only:
                kwargs[a.name], meta_kwargs[a.name] = value, meta_value
            else:
                args.append(value)
                meta_args.append(meta_value)
        out = op(*meta_args, **meta_kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        outputs = tuple(TensorSpec.from_tensor(o) if isinstance(o, torch.Tensor) else o for o in outs)
        context = {k: _materialise(v, specs, torch.device("meta")) for k, v in data.get("context", {}).items()}
        return OpCall.build(op, tuple(args), kwargs, outputs, context)
    except Exception:  # noqa: BLE001 - a key that does not rebuild on meta is only checked across sizes
        return None


def slowness(median_ns: float, overhead_ns: float, call: OpCall, cost: Cost, device: DeviceSpec) -> float:
    """``median / (roofline + overhead)``: how many rooflines of its work a kernel took."""
    allowance = min(max(overhead_ns, 0.0), MAX_OVERHEAD_NS)
    return median_ns / max(roofline_ns(call, cost, device) + allowance, 1e-3)


def call_cost(call: OpCall) -> Cost:
    return price_call(call).cost


@dataclass(frozen=True)
class Rejection:
    """A measurement refused, and why (one line for the user)."""

    key: KernelKey
    reason: str


class PlausibilityCheck:
    """The checks of one collection: ``check`` each measurement before it is stored (roofline, and sizes
    against the rows stored so far); ``inversions`` at the end (sizes, now that every new row is known).

    Args:
        fingerprint: where the measurements are taken (device, thread count).
        stored: the rows the database already holds for this fingerprint (the sizes check compares with them).
        device: the roofline's device (default: the fingerprint's registry device at its thread count).
    """

    def __init__(self, fingerprint: DeviceFingerprint, stored: Iterable[Any] = (),
                 device: Optional[DeviceSpec] = None) -> None:
        spec = device or device_of(fingerprint)
        self.device = at_threads(spec, fingerprint.num_threads) if spec is not None else None
        self._by_signature: dict[str, list[tuple[float, float, str, KernelKey]]] = {}
        for rec in stored:
            self._add(rec.key, rec.median_ns)

    def _add(self, key: KernelKey, median_ns: float) -> None:
        point = _point(key)
        if point is not None:
            work = float(math.prod(point.features))
            self._by_signature.setdefault(point.signature, []).append((work, median_ns, key.key_hash, key))

    def check(self, key: KernelKey, median_ns: float, host_ns: float, call: Optional[OpCall] = None) -> Optional[str]:
        """Why this measurement must not be stored, or None; a plausible one is remembered for later checks."""
        why = self._roofline_reason(key, median_ns, host_ns, call)
        if why is None:
            why = self._inversion_reason(key, median_ns)
        if why is None:
            self._add(key, median_ns)
        return why

    def _roofline_reason(self, key: KernelKey, median_ns: float, host_ns: float,
                         call: Optional[OpCall]) -> Optional[str]:
        if self.device is None:
            return None
        call = call if call is not None else call_from_key(key)
        if call is None:
            return None
        try:
            cost = call_cost(call)
            overhead = host_ns if self.device.kind == "cpu" else 0.0
            ratio = slowness(median_ns, overhead, call, cost, self.device)
        except Exception:  # noqa: BLE001 - a formula that can not evaluate this call: no roofline verdict
            return None
        if ratio <= SLOW_FACTOR:
            return None
        return (f"{median_ns / 1e3:.1f} us is {ratio:.0f}x the {self.device.name} roofline of its work "
                f"(limit {SLOW_FACTOR:g}x): measured while other jobs were running?")

    def _inversion_reason(self, key: KernelKey, median_ns: float) -> Optional[str]:
        point = _point(key)
        if point is None:
            return None
        work = float(math.prod(point.features))
        for other_work, other_ns, other_hash, _ in self._by_signature.get(point.signature, ()):
            if other_hash != key.key_hash and other_work >= work and other_ns * INVERSION_FACTOR < median_ns:
                return (f"{median_ns / 1e3:.1f} us, but a call of the same op with {other_work / work:.1f}x the "
                        f"work took {other_ns / 1e3:.1f} us (limit {INVERSION_FACTOR:g}x faster): measured while "
                        f"other jobs were running?")
        return None

    def inversions(self, key_hashes: Iterable[str]) -> list[tuple[str, str]]:
        """(key_hash, why) of the rows among ``key_hashes`` that a row remembered after them shows to be
        implausible (a larger call measured later ran far faster)."""
        wanted = set(key_hashes)
        found = []
        for rows in self._by_signature.values():
            for work, median_ns, key_hash, key in rows:
                if key_hash not in wanted:
                    continue
                for other_work, other_ns, other_hash, _ in rows:
                    if other_hash != key_hash and other_work >= work and other_ns * INVERSION_FACTOR < median_ns:
                        found.append((key_hash, f"{median_ns / 1e3:.1f} us, but a call of the same op with "
                                                f"{other_work / work:.1f}x the work took {other_ns / 1e3:.1f} us "
                                                f"(limit {INVERSION_FACTOR:g}x faster)"))
                        break
        return found

    def forget(self, key_hash: str) -> None:
        for rows in self._by_signature.values():
            rows[:] = [r for r in rows if r[2] != key_hash]


def _point(key: KernelKey) -> Any:
    from boomfx.kernels_db.lookup import key_point
    try:
        return key_point(key)
    except Exception:  # noqa: BLE001 - block/host rows and ops lookup can not place: no sizes check
        return None


def suspect_price_ratio(price: Any, call: OpCall, cost: Cost, device: DeviceSpec) -> Optional[float]:
    """For a kernel priced by database rows (measured/interpolated): how many rooflines its price is; None
    for other sources. On a CPU target the roofline is one core's (the most lenient thread count)."""
    if str(getattr(price.source, "value", price.source)) not in ("measured", "interpolated"):
        return None
    spec = at_threads(device, 1)
    overhead = price.host_ns if (device.kind == "cpu" and getattr(price, "host_in_time", False)) else 0.0
    try:
        return slowness(price.time_ns, overhead, call, cost, spec)
    except Exception:  # noqa: BLE001
        return None


def suspect_rows_warning(suspects: Mapping[str, tuple[float, float, str]], step_ns: float,
                         device: DeviceSpec) -> Optional[str]:
    """One line when kernels priced by implausible rows (``suspects``: node -> (ratio, time_ns, op)) hold at
    least ``SUSPECT_SHARE_OF_STEP`` of the step."""
    flagged = {n: v for n, v in suspects.items() if v[0] > SLOW_FACTOR}
    total = sum(v[1] for v in flagged.values())
    if not flagged or step_ns <= 0 or total < SUSPECT_SHARE_OF_STEP * step_ns:
        return None
    worst = max(flagged.values(), key=lambda v: v[0])
    return (f"{len(flagged)} kernels ({100 * total / step_ns:.0f}% of the kernel time) are priced by database rows more "
            f"than {SLOW_FACTOR:g}x slower than the {device.name} roofline (worst: {worst[2]} at {worst[0]:.0f}x, "
            f"{worst[1] / 1e3:.1f} us): the database was probably measured on a busy machine; collect it again "
            f"on a quiet one")
