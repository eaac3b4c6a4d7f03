"""Gradient accumulation without pipelining: ``M`` forward and backward passes, one optimizer step.

``--microbatches M`` without ``pp`` (``ParallelConfig.accumulation_steps``; torchtitan's
``global_batch / (local_batch x dp)`` accumulation steps, Megatron's micro-batches per step) runs the rank's
batch as ``M`` micro-batches of ``batch / M``. What the runtime does, and what is built from it:

- Every micro-batch runs the same forward and backward with the same collectives: torchtitan's train loop
  calls ``forward_backward_step`` per micro-batch with gradient synchronisation left on, so FSDP2 gathers
  and reduce-scatters and DDP all-reduces its buckets in each; FSDP2's post-backward waits for its
  reductions, so each micro-batch ends with them.
- The gradients accumulate into ``.grad``: the first micro-batch's become it (autograd's AccumulateGrad
  steals a fresh gradient, FSDP2 keeps a view of its reduce-scatter output); every later one is added in
  place and freed (FSDP2: ``sharded_param.grad += new``).
- One optimizer step at the end.

So the rank program of one micro-batch (the step at ``batch / M``) holds everything:

- **time** ``T = M x T_fb + T_opt``: ``T_fb`` the step up to its first optimizer op on the compute stream
  (the backward's reductions waited for: DDP's ``finalize_backward`` and FSDP2's root post-backward
  callback wait for them before ``optimizer.step()``), ``T_opt`` the rest (``accumulated_step_ns``);
  exposed and hidden communication ``M`` times one micro-batch's.
- **memory**: micro-batches 2..M run with every gradient alive from their start, each new gradient a
  temporary that its add frees; their peak is at least the first's, so it is the step's
  (``accumulating_liveness``: each gradient storage alive from the step's first op to its end, plus a
  temporary from its producer to the last backward op that writes or views it; the same memory report and
  allocator replay as any step).

Known limitations:
- NB: the allocator replay allocates the accumulated gradients at the micro-batch's start, where the first
  micro-batch allocated them during its backward: the segments they land in may differ from the real
  ones (reserved memory, not live bytes).
- NB: DDP's ``no_sync()`` (all-reduce only the last micro-batch, as nanoGPT does) is not modelled: every
  micro-batch is synchronised, as torchtitan runs it.
- NB: a loss scaled by ``1 / M`` per micro-batch adds one scalar op per micro-batch; not in the program.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Mapping, Optional

import sympy

from boomfx.core.program import PHASE_BACKWARD, PHASE_OPTIMIZER
from boomfx.passes.liveness import Category, LivenessInfo
from boomfx.report.model import MemoryReport


def accumulating_liveness(liveness: LivenessInfo, program: Any) -> LivenessInfo:
    """The liveness of a micro-batch after the first: every gradient storage alive from the first op to
    where it ended (``.grad`` holds the sum so far), and a temporary of its size from the op that produced
    it to the last backward op that writes or views it: autograd adds a gradient into ``.grad`` once it is
    complete (a tied weight's head and embedding parts summed first), FSDP2 once its reduce-scatter
    output is split into the parameters' views."""
    grads = {iv.storage_id: iv for iv in liveness.intervals if iv.category == Category.GRAD and not iv.resident}
    if not grads:   # DDP's gradient_as_bucket_view: the buckets (resident) hold them
        return liveness
    complete: dict[int, int] = {}
    for step, name in enumerate(liveness.order):
        if program.phases.get(name) != PHASE_BACKWARD:
            continue
        for sid in liveness.node_storages.get(name, ()):
            if sid in grads and step >= grads[sid].start_step:
                complete[sid] = step
    next_id = 1 + max(iv.storage_id for iv in liveness.intervals)
    held = tuple(replace(iv, storage_id=next_id + k, start_step=0) for k, iv in enumerate(grads.values()))
    intervals = tuple(replace(iv, end_step=min(iv.end_step, complete.get(iv.storage_id, iv.start_step)))
                      if iv.storage_id in grads else iv for iv in liveness.intervals)
    return replace(liveness, intervals=intervals + held)


def accumulated_memory(analysis: Any, bindings: Mapping[sympy.Symbol, int], replay_allocator: bool = True,
                       exact_total: bool = True, liveness: Optional[LivenessInfo] = None) -> MemoryReport:
    """The step's memory report under accumulation: the memory of a later micro-batch (module docstring),
    evaluated as ``analysis`` evaluates any step (kernel scratch, allocator replay on CUDA). ``liveness``:
    ``accumulating_liveness`` of the analysis when the caller keeps it."""
    later = copy.copy(analysis)
    later.liveness = liveness if liveness is not None else accumulating_liveness(analysis.liveness, analysis.program)
    return later.evaluate(bindings, memory_only=True, replay_allocator=replay_allocator,
                          exact_total=exact_total).report.memory


def forward_backward_ns(step: Any, program: Any) -> float:
    """When the step's first optimizer op starts on the compute stream (the whole step without one)."""
    starts = [s.start_ns for s in step.timeline.spans if program.phases.get(s.name) == PHASE_OPTIMIZER]
    return min(starts) if starts else step.step_ns


def accumulated_step_ns(step: Any, program: Any, microbatches: int) -> float:
    """``M x T_fb + T_opt`` of one micro-batch's simulated step (``rank_schedule.RankStep``)."""
    fb = forward_backward_ns(step, program)
    return microbatches * fb + (step.step_ns - fb)


def accumulated_time_row(row: dict[str, Any], step: Any, program: Any, microbatches: int) -> dict[str, Any]:
    """A ``time_report`` row of one micro-batch's step, made the accumulated step's: its time, the
    communication and collectives of every micro-batch, and the two parts it is built from."""
    fb = forward_backward_ns(step, program)
    runs = [c for c in row["collectives"]
            for _ in range(1 if program.phases.get(c["node"]) == PHASE_OPTIMIZER else microbatches)]
    return {**row, "step_time_ns": accumulated_step_ns(step, program, microbatches), "collectives": runs,
            "exposed_comm_ns": microbatches * row["exposed_comm_ns"],
            "hidden_comm_ns": microbatches * row["hidden_comm_ns"],
            "comm_cost_ns": microbatches * row["comm_cost_ns"],
            "accumulation": {"microbatches": microbatches, "forward_backward_ns": fb,
                             "optimizer_ns": step.step_ns - fb}}


def collective_weights(program: Any, microbatches: int) -> dict[str, float]:
    """How often each collective node runs in the accumulated step: every micro-batch outside the optimizer."""
    return {name: (1.0 if phase == PHASE_OPTIMIZER else float(microbatches))
            for name, phase in program.phases.items()}
