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
``boomfx/analysis/block_mode.py:apply_block_measurements`` is the ``Analysis.evaluate`` hook: for a class with a row at these
bindings, the kernels of every instance keep their shares of the per-kernel prices but are scaled so
that the instance sums to the measured time, with source "block-measured".

Example::

    with Store(path) as store:
        result = collect_blocks(store, analysis, bindings, torch.device("cuda"))
    print(result.summary("gpt2.pt2", path))
    # later, boomfx analyze gpt2.pt2 --db path ... prices h.* instances as "block-measured"

Known limitations:
- Only the target device's own rows are used (matched by device name); block times are not
  transferred between GPUs (``--from-db``).
- A CPU block time includes dispatch, as CPU kernel rows do; the scaled kernels carry it.
- A class is keyed by its symbolic signature: a re-export that renames size symbols is a new class.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Union

import sympy
import torch

from boomfx.core.devices import DeviceSpec
from boomfx.core.program import Program
from boomfx.passes.blocks import BlockInfo
from boomfx.passes.evaluate import Evaluator
from boomfx.kernels_db.block_runner import BlockGraph, BlockTooLargeError, extract_block, make_block_inputs, \
    time_block
from boomfx.kernels_db.measure import current_fingerprint
from boomfx.kernels_db.progress import Progress
from boomfx.kernels_db.price import PriceSource
from boomfx.kernels_db.schema import BLOCK_OP, KernelKey, KernelRecord, canonical_json
from boomfx.kernels_db.store import Store

SOURCE_BLOCK_MEASURED = PriceSource.BLOCK_MEASURED.value   # the report's label (report.SOURCES)

class BlockAnalysis(Protocol):
    """What block collection reads of a symbolic analysis (boomfx/analysis/analysis.py:Analysis)."""

    program: Program
    blocks: BlockInfo
    device: DeviceSpec

    def evaluator(self, bindings: Mapping[sympy.Symbol, int]) -> Evaluator:
        ...




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


def block_records(store: Store, device_name: str) -> dict[str, KernelRecord]:
    """key_hash -> the newest block row measured on a device of that registry name."""
    with store:
        return {rec.key.key_hash: rec for rec in store.records(op=BLOCK_OP)
                if rec.fingerprint.device_name == device_name}


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


def collect_blocks(store: Store, analysis: BlockAnalysis, bindings: Mapping[sympy.Symbol, int],
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


__all__ = ["BLOCK_OP", "BlockAnalysis", "BlockCollectResult", "block_key", "block_records", "collect_blocks",
           "is_block_record"]
