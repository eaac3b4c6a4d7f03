"""Pipeline-parallel schedules (GPipe, 1F1B, interleaved 1F1B) simulated per stage and micro-batch.

A pure function of its arguments: ``simulate_pipeline(schedule, stages, microbatches, chunks)`` orders each
physical stage's forward (F) and backward (B) passes as the schedule does, then places every pass at
``max(its stage is free, its inputs have arrived)``:

- F of micro-batch i on virtual stage k needs F(i, k-1) done plus the activation send of stage k-1;
- B(i, k) needs B(i, k+1) done plus the gradient's send back over stage k's link (``stages[k].send_ns``: the
  gradient of stage k's output has its shape); the last stage's B needs its own F.

Virtual stage k (model order, ``len(stages) = p * chunks``) runs on physical stage ``k % p`` (Megatron's
interleaving: chunk c of stage s is virtual stage ``c * p + s``). Orders:

- ``gpipe``: all forwards, then all backwards (torch.distributed.pipelining ``ScheduleGPipe``);
- ``1f1b``: ``p - s - 1`` warm-up forwards on stage s, then one forward / one backward, then the remaining
  backwards (PipeDream-flush, ``Schedule1F1B``);
- ``interleaved``: Megatron-LM's interleaved 1F1B (``ScheduleInterleaved1F1B``): ``(p - s - 1) * 2 +
  (chunks - 1) * p`` warm-up forwards, micro-batches taken p at a time through every chunk; needs
  ``microbatches % p == 0``.

With every stage costing f forward and b backward and free sends, GPipe and 1F1B take ``(m + p - 1)(f + b)``:
bubble fraction ``(p - 1) / (m + p - 1)``; interleaving with v chunks (each ``f/v``, ``b/v``) cuts it to
``(p - 1) / (v m + p - 1)``. ``peak_in_flight`` is the most micro-batches whose forward is done and backward
is not, per stage (their activations are alive: m for GPipe, ``p - s`` for 1F1B).

Example::

    >>> t = simulate_pipeline("1f1b", [StageCosts(1.0, 2.0)] * 4, microbatches=8)
    >>> t.total_ns, round(t.bubble_fraction, 4)
    (33.0, 0.2727)

Known limitations:
- A send occupies neither stage (it overlaps compute, as with separate NCCL streams); sends of one stage do
  not queue behind each other.
- No weight-gradient split (zero-bubble schedules) and no optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from boomfx.core.errors import BoomfxError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
FORWARD, BACKWARD = "F", "B"


class PipelineError(BoomfxError):
    """A pipeline that cannot be scheduled as asked."""


@dataclass(frozen=True)
class StageCosts:
    """One virtual stage: its forward and backward time per micro-batch and the time to hand its output on."""

    forward_ns: float
    backward_ns: float
    send_ns: float = 0.0


@dataclass(frozen=True)
class PipelinePass:
    kind: str            # "F" or "B"
    microbatch: int
    virtual_stage: int


@dataclass(frozen=True)
class PlacedPass:
    stage: int
    step: PipelinePass
    start_ns: float
    end_ns: float


@dataclass(frozen=True)
class PipelineTimeline:
    total_ns: float
    busy_ns: tuple[float, ...]          # per physical stage
    passes: tuple[PlacedPass, ...]
    peak_in_flight: tuple[int, ...]     # per physical stage

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages over the step: ``1 - sum(busy) / (p * total)``."""
        if self.total_ns <= 0:
            return 0.0
        return 1.0 - sum(self.busy_ns) / (len(self.busy_ns) * self.total_ns)


def stage_orders(schedule: str, p: int, m: int, chunks: int = 1) -> list[list[PipelinePass]]:
    """Each physical stage's passes in the order the schedule runs them."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule '{schedule}' (known: {', '.join(SCHEDULES)})")
    if p < 1 or m < 1 or chunks < 1:
        raise PipelineError(f"need at least one stage, micro-batch and chunk, got p={p} m={m} chunks={chunks}")
    if schedule != "interleaved" and chunks != 1:
        raise PipelineError(f"{schedule} runs one chunk per stage; use 'interleaved' for {chunks}")
    if schedule == "interleaved":
        return [_interleaved(s, p, m, chunks) for s in range(p)]
    orders = []
    for s in range(p):
        fwd = [PipelinePass(FORWARD, i, s) for i in range(m)]
        bwd = [PipelinePass(BACKWARD, i, s) for i in range(m)]
        if schedule == "gpipe":
            orders.append(fwd + bwd)
            continue
        warmup = min(p - s - 1, m)
        order = fwd[:warmup]
        for i in range(m - warmup):
            order += [fwd[warmup + i], bwd[i]]
        orders.append(order + bwd[m - warmup:])
    return orders


def unshard_reshard(order: Sequence[PipelinePass], max_active: int = 3) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """What torch's pipeline runtime (``_PipelineScheduleRuntime``, torch 2.13) does with FSDP-wrapped chunks
    before each pass of a rank's ``order``: it keeps the next ``max_active`` distinct virtual stages the rank
    computes on gathered; before a pass it reshards the gathered ones not among them, then all-gathers those
    among them not gathered yet, in the order they come. Returned per pass: (resharded, all-gathered)."""
    active: list[int] = []
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for i in range(len(order)):
        upcoming: list[int] = []
        for later in order[i:]:
            if later.virtual_stage not in upcoming:
                upcoming.append(later.virtual_stage)
                if len(upcoming) == max_active:
                    break
        evict = tuple(sorted(k for k in active if k not in upcoming))
        fetch = tuple(k for k in upcoming if k not in active)
        active = [k for k in active if k in upcoming] + list(fetch)
        out.append((evict, fetch))
    return out


def _interleaved(s: int, p: int, m: int, v: int) -> list[PipelinePass]:
    """Megatron's order: the k-th forward of a stage is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p;
    backwards walk the chunks in reverse."""
    if m % p:
        raise PipelineError(f"interleaved 1F1B needs micro-batches ({m}) to be a multiple of stages ({p})")
    total = m * v

    def unit(k: int, backward: bool) -> PipelinePass:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        micro = (k // (p * v)) * p + k % p
        return PipelinePass(BACKWARD if backward else FORWARD, micro, chunk * p + s)

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [unit(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit(warmup + k, False), unit(k, True)]
    return order + [unit(k, True) for k in range(total - warmup, total)]


def simulate_pipeline(schedule: str, stages: Sequence[StageCosts], microbatches: int,
                      chunks: int = 1) -> PipelineTimeline:
    """Place every pass of ``schedule`` (see the module docstring); ``stages`` are the virtual stages in model
    order (``p * chunks`` of them)."""
    if chunks < 1 or len(stages) % chunks or not stages:
        raise PipelineError(f"{len(stages)} virtual stages do not split into {chunks} chunks per stage")
    p = len(stages) // chunks
    last = len(stages) - 1
    orders = stage_orders(schedule, p, microbatches, chunks)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    busy = [0.0] * p
    nxt = [0] * p
    placed: list[PlacedPass] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                step = orders[s][nxt[s]]
                ready = _ready_ns(step, stages, done, last)
                if ready is None:
                    break
                cost = stages[step.virtual_stage]
                duration = cost.forward_ns if step.kind == FORWARD else cost.backward_ns
                start = max(free[s], ready)
                free[s] = start + duration
                busy[s] += duration
                done[(step.kind, step.microbatch, step.virtual_stage)] = free[s]
                placed.append(PlacedPass(s, step, start, free[s]))
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PipelineError(f"{schedule} deadlocks with p={p}, m={microbatches}, chunks={chunks}")
    return PipelineTimeline(max(free), tuple(busy), tuple(sorted(placed, key=lambda x: (x.start_ns, x.stage))),
                            _peak_in_flight(orders))


def _ready_ns(step: PipelinePass, stages: Sequence[StageCosts], done: dict, last: int) -> Optional[float]:
    """When the inputs of ``step`` are on its stage, or None if a producer has not run yet."""
    k, i = step.virtual_stage, step.microbatch
    if step.kind == FORWARD:
        if k == 0:
            return 0.0
        prev = done.get((FORWARD, i, k - 1))
        return None if prev is None else prev + stages[k - 1].send_ns
    own = done.get((FORWARD, i, k))
    if own is None:
        return None
    if k == last:
        return own
    later = done.get((BACKWARD, i, k + 1))
    # the gradient of stage k's output comes back over the link its activation went out on: stage k's send
    return None if later is None else max(own, later + stages[k].send_ns)


def _peak_in_flight(orders: list[list[PipelinePass]]) -> tuple[int, ...]:
    peaks = []
    for order in orders:
        live = peak = 0
        for step in order:
            live += 1 if step.kind == FORWARD else -1
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)
