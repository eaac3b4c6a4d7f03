"""The shared collection driver: measure each unique kernel key once, resumably, within a time budget.

Two modes:

- ``collect_calls(store, calls, ...)``: the kernels of a real program (OpCalls with int sizes, e.g.
  from ``calls_from_graph``), so the database holds exactly what a model needs.
- ``collect_sweep(store, ...)``: model-free; the family grids of ``collectors/``.

Each measurement is committed on completion (``Store.put`` = one transaction), and keys the store
already has for this fingerprint are skipped, so a killed collection loses at most the kernel in
flight and a rerun measures only what is missing. Kernels that fail to run (unsupported op, invalid
synthetic inputs) are reported in ``CollectResult.failed``; they are never stored as a fake number.

Example::

    with Store(default_db_path("cpu")) as store:
        result = collect_sweep(store, "cpu", families=["matmul"], dtypes=[torch.float32], budget_s=600)
        print(result.measured, result.skipped, len(result.failed))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

import sympy
import torch
import torch.fx

from boomfx.kernels_db import collectors
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.measure import Measurer
from boomfx.kernels_db.plausibility import PlausibilityCheck, Rejection
from boomfx.kernels_db.progress import Progress
from boomfx.kernels_db.schema import KernelKey
from boomfx.kernels_db.store import Store
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.opcall import bind_call, opcall_from_node


@dataclass(frozen=True)
class CollectResult:
    """What one collection did. ``pending`` keys were left unmeasured because the budget ran out."""

    measured: int
    skipped: int
    failed: tuple[tuple[KernelKey, str], ...] = ()
    pending: int = 0
    elapsed_s: float = 0.0
    measured_keys: tuple[str, ...] = field(default=(), repr=False)
    rejected: tuple[Rejection, ...] = ()   # measured but implausible, not stored (kernels_db/plausibility.py)


def unique_keys(calls: Iterable[OpCall]) -> list[KernelKey]:
    """Keys of ``calls`` in first-seen order, each once; a symbolic call raises ``SymbolicKeyError``."""
    seen: dict[str, KernelKey] = {}
    for call in calls:
        key = kernel_key(call)
        seen.setdefault(key.key_hash, key)
    return list(seen.values())


def collect_keys(
    store: Store,
    keys: Sequence[KernelKey],
    measurer: Measurer,
    budget_s: Optional[float] = None,
    progress: Union[bool, Progress, None] = None,
    calls: Optional[Mapping[str, OpCall]] = None,
    check_plausible: bool = True,
) -> CollectResult:
    """Measure the keys the store lacks (for the measurer's fingerprint), committing each as it finishes.

    Implausible measurements (``plausibility.py``: far slower than the roofline of their work, or far slower
    than a larger call of the same op) are refused and listed in ``CollectResult.rejected``; a row that a
    later, larger measurement shows to be implausible is removed again before this returns. ``calls``
    (key_hash -> OpCall) spares rebuilding each key's call for the roofline check. ``check_plausible=False``
    stores every measurement: for a database read for its workspaces only (the gloo memory checks, whose
    one-sample times on a loaded machine are meant to be rough), never for one that prices time.
    """
    start = time.monotonic()
    fingerprint = measurer.fingerprint()
    calls = calls or {}
    with store:
        present = store.key_hashes(fingerprint)
        check = PlausibilityCheck(fingerprint, store.records(fingerprint))
        todo = [k for k in keys if k.key_hash not in present]
        skipped = len(keys) - len(todo)
        bar = (
            progress
            if isinstance(progress, Progress)
            else Progress(
                len(todo),
                desc=f"collect {fingerprint.device_name}",
                enabled=None if progress is None else bool(progress),
            )
        )
        failed: list[tuple[KernelKey, str]] = []
        rejected: list[Rejection] = []
        done: list[str] = []
        pending = 0
        with bar:
            for i, key in enumerate(todo):
                if budget_s is not None and time.monotonic() - start >= budget_s:
                    pending = len(todo) - i
                    break
                try:
                    measurement = measurer.measure(key)
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is reported, not stored
                    failed.append((key, f"{type(exc).__name__}: {exc}"))
                else:
                    why = (check.check(key, measurement.median_ns, measurement.host_ns, calls.get(key.key_hash))
                           if check_plausible else None)
                    if why is not None:
                        rejected.append(Rejection(key, why))
                    else:
                        store.put(measurement.record(fingerprint, key))
                        done.append(key.key_hash)
                bar.update(note=key.op)
        by_hash = {k.key_hash: k for k in todo}
        # a larger call measured after a smaller one
        for key_hash, why in check.inversions(done) if check_plausible else ():
            store.delete(fingerprint, key_hash)
            check.forget(key_hash)
            rejected.append(Rejection(by_hash[key_hash], why))
        removed = {r.key.key_hash for r in rejected}
        done = [h for h in done if h not in removed]
    return CollectResult(len(done), skipped, tuple(failed), pending, time.monotonic() - start, tuple(done),
                         tuple(rejected))


def collect_calls(
    store: Store,
    calls: Iterable[OpCall],
    device: Union[str, torch.device] = "cpu",
    budget_s: Optional[float] = None,
    progress: Union[bool, Progress, None] = None,
    measurer: Optional[Measurer] = None,
    check_plausible: bool = True,
) -> CollectResult:
    """Measure every unique kernel among ``calls`` that ``store`` does not have yet.

    Args:
        store: the device's database (opened here if not already).
        calls: OpCalls with concrete sizes.
        device: where to measure; ignored when ``measurer`` is given.
        budget_s: stop starting new measurements after this many seconds (the one in flight finishes).
        progress: True/False to force the stderr bar on/off; None = on when stderr is a terminal.
        measurer: a configured ``Measurer`` (or any object with ``measure``/``fingerprint``).
        check_plausible: refuse implausible times (``collect_keys``).
    """
    measurer = measurer if measurer is not None else Measurer(device)
    calls = list(calls)
    by_hash: dict[str, OpCall] = {}
    for call in calls:
        by_hash.setdefault(kernel_key(call).key_hash, call)
    return collect_keys(store, unique_keys(calls), measurer, budget_s, progress, calls=by_hash,
                        check_plausible=check_plausible)


def sweep_calls(
    families: Optional[Sequence[str]] = None,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    grid: str = "small",
) -> list[OpCall]:
    """Every call of the chosen family grids (all families by default), families interleaved
    round-robin so that a sweep cut short by its budget still covers every family."""
    per_family: list[list[OpCall]] = []
    for name in families or collectors.FAMILIES:
        module = collectors.family(name)
        per_family.append([module.make_call(cfg) for cfg in module.configs(dtypes, grid)])
    calls: list[OpCall] = []
    for i in range(max((len(f) for f in per_family), default=0)):
        calls.extend(f[i] for f in per_family if i < len(f))
    return calls


def collect_sweep(
    store: Store,
    device: Union[str, torch.device] = "cpu",
    families: Optional[Sequence[str]] = None,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    budget_s: Optional[float] = None,
    grid: Optional[str] = None,
    progress: Union[bool, Progress, None] = None,
    measurer: Optional[Measurer] = None,
) -> CollectResult:
    """Model-free collection over the family grids; ``grid`` defaults to "small" on CPU, "large" on CUDA."""
    dev = torch.device(device)
    grid = grid or ("large" if dev.type == "cuda" else "small")
    return collect_calls(store, sweep_calls(families, dtypes, grid), dev, budget_s, progress, measurer)


def calls_from_graph(
    graph_module: torch.fx.GraphModule, bindings: Optional[Mapping[sympy.Symbol, int]] = None
) -> list[OpCall]:
    """OpCalls of every aten call in a graph, with symbols bound (``bindings``) to concrete ints.

    ``bindings`` maps the graph's size symbols (``s0``...) to ints; a static-shape export needs none.
    """
    subs = dict(bindings or {})
    calls = []
    for node in graph_module.graph.nodes:
        call = opcall_from_node(node)
        if call is not None:
            calls.append(bind_call(call, Evaluator(subs)) if subs else call)
    return calls
