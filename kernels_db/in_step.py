"""Kernel times inside the step: every kernel of a program timed while the program's other kernels run
between two of its calls, as they do in a real step.

Why: ``Measurer`` times one kernel over and over; between two samples nothing else runs, so the kernel's
code, its branch history, its operands' cache lines and their TLB entries stay hot. A real eager step
runs hundreds of other kernels in between. Measured on this repository's 2-vCPU development VM (AMD
EPYC, 1 MiB L2 per core, 32 MiB L3; ``benchmarks/results/in_step.md``), the same aten calls with the
same tensors, timed one by one inside a real eager forward, took 1.2-1.4x their looped time for
matmuls, convolutions and norms and 2-4x for small pointwise ops (ConvNeXt: 3.08 ms in situ against
2.31 ms looped; MobileNetV2: 10.4 ms against 7.9 ms), at one thread as at two. No single cache flush
before each sample reproduces it (a flush of 8 MiB gave 2.66 ms, 32 MiB 4.55 ms), nor running the
kernel's real predecessor before it (2.48 ms) or a burst of tiny other ops (2.65 ms); running the
program's calls in order, each once per pass, does (3.16 ms and 9.69 ms).

So ``time_in_step`` builds inputs for every call of the program (``keys.make_inputs``: each call its own
tensors, as each layer has its own weights and activations, while they fit ``input_budget_bytes``; past
it, later calls of a key already built share its inputs and a key not built yet is left out, keeping its
isolated price: the rotation never holds more than the budget), runs the calls in program order for ``warmup_passes +
passes`` passes, and times each call where it stands. A key's in-step time is the median of all its
calls' samples. ``record_in_step`` writes it over the key's isolated row (kept: workspace and host
issue time come from the isolated measurement), labelled ``source + IN_STEP_SUFFIX``; the pricer
reports such rows as ``PriceSource.MEASURED_IN_STEP`` and ``boomfx/analysis/host_time.py`` charges
them no op switch and no cold start (the price already holds what the kernels before it left).

``boomfx kernels collect --for`` runs it on a CPU after the isolated measurements (``--no-in-step`` skips
it); with ``--compile`` the rotation calls each fused group's compiled callable (``FusedMeasurer.timed_call``).

Known limitations:
- An interpolated price (``lookup.py``) from in-step rows is labelled ``interpolated`` and still gets the
  op switch and cold start on top (counted twice, ~1-25 us per kernel).
- The rotation runs the whole step at least ``warmup_passes + min_passes`` times, outside ``--budget``.
- Only the priced kernels run: aliasing ops, the autograd engine and Python between kernels are not in
  the rotation (``host_time`` adds them as before).
- Calls beyond ``input_budget_bytes`` (2 GiB) reuse a built call's inputs, so a very large program's rotation
  touches fewer distinct bytes than its step, and keys first met past it (a large model's foreach
  optimizer ops: every parameter, gradient and state, per op) keep their isolated prices. Measured: GPT-2
  small training (batch 2, seq 128) peaked at 10.9 GB resident before this cap.
- Each call reads synthetic inputs, not its predecessor's output: an activation the previous kernel
  just wrote is read warm in a real step and from wherever the rotation left it here. Suspected where
  compiled convolutional networks come out over (MobileNetV2 compiled inference +23% against -36%
  isolated, benchmarks/results/broad_cpu_accuracy.md).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from boomfx.kernels_db.keys import SymbolicKeyError, UnkeyableCallError, input_bytes, kernel_key, make_inputs
from boomfx.kernels_db.measure import Measurer, summarize
from boomfx.kernels_db.schema import IN_STEP_SUFFIX, DeviceFingerprint, is_in_step_source
from boomfx.kernels_db.store import Store
from boomfx.passes.costs.registry import OpCall

DEFAULT_INPUT_BUDGET_BYTES = 2 << 30


@dataclass(frozen=True)
class InStepTimes:
    """Samples (ns) per key hash, and the keys left out with why: inputs that could not be built or did
    not fit the budget, a call that failed."""

    samples: dict[str, list[float]]
    failed: dict[str, str]


def time_in_step(calls: Sequence[OpCall], device: torch.device | str = "cpu", *, min_passes: int = 8,
                 max_passes: int = 100, target_s: float = 1.0, warmup_passes: int = 2,
                 clock: Optional[Callable[[], int]] = None,
                 input_budget_bytes: int = DEFAULT_INPUT_BUDGET_BYTES,
                 timed_call: Callable[[Any, list, dict], Callable[[], object]] = Measurer.timed_call) -> InStepTimes:
    """Time every call of ``calls`` (a program's kernels, in program order, sizes bound) where it stands
    in the step: timed passes over the whole sequence after ``warmup_passes``, at least ``min_passes``
    and until ``target_s`` of timed passes (a short step's samples are many: this VM's noise moved
    one collection's total by 10-20% at 8 passes of a 3 ms step), at most ``max_passes``.

    ``clock`` defaults to wall time (``time.perf_counter_ns``); with one intra-op thread the collector
    passes this thread's CPU time, as ``Measurer`` does. ``timed_call`` turns a key's inputs into what one
    sample calls, as the measurer of that kind of kernel does (``FusedMeasurer.timed_call``: a compiled
    group's callable, as Inductor's graph calls it). Calls without a fixed key (a data-dependent size)
    are not run.
    """
    device = torch.device(device)
    clock = clock or time.perf_counter_ns
    built: dict[str, tuple] = {}
    failed: dict[str, str] = {}
    runs: list[tuple[str, Callable[[], object]]] = []
    spent = 0
    for call in calls:
        try:
            key = kernel_key(call)
        except (SymbolicKeyError, UnkeyableCallError):
            continue    # priced by its roofline: nothing to time
        if key.key_hash in failed:
            continue
        inputs = built.get(key.key_hash)
        need = input_bytes(key)
        if spent + need > input_budget_bytes:
            if inputs is None:   # never more than the budget: the key keeps its isolated row
                failed[key.key_hash] = f"inputs of {need} bytes over the rotation's budget ({input_budget_bytes} bytes)"
                continue
        else:
            try:
                inputs = make_inputs(key, device, seed=len(runs))
            except Exception as exc:  # noqa: BLE001 - a key that cannot be built keeps its isolated row
                failed[key.key_hash] = f"{type(exc).__name__}: {exc}"
                continue
            spent += need
            built.setdefault(key.key_hash, inputs)
        op, args, kwargs = inputs
        try:
            runs.append((key.key_hash, timed_call(op, args, kwargs)))
        except Exception as exc:  # noqa: BLE001 - e.g. a fused group that does not compile
            failed[key.key_hash] = f"{type(exc).__name__}: {exc}"
    samples: dict[str, list[float]] = defaultdict(list)
    previous_denormal = torch.set_flush_denormal(True)   # in-place calls repeated must not drift into denormals
    try:
        with torch.no_grad():
            for _ in range(warmup_passes):
                _one_pass(runs, failed, None)
            timed_ns = 0.0
            passes = 0
            while passes < max_passes and (passes < min_passes or timed_ns < target_s * 1e9):
                timed_ns += _one_pass(runs, failed, samples, clock)
                passes += 1
    finally:
        torch.set_flush_denormal(previous_denormal)
    ok = {h: s for h, s in samples.items() if h not in failed and s}
    return InStepTimes(ok, failed)


def _one_pass(runs: Sequence[tuple[str, Callable[[], object]]], failed: dict[str, str],
              samples: Optional[dict[str, list[float]]], clock: Callable[[], int] = time.perf_counter_ns) -> float:
    """Run every call once in order; with ``samples``, time each where it stands. Returns the time taken."""
    total = 0.0
    for key_hash, fn in runs:
        if key_hash in failed:
            continue
        t0 = clock()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the key keeps its isolated row
            failed[key_hash] = f"{type(exc).__name__}: {exc}"
            continue
        elapsed = float(clock() - t0)
        total += elapsed
        if samples is not None:
            samples[key_hash].append(elapsed)
    return total


def record_in_step(store: Store, fingerprint: DeviceFingerprint, times: InStepTimes) -> int:
    """Write each in-step time over the key's isolated row of ``fingerprint`` (keys without one are left
    alone: a kernel that failed or was refused in isolation gets no in-step price either). Returns the
    rows written."""
    written = 0
    with store:
        for record in store.records(fingerprint):
            samples = times.samples.get(record.key.key_hash)
            if not samples:
                continue
            median, p10, p90 = summarize(samples)
            base = record.source[: -len(IN_STEP_SUFFIX)] if is_in_step_source(record.source) else record.source
            store.put(replace(record, median_ns=median, p10_ns=p10, p90_ns=p90, n_runs=len(samples),
                              source=base + IN_STEP_SUFFIX))
            written += 1
    return written


def collect_in_step(store: Store, calls: Sequence[OpCall], measurer: Measurer) -> int:
    """``time_in_step`` with ``measurer``'s clock (this thread's CPU time when it uses one) and its way of
    calling a kernel, then ``record_in_step`` over its fingerprint's rows: what ``boomfx kernels collect
    --for`` runs after the isolated measurements. Returns the rows rewritten."""
    clock = time.thread_time_ns if measurer.cpu_clock == "thread" else time.perf_counter_ns
    times = time_in_step(calls, measurer.device, clock=clock, timed_call=measurer.timed_call)
    return record_in_step(store, measurer.fingerprint(), times)

