"""A discrete-event simulation of the engine's scheduler over a stream of requests.

The engine loop (vLLM V1 ``Scheduler.schedule`` + ``update_from_output``, read in the source):

1. arrivals up to the current time join the waiting queue (FCFS);
2. running requests first, in order: each gets its remaining prompt (a chunk, capped by the token
   budget ``max_num_batched_tokens``) or one decode token; its new tokens need KV blocks
   (``cdiv(computed + new, block_size)`` in all, in every KV-cache group; a sliding-window group
   first frees the blocks wholly before token ``computed - window + 1``: vLLM's
   ``SlidingWindowManager.remove_skipped_blocks``); when the free blocks run out the *last* running
   request is preempted (its blocks freed, back to the front of the waiting queue, recomputed from
   scratch later), until the allocation succeeds;
3. then, if nothing was preempted this step, waiting requests are admitted while the budget lasts and
   fewer than ``max_num_seqs`` run, each with as much of its prompt as the budget allows (chunked
   prefill); a request whose blocks do not fit stays waiting;
4. the step runs for its priced time (``StepPricer``); a request whose prompt is complete samples one
   token at the step's end (its first token: TTFT); a request with all its output tokens, or at
   ``max_model_len``, finishes and frees its blocks.

When nothing runs or waits, time jumps to the next arrival. There is no wall clock and no global
random state: arrivals come from a ``random.Random(seed)``, so a seed gives one exact result.

Known limitations:
- NB: no prefix caching (every prompt is computed), no speculative decoding, no priorities.
- NB: the engine's host work per step (scheduling, detokenising) is not priced (``steps.py``).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from boomfx.core.errors import OptionError
from boomfx.serving.engine import EngineConfig
from boomfx.serving.kv_cache import cdiv
from boomfx.serving.kv_groups import KVGroups
from boomfx.serving.steps import Step

StepTimer = Callable[[Step], float]     # step -> time in ns


@dataclass(frozen=True)
class RequestSpec:
    arrival_ns: float
    prompt_len: int
    output_len: int


@dataclass
class _Request:
    index: int
    spec: RequestSpec
    computed: int = 0            # tokens whose K/V are in the cache
    produced: int = 0            # output tokens sampled
    blocks: int = 0
    first_scheduled_ns: Optional[float] = None
    token_times_ns: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def total_len(self) -> int:
        """Tokens the request has so far: its prompt and every sampled token."""
        return self.spec.prompt_len + self.produced


@dataclass(frozen=True)
class Workload:
    """How requests arrive: ``request_rate`` per second (Poisson unless ``fixed_interval``) or a fixed
    ``concurrency`` (a new request as soon as one finishes), with fixed or dataset lengths."""

    num_prompts: int
    input_len: int = 1024
    output_len: int = 128
    request_rate: Optional[float] = None
    concurrency: Optional[int] = None
    fixed_interval: bool = False
    seed: int = 0
    lengths: tuple[tuple[int, int], ...] = ()    # (prompt, output) per request, from a dataset

    def check(self, max_model_len: int) -> "Workload":
        if self.num_prompts < 1:
            raise OptionError(f"--num-prompts {self.num_prompts}: must be at least 1")
        if (self.request_rate is None) == (self.concurrency is None):
            raise OptionError("give exactly one of --request-rate and --concurrency")
        if self.request_rate is not None and not self.request_rate > 0:
            raise OptionError(f"--request-rate {self.request_rate}: must be positive (inf: all at once)")
        if self.concurrency is not None and self.concurrency < 1:
            raise OptionError(f"--concurrency {self.concurrency}: must be at least 1")
        for prompt, out in self.lengths or ((self.input_len, self.output_len),):
            if prompt < 1 or out < 1:
                raise OptionError(f"prompt and output lengths must be at least 1 (got {prompt}, {out})")
            if prompt + out > max_model_len:
                raise OptionError(f"a request of {prompt} prompt + {out} output tokens exceeds --max-model-len "
                                  f"{max_model_len}")
        return self

    def lengths_of(self, i: int) -> tuple[int, int]:
        if self.lengths:
            return self.lengths[i % len(self.lengths)]
        return self.input_len, self.output_len

    def arrivals(self) -> list[RequestSpec]:
        """Arrival times for rate mode (all at 0 for an infinite rate)."""
        rng = random.Random(self.seed)
        out, t = [], 0.0
        for i in range(self.num_prompts):
            prompt, output = self.lengths_of(i)
            out.append(RequestSpec(t, prompt, output))
            rate = self.request_rate or math.inf
            if math.isfinite(rate):
                t += 1e9 / rate if self.fixed_interval else rng.expovariate(rate) * 1e9
        return out


def read_dataset(path: str) -> tuple[tuple[int, int], ...]:
    """(prompt_len, output_len) per JSONL line: ``{"prompt_len": 512, "output_len": 128}`` (also
    ``input_len``/``prompt_tokens``/``output_tokens``)."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise OptionError(f"--dataset {path}: {exc.strerror or exc}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = next(int(row[k]) for k in ("prompt_len", "input_len", "prompt_tokens") if k in row)
            output = next(int(row[k]) for k in ("output_len", "output_tokens", "max_tokens") if k in row)
        except (ValueError, StopIteration, TypeError, AttributeError):
            raise OptionError(f"--dataset {path}:{lineno}: expected a JSON object with prompt_len and "
                              "output_len") from None
        rows.append((prompt, output))
    if not rows:
        raise OptionError(f"--dataset {path}: no requests")
    return tuple(rows)


@dataclass(frozen=True)
class StepRecord:
    start_ns: float
    duration_ns: float
    decode_seqs: int
    prefill_tokens: int
    running: int
    waiting: int
    kv_blocks_used: int
    count: int = 1           # identical consecutive steps (a fast-forwarded decode stretch)


@dataclass(frozen=True)
class RequestResult:
    arrival_ns: float
    prompt_len: int
    output_len: int
    ttft_ns: float
    e2e_ns: float
    itl_ns: tuple[float, ...]
    queue_ns: float
    preemptions: int


@dataclass(frozen=True)
class SimulationResult:
    requests: tuple[RequestResult, ...]
    steps: tuple[StepRecord, ...]
    makespan_ns: float
    num_blocks: int
    preemptions: int


def held_blocks(groups: Optional[KVGroups], block: int, computed: int, total: int) -> int:
    """Blocks a request holds once the step that brings it to ``total`` tokens is allocated, after
    freeing what the tokens ``computed`` so far leave outside each sliding window (every group
    allocates ``cdiv(total, block)`` table entries; a sliding group's first
    ``(computed - window + 1) // block`` of them are freed). ``groups`` None: one full group."""
    if groups is None:
        return cdiv(total, block)
    held = 0
    for g in groups.groups:
        held += cdiv(total, block)
        if g.window is not None:
            held -= max(0, (computed - g.window + 1) // block)
    return held


def _steps_before_a_free(groups: KVGroups, block: int, computed: int) -> int:
    """Decode steps (from ``computed`` tokens, one more each) before a sliding group frees a block."""
    out = math.inf
    for g in groups.groups:
        if g.window is not None:
            x = computed - g.window + 1
            out = min(out, max(block, (x // block + 1) * block) - x)
    return int(out) if out != math.inf else 1 << 62


def simulate_workload(workload: Workload, config: EngineConfig, num_blocks: int, step_ns: StepTimer,
                      progress: Optional[Callable[[int, int], None]] = None,
                      fast_forward: bool = True, groups: Optional[KVGroups] = None) -> SimulationResult:
    """Run the scheduler of the module docstring to the last request's finish (``fast_forward``:
    identical decode-only stretches in one go, see ``_fast_forward``; the result is the same).
    ``groups``: the engine's KV-cache groups sharing the ``num_blocks`` pool (None: one full group)."""
    block = config.block_size
    specs = workload.arrivals() if workload.concurrency is None else []
    pending = [_Request(i, s) for i, s in enumerate(specs)]
    next_index = len(pending)
    if workload.concurrency is not None:
        for _ in range(min(workload.concurrency, workload.num_prompts)):
            prompt, out = workload.lengths_of(next_index)
            pending.append(_Request(next_index, RequestSpec(0.0, prompt, out)))
            next_index += 1
    arrived = 0
    waiting: list[_Request] = []
    running: list[_Request] = []
    done: list[_Request] = []
    free = num_blocks
    t = 0.0
    steps: list[StepRecord] = []
    preemptions = 0
    total = workload.num_prompts
    while len(done) < total:
        while arrived < len(pending) and pending[arrived].spec.arrival_ns <= t:
            waiting.append(pending[arrived])
            arrived += 1
        if not running and not waiting:
            t = pending[arrived].spec.arrival_ns
            continue
        if not waiting:
            jumped = _fast_forward(running, pending, arrived, t, config, step_ns, steps, groups) if fast_forward \
                else 0.0
            if jumped:
                t = jumped
                continue
        budget = config.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        preempted_now = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            new = min(req.total_len - req.computed, budget)
            need = held_blocks(groups, block, req.computed, req.computed + new) - req.blocks
            self_preempted = False
            while need > free:
                victim = running.pop()     # the last-scheduled running request (FCFS priority)
                free += victim.blocks
                victim.blocks, victim.computed = 0, 0
                victim.preemptions += 1
                preemptions += 1
                preempted_now = True
                waiting.insert(0, victim)
                if victim is req:
                    self_preempted = True
                    break
            if self_preempted:
                break
            free -= need
            req.blocks += need
            scheduled.append((req, new))
            budget -= new
            i += 1
        if not preempted_now:
            while waiting and budget > 0 and len(running) < config.max_num_seqs:
                req = waiting[0]
                new = min(req.total_len - req.computed, budget)
                need = held_blocks(groups, block, req.computed, req.computed + new) - req.blocks
                if need > free:
                    break
                waiting.pop(0)
                free -= need
                req.blocks += need
                if req.first_scheduled_ns is None:
                    req.first_scheduled_ns = t
                running.append(req)
                scheduled.append((req, new))
                budget -= new
        if not scheduled:
            if arrived < len(pending):
                t = max(t, pending[arrived].spec.arrival_ns)
                continue
            raise OptionError("the KV cache cannot hold even one waiting request; raise the KV-cache size")
        decodes = tuple(r.computed + 1 for r, n in scheduled if n == 1 and r.computed >= r.spec.prompt_len)
        prefills = tuple((n, r.computed + n) for r, n in scheduled if not (n == 1 and r.computed >= r.spec.prompt_len))
        dur = step_ns(Step(decodes, prefills))
        steps.append(StepRecord(t, dur, len(decodes), sum(c for c, _ in prefills), len(running), len(waiting),
                                num_blocks - free))
        t += dur
        for req, n in scheduled:
            req.computed += n
            if req.computed < req.total_len:
                continue                    # a prompt chunk: no token yet
            req.produced += 1
            req.token_times_ns.append(t)
            if req.produced >= req.spec.output_len or req.total_len >= config.max_model_len:
                running.remove(req)
                free += req.blocks
                req.blocks = 0
                done.append(req)
                if workload.concurrency is not None and next_index < total:
                    prompt, out = workload.lengths_of(next_index)
                    pending.append(_Request(next_index, RequestSpec(t, prompt, out)))
                    next_index += 1
        if progress is not None:
            progress(len(done), total)
    results = tuple(sorted((_result(r) for r in done), key=lambda r: r.arrival_ns))
    return SimulationResult(results, tuple(steps), t, num_blocks, preemptions)


def _fast_forward(running: list[_Request], pending: list[_Request], arrived: int, t: float, config: EngineConfig,
                  step_ns: StepTimer, steps: list[StepRecord], groups: Optional[KVGroups] = None) -> float:
    """Advance a stretch of identical decode-only steps at once; returns the new time (0: none taken).

    Only when nothing waits and every running request decodes. The stretch ends before the next
    arrival, before any request finishes, needs a new block or frees one outside a sliding window,
    and before the decode batch's mean
    context leaves its ``block_size`` bucket, the granularity the simulation prices steps at
    (``serve.run_workload``: ``StepPricer(bucket_tokens=block_size)``), so every step of it costs the
    same and the result equals stepping one by one. Low loads (one request at a time, 10^6 steps for
    10,000 requests) become one stretch per block of tokens."""
    block = config.block_size
    b = len(running)
    if any(r.computed != r.total_len - 1 or r.computed < r.spec.prompt_len for r in running):
        return 0.0
    k = min(min(r.spec.output_len - r.produced, config.max_model_len - r.total_len) for r in running) - 1
    if groups is None:
        k = min(k, min(r.blocks * block - r.computed for r in running))
    else:   # every group's table grows at the same block boundaries; sliding groups also free
        k = min(k, min(min(cdiv(r.computed, block) * block - r.computed,
                           _steps_before_a_free(groups, block, r.computed)) for r in running))
    mean_ctx = -(-sum(r.computed + 1 for r in running) // b)
    k = min(k, -(-mean_ctx // block) * block - mean_ctx + 1)
    if k < 2:
        return 0.0
    dur = step_ns(Step(tuple(r.computed + 1 for r in running)))
    if arrived < len(pending):
        k = min(k, math.ceil((pending[arrived].spec.arrival_ns - t) / dur))
    if k < 2:
        return 0.0
    steps.append(StepRecord(t, dur, b, 0, b, 0, sum(r.blocks for r in running), k))
    times = [t + dur * (j + 1) for j in range(k)]
    for r in running:
        r.computed += k
        r.produced += k
        r.token_times_ns.extend(times)
    return times[-1]


def _result(r: _Request) -> RequestResult:
    times = r.token_times_ns
    itl = tuple(b - a for a, b in zip(times, times[1:]))
    queue = (r.first_scheduled_ns or r.spec.arrival_ns) - r.spec.arrival_ns
    return RequestResult(r.spec.arrival_ns, r.spec.prompt_len, len(times), times[0] - r.spec.arrival_ns,
                         times[-1] - r.spec.arrival_ns, itl, queue, r.preemptions)


# -- statistics ---------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    mean_ns: float
    p50_ns: float
    p90_ns: float
    p99_ns: float

    @staticmethod
    def of(values: Iterable[float]) -> "Summary":
        v = list(values)
        return Summary(sum(v) / len(v) if v else 0.0, percentile(v, 50), percentile(v, 90), percentile(v, 99))


# A rate is sustainable when requests arriving late in the run do not wait longer than early ones:
# the mean queueing delay of the last quarter of arrivals stays under QUEUE_GROWTH_FACTOR x that of the
# second quarter plus QUEUE_SLACK_STEPS median steps (an overloaded queue grows linearly with arrivals,
# so the last quarter waits >= 2.3x the second; a stable one waits about the same).
QUEUE_GROWTH_FACTOR = 1.5
QUEUE_SLACK_STEPS = 5


def sustainable(result: SimulationResult) -> bool:
    reqs = result.requests
    n = len(reqs)
    if n < 8:
        return all(r.queue_ns <= QUEUE_SLACK_STEPS * _median_step(result) for r in reqs)
    q2 = [r.queue_ns for r in reqs[n // 4: n // 2]]
    q4 = [r.queue_ns for r in reqs[3 * n // 4:]]
    mean2, mean4 = sum(q2) / len(q2), sum(q4) / len(q4)
    return mean4 <= QUEUE_GROWTH_FACTOR * mean2 + QUEUE_SLACK_STEPS * _median_step(result)


def _median_step(result: SimulationResult) -> float:
    durations = sorted((s.duration_ns, s.count) for s in result.steps)
    half, seen = sum(c for _, c in durations) / 2, 0
    for d, c in durations:
        seen += c
        if seen >= half:
            return d
    return 0.0
