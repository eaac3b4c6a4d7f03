"""Block records in the kernel database: whole repeated blocks measured on a local device, and the
analysis hook that prices every instance of a measured block by that measurement.

A block record is an ordinary ``KernelRecord`` (same table, same ``Store``) whose key has
``op == BLOCK_OP`` and whose JSON is::

    {"op": "block", "signature": "58f6485d906d",       # BlockClass.signature: digest of the canonical key
     "phases": ["backward", "forward"],                 # which parts of the step the instance holds
     "nodes": 107,                                      # value nodes per instance
     "inputs": [{"shape": [8, 1024, 768], "stride": [...], "offset": 0, "dtype": "float32"}, ...]}

The device is the row's fingerprint (device name, torch/CUDA versions, host), as for kernels. The
class name ("h.*") is not part of the key: two models whose blocks compute the same thing share rows.

``collect_blocks`` measures each class (``block_runner``) and stores one row per class;
``apply_block_measurements`` is the ``Analysis.evaluate`` hook: for a class with a row at these
bindings, the kernels of every instance keep their shares of the per-kernel prices but are scaled so
that the instance sums to the measured time, with source "block-measured".

Example::

    with Store(path) as store:
        result = collect_blocks(store, analysis, bindings, torch.device("cuda"))
    print(result.summary("gpt2.pt2", path))
    # later, boomfx analyze gpt2.pt2 --db path ... prices h.* instances as "block-measured"

Known limitations:
- Only the target device's own rows are used (``device_rows.is_of_device``); block times are not
  transferred between GPUs (``--from-db``).
- A CPU block time includes dispatch, as CPU kernel rows do; the scaled kernels carry it.
- A class is keyed by its symbolic signature: a re-export that renames size symbols is a new class.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import sympy
import torch

from boomfx.kernels_db.block_runner import BlockGraph, BlockTooLargeError, extract_block, make_block_inputs, \
    time_block
from boomfx.devices import DeviceSpec, get_device
from boomfx.kernels_db.device_rows import is_of_device
from boomfx.kernels_db.measure import current_fingerprint
from boomfx.kernels_db.progress import Progress
from boomfx.kernels_db.schema import KernelKey, KernelRecord, canonical_json
from boomfx.kernels_db.store import Store

BLOCK_OP = "block"                     # KernelKey.op of block rows; kernel lookups skip these rows
SOURCE_BLOCK_MEASURED = "block-measured"   # report.SOURCES


# ---------------------------------------------------------------------------------------------------
# Keys and records
# ---------------------------------------------------------------------------------------------------
def _value_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_value_json(v) for v in value]
    return None if value is None else value.as_json()


def block_key(block: BlockGraph) -> KernelKey:
    """The canonical key of an extracted block (signature, phases, node count, bound inputs)."""
    inputs = [_value_json(b.value) for b in block.inputs]
    data = {"op": BLOCK_OP, "signature": block.signature, "phases": list(block.phases),
            "nodes": len(block.nodes), "inputs": inputs}
    first = next((i for i in inputs if isinstance(i, dict)), None)
    return KernelKey(BLOCK_OP, first["dtype"] if first else "none", canonical_json(data))


def is_block_record(record: KernelRecord) -> bool:
    return record.key.op == BLOCK_OP


def block_records(store: Store, device: Union[str, DeviceSpec]) -> dict[str, KernelRecord]:
    """key_hash -> the newest block row measured on ``device`` (a spec, or a registry name or alias);
    rows of other devices in the same file are never used (``device_rows.py``)."""
    spec = get_device(device) if isinstance(device, str) else device
    with store:
        return {rec.key.key_hash: rec for rec in store.records(op=BLOCK_OP) if is_of_device(rec.fingerprint, spec)}


# ---------------------------------------------------------------------------------------------------
# Collection
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockCollectResult:
    """What ``collect_blocks`` did, per class name. ``pending``: not started, the budget ran out."""

    measured: tuple[str, ...]
    skipped: tuple[str, ...]                        # a row for this key and fingerprint was present
    too_large: tuple[tuple[str, str], ...]          # (class, why): does not fit on the local device
    failed: tuple[tuple[str, str], ...]             # (class, why): could not be extracted or run
    pending: tuple[str, ...] = ()
    elapsed_s: float = 0.0
    times_ns: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def summary(self, what: str, path: Any) -> str:
        lines = [f"collected {len(self.measured) + len(self.skipped) + len(self.too_large) + len(self.failed)} "
                 f"block classes of {what} into {path}: measured {len(self.measured)}, already present "
                 f"{len(self.skipped)}, too large {len(self.too_large)}, failed {len(self.failed)}, left for "
                 f"later {len(self.pending)} ({self.elapsed_s:.1f} s)"]
        lines += [f"  {name}: {t / 1e3:.1f} us per instance" for name, t in self.times_ns.items()]
        lines += [f"  skipped {name}: {why}" for name, why in self.too_large]
        lines += [f"  could not measure {name}: {why}" for name, why in self.failed]
        return "\n".join(lines)


def collect_blocks(store: Store, analysis: Any, bindings: Mapping[sympy.Symbol, int],
                   device: Union[str, torch.device] = "cpu", budget_s: Optional[float] = None,
                   progress: Union[bool, Progress, None] = None, **timing: Any) -> BlockCollectResult:
    """Measure instance 0 of every block class of ``analysis`` at ``bindings`` on ``device``; one row each.

    Args:
        store: the database (opened here if not already).
        analysis: an ``Analysis`` of the program (its block pass and evaluator are used).
        bindings: the target sizes (``resolve_bindings``).
        device: the local device to run on.
        budget_s: do not start a new class after this many seconds.
        progress: as in ``collect_calls``.
        timing: keyword arguments for ``block_runner.time_block`` (``target_s``, ``min_runs``...).
    """
    start = time.monotonic()
    dev = torch.device(device)
    fingerprint = current_fingerprint(dev)
    ev = analysis.evaluator(bindings)
    classes = list(analysis.blocks.classes)
    measured: list[str] = []
    skipped: list[str] = []
    too_large: list[tuple[str, str]] = []
    failed: list[tuple[str, str]] = []
    times: dict[str, float] = {}
    bar = progress if isinstance(progress, Progress) else Progress(
        len(classes), desc=f"blocks {fingerprint.device_name}", enabled=None if progress is None else bool(progress))
    with store, bar:
        present = store.key_hashes(fingerprint)
        for i, cls in enumerate(classes):
            if budget_s is not None and time.monotonic() - start >= budget_s:
                return BlockCollectResult(tuple(measured), tuple(skipped), tuple(too_large), tuple(failed),
                                          tuple(c.name for c in classes[i:]), time.monotonic() - start, times)
            try:
                block = extract_block(analysis.program, cls, ev, dev)
                key = block_key(block)
                if key.key_hash in present:
                    skipped.append(cls.name)
                    continue
                m = time_block(block, make_block_inputs(block, dev), dev, **timing)
            except BlockTooLargeError as exc:
                too_large.append((cls.name, str(exc)))
            except Exception as exc:  # noqa: BLE001 - a block that cannot run is reported, never stored
                failed.append((cls.name, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
            else:
                store.put(m.record(fingerprint, key))
                measured.append(cls.name)
                times[cls.name] = m.median_ns
            finally:
                bar.update(note=cls.name)
    return BlockCollectResult(tuple(measured), tuple(skipped), tuple(too_large), tuple(failed), (),
                              time.monotonic() - start, times)


# ---------------------------------------------------------------------------------------------------
# The analysis hook
# ---------------------------------------------------------------------------------------------------
def measured_block_times(analysis: Any, bindings: Mapping[sympy.Symbol, int]) -> dict[int, KernelRecord]:
    """class index -> the block row measured for it at ``bindings`` on the analysis' device (if any)."""
    from boomfx.pricing import resolve_db_path
    if not analysis.blocks.classes:
        return {}
    path = resolve_db_path(analysis.options.db, analysis.device)
    if path is None:
        return {}
    rows = block_records(Store(path), analysis.device)
    if not rows:
        return {}
    ev = analysis.evaluator(bindings)
    found = {}
    for c, cls in enumerate(analysis.blocks.classes):
        key = block_key(extract_block(analysis.program, cls, ev, build=False))
        if key.key_hash in rows:
            found[c] = rows[key.key_hash]
    return found


def apply_block_measurements(analysis: Any, bindings: Mapping[sympy.Symbol, int], kernels: Sequence[Any],
                             scheduled: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``kernels`` (KernelReport) and ``scheduled`` (ScheduledKernel, index-aligned) with every instance of a
    measured block scaled to the measured time: kernel i of an instance gets
    ``measured_ns * t_i / sum(t)`` (equal shares when the per-kernel prices sum to 0), source "block-measured".
    """
    kernels, scheduled = list(kernels), list(scheduled)
    if not kernels:
        return kernels, scheduled
    rows = measured_block_times(analysis, bindings)
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


__all__ = ["BLOCK_OP", "BlockCollectResult", "apply_block_measurements", "block_key", "block_records",
           "collect_blocks", "is_block_record", "measured_block_times"]
