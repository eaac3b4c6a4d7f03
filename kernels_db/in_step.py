"""Kernel times inside the step: every kernel of a program timed while the program's other kernels run
between two of its calls, as they do in a real step.

Why: ``Measurer`` times one kernel over and over; between two samples nothing else runs, so the kernel's
code, its branch history, its operands' cache lines and their TLB entries stay hot. A real eager step
runs hundreds of other kernels in between. Measured on this repository's 2-vCPU development VM (AMD
EPYC, 1 MiB L2 per core, 32 MiB L3; an ad-hoc run when the rotation was added, no results file), the
same aten calls with the same tensors, timed one by one inside a real eager forward, took 1.2-1.4x their looped time for
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

With the calls' operands (``passes/operands.py``, which program value each argument is) the rotation
hands each call the tensors a real step would (``_OperandFlow``): the output its producer just wrote,
the parameter, gradient and optimizer state the previous op just updated in place, and releases a
produced value after its last reader, as the step frees it. Without them the loop of torch.optim
(AdamW's per-parameter ops, eager's default on a CPU) was priced as if every op read its tensors
from memory: on a 2-layer Llama (hidden 256, vocabulary 4096), summed over its keys at one thread,
``addcmul_`` 1.49 ms own against 0.55 ms with the flow (0.30 ms profiled in the real step at two),
``addcdiv_`` 1.48 against 1.02 ms (0.58 ms); and a fresh 8 MiB gradient, read by
``_log_softmax_backward_data`` while the step holds its other activations, costs what the real step
pays (1.16 ms own, 4.70 ms with the flow; 2.5-2.8 ms profiled at two threads).
``benchmarks/results/in_step_flow.md`` (five models' training steps, four held out, torch's threads):
the optimizer phase +6..+40% over the real ``opt.step()`` with each call's own tensors, -4.5..-11.4%
with the flow (the real one also runs the loop's Python); whole steps within the VM's noise either way
(median |error| 4.2% own, 5.0% flow; mean signed +1.1%, +1.0%).

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
- Compiled groups (``--compile``) get operands too (``passes/operands.py`` names a fused node's tensor
  inputs in its OpCall's order): a group reads the activation its producer just wrote, rebound with the
  layout it was compiled for (a view of the producer's storage with the group's own strides, or its own
  tensor where the storage is too small). On a transformers ResNet's compiled inference this moved the
  prediction 3.33 -> 3.10 ms against real steps of 2.5-2.8 ms (2 threads, 2026-12-08).
- Integer and boolean arguments keep the call's own tensors (their contents are valid indices for that
  call); a call whose inputs are shared with another call's (past the budget) keeps them too.
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
from boomfx.passes.operands import Operand, Operands

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
                 timed_call: Callable[[Any, list, dict], Callable[[], object]] = Measurer.timed_call,
                 operands: Optional[Sequence[Optional[Operands]]] = None) -> InStepTimes:
    """Time every call of ``calls`` (a program's kernels, in program order, sizes bound) where it stands
    in the step: timed passes over the whole sequence after ``warmup_passes``, at least ``min_passes``
    and until ``target_s`` of timed passes (a short step's samples are many: this VM's noise moved
    one collection's total by 10-20% at 8 passes of a 3 ms step), at most ``max_passes``.

    ``operands`` (aligned with ``calls``; ``passes/operands.py``): which program values each call reads
    and writes. With them each call is handed, before it is timed, the floating-point tensors the
    step's earlier calls left (an output the previous call just wrote, the parameter and state the
    optimizer's previous op just updated: ``_OperandFlow``) instead of its own synthetic ones.

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
    runs: list[_Run] = []
    spent = 0
    for index, call in enumerate(calls):
        try:
            key = kernel_key(call)
        except (SymbolicKeyError, UnkeyableCallError):
            continue    # priced by its roofline: nothing to time
        if key.key_hash in failed:
            continue
        inputs = built.get(key.key_hash)
        need = input_bytes(key)
        fresh = False
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
            fresh = True
            built.setdefault(key.key_hash, inputs)
        op, args, kwargs = inputs
        try:
            fn = timed_call(op, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. a fused group that does not compile
            failed[key.key_hash] = f"{type(exc).__name__}: {exc}"
            continue
        # a call sharing another call's inputs (over the budget) keeps them: rebinding would rebind both
        flow = operands[index] if operands is not None and fresh else None
        runs.append(_Run(key.key_hash, fn, _slots(args, kwargs) if flow is not None else [], flow))
    samples: dict[str, list[float]] = defaultdict(list)
    operand_flow = _OperandFlow(runs)
    previous_denormal = torch.set_flush_denormal(True)   # in-place calls repeated must not drift into denormals
    try:
        with torch.no_grad():
            for _ in range(warmup_passes):
                _one_pass(runs, failed, None, operand_flow)
            timed_ns = 0.0
            passes = 0
            while passes < max_passes and (passes < min_passes or timed_ns < target_s * 1e9):
                timed_ns += _one_pass(runs, failed, samples, operand_flow, clock)
                passes += 1
    finally:
        torch.set_flush_denormal(previous_denormal)
    ok = {h: s for h, s in samples.items() if h not in failed and s}
    return InStepTimes(ok, failed)


@dataclass
class _Run:
    """One call of the rotation: its key, what a sample calls, where its tensors sit in its arguments (in
    key order, ``_slots``) and its operands (None: it keeps its own inputs)."""

    key_hash: str
    fn: Callable[[], object]
    slots: list[tuple[Any, Any]]
    operands: Optional[Operands]

    def __post_init__(self) -> None:
        self.own = [container[index] for container, index in self.slots]   # restored after each call


def _slots(args: list, kwargs: dict) -> list[tuple[Any, Any]]:
    """(container, index) of every tensor in ``args`` then ``kwargs``, lists flattened: the kernel key's
    tensor order (``make_inputs`` fills the op's schema in order, keyword-only arguments last)."""
    found: list[tuple[Any, Any]] = []

    def walk(container: Any, index: Any) -> None:
        value = container[index]
        if isinstance(value, torch.Tensor):
            found.append((container, index))
        elif isinstance(value, list):
            for i in range(len(value)):
                walk(value, i)

    for i in range(len(args)):
        walk(args, i)
    for name in kwargs:
        walk(kwargs, name)
    return found


class _OperandFlow:
    """The tensors a real step would hand each call: every program value a call produces or is first
    given, kept by name (and its storage by the name of the value owning it) until the last call of the
    pass that reads that storage, as the step frees it.

    Before a call runs, each floating-point argument slot whose value is known gets that tensor (same
    shape, strides and dtype) or a view of its storage made with the argument's own strides; integer and
    boolean tensors keep the call's own (their contents are valid indices for that call only). A slot
    with nothing known yet gets the call's own tensor, which then stands for that value (a parameter,
    an optimizer state or a gradient read by several calls is then one tensor, updated in place where
    the step updates it). After the call its outputs become their values."""

    def __init__(self, runs: Sequence[_Run]) -> None:
        self._values: dict[str, torch.Tensor] = {}
        self._storages: dict[str, torch.Tensor] = {}
        self._names_of: dict[str, set[str]] = defaultdict(set)
        # fresh storages the calls produce (an in-place write's output keeps its argument's storage)
        produced: set[str] = {o.storage for r in runs if r.operands for o in r.operands.outputs
                              if o is not None and o.storage == o.value}
        last_use: dict[str, int] = {}
        for i, r in enumerate(runs):
            if r.operands is None:
                continue
            if len(r.operands.inputs) < len(r.slots):   # not aligned with the key (a context tensor...): own inputs
                r.operands = None
                continue
            for operand in r.operands.inputs:
                if operand is not None:
                    last_use[operand.storage] = i
        # a storage produced within the pass is released after its last reader, as the step frees it
        self._release: dict[int, list[str]] = defaultdict(list)
        for storage, i in last_use.items():
            if storage in produced:
                self._release[i].append(storage)

    def before(self, run: _Run) -> None:
        """Hand ``run`` the tensors of its operands (outside the timed region)."""
        if run.operands is None:
            return
        for (container, slot), operand in zip(run.slots, run.operands.inputs):
            if operand is None:
                continue
            own = container[slot]
            if not (own.dtype.is_floating_point or own.dtype.is_complex):
                continue
            given = self._tensor_for(operand, own)
            if given is None:
                self._remember(operand.value, operand.storage, own)
            else:
                container[slot] = given

    def after(self, run: _Run, index: int, result: object) -> None:
        """Keep ``run``'s outputs as their values; release the storages no later call of the pass reads."""
        for (container, slot), own in zip(run.slots, run.own):   # its arguments hold nothing of the step's
            container[slot] = own
        if run.operands is not None:
            outputs = result if isinstance(result, (list, tuple)) else (result,)
            for output, value in zip(run.operands.outputs, outputs):
                if output is None or not isinstance(value, torch.Tensor):
                    continue
                self._values[output.value] = value
                self._names_of[output.storage].add(output.value)
                if output.storage == output.value:   # a fresh storage (a write in place keeps its argument's)
                    self._storages[output.storage] = value
                else:
                    self._storages.setdefault(output.storage, value)
        for storage in self._release.get(index, ()):
            self._storages.pop(storage, None)
            for name in self._names_of.pop(storage, ()):
                self._values.pop(name, None)

    def _remember(self, value: str, storage: str, tensor: torch.Tensor) -> None:
        self._values[value] = tensor
        self._names_of[storage].add(value)
        self._storages.setdefault(storage, tensor)

    def _tensor_for(self, operand: Operand, own: torch.Tensor) -> Optional[torch.Tensor]:
        known = self._values.get(operand.value)
        if known is not None and _same_layout(known, own):
            return known
        base = self._storages.get(operand.storage)
        if base is None or base.dtype != own.dtype or base.device != own.device:
            return None
        reach = own.storage_offset() + sum((s - 1) * st for s, st in zip(own.shape, own.stride())) + 1
        if min(own.shape, default=1) == 0 or reach * own.element_size() > base.untyped_storage().nbytes():
            return None
        view = base.as_strided(own.shape, own.stride(), own.storage_offset())
        self._remember(operand.value, operand.storage, view)
        return view


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()


def _one_pass(runs: Sequence[_Run], failed: dict[str, str], samples: Optional[dict[str, list[float]]],
              flow: _OperandFlow, clock: Callable[[], int] = time.perf_counter_ns) -> float:
    """Run every call once in order; with ``samples``, time each where it stands. Returns the time taken."""
    total = 0.0
    for index, run in enumerate(runs):
        if run.key_hash in failed:
            flow.after(run, index, None)
            continue
        flow.before(run)
        t0 = clock()
        try:
            result = run.fn()
        except Exception as exc:  # noqa: BLE001 - the key keeps its isolated row
            failed[run.key_hash] = f"{type(exc).__name__}: {exc}"
            flow.after(run, index, None)
            continue
        elapsed = float(clock() - t0)
        flow.after(run, index, result)
        del result
        total += elapsed
        if samples is not None:
            samples[run.key_hash].append(elapsed)
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


def collect_in_step(store: Store, calls: Sequence[OpCall], measurer: Measurer,
                    operands: Optional[Sequence[Optional[Operands]]] = None) -> int:
    """``time_in_step`` with ``measurer``'s clock (this thread's CPU time when it uses one) and its way of
    calling a kernel, then ``record_in_step`` over its fingerprint's rows: what ``boomfx kernels collect
    --for`` runs after the isolated measurements. Returns the rows rewritten."""
    clock = time.thread_time_ns if measurer.cpu_clock == "thread" else time.perf_counter_ns
    times = time_in_step(calls, measurer.device, clock=clock, timed_call=measurer.timed_call, operands=operands)
    return record_in_step(store, measurer.fingerprint(), times)

