"""``--search``: every valid parallel plan for a world, the ones that cannot fit pruned by a memory bound,
the rest evaluated and ranked by step time.

A plan is torchtitan's degrees ``dp_replicate x dp_shard x tp x pp`` (their product is the world), the number
of pipeline micro-batches and activation checkpointing on or off. ``enumerate_plans`` lists only valid
plans:

- the degrees multiply to ``nodes x gpus_per_node``;
- ``tp`` divides the attention heads and key/value heads (each rank holds whole heads) and, by default, the
  GPUs of a node (tensor parallelism's collectives sit on the critical path: torchtitan and Megatron keep
  TP inside NVLink);
- ``pp`` is at most the number of layers;
- the global batch splits evenly over the ``dp_replicate x dp_shard`` data-parallel ranks, and the rank's
  batch into ``microbatches``: with ``pp > 1`` the pipeline's (at least ``pp`` of them, as 1F1B needs);
  without pipelining, gradient accumulation (any divisor, 1 included: ``accumulation.py``).

Before evaluating, ``search`` drops plans whose resident training state cannot fit:
``state_bytes / (dp_shard x tp x pp)`` is a lower bound of any rank's parameters, gradients and
optimizer state (FSDP shards all three over ``dp_shard``; TP splits at most everything by ``tp``; the
heaviest pipeline stage holds at least ``1/pp``; DDP replicas hold a full copy). A plan over the device's
memory by that bound alone is never evaluated.

The evaluator is supplied (``(plan) -> PlanResult``); ``ReusingEvaluator`` is the reuse the search relies on
to stay fast: plans that share their per-rank programs (same degrees and checkpointing) share one built
analysis, and differ only in the sizes bound at evaluation (the micro-batch), see docs/design.md.

Example::

    >>> space = SearchSpace(nodes=2, gpus_per_node=8, global_batch=32, layers=32, heads=32)
    >>> len(enumerate_plans(space)) > 0
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterable, Optional, Sequence, TypeVar

from boomfx.core.errors import OptionError


@dataclass(frozen=True)
class Plan:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    microbatches: int = 1
    checkpoint: bool = False

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def program_key(self, any_microbatches: bool = False) -> tuple:
        """What the per-rank programs depend on: the degrees, checkpointing and, with pp, the micro-batch
        count (a stage program holds one forward and backward per micro-batch; the micro-batch size only
        binds sizes). ``any_microbatches``: the key of stage programs replayed for any count
        (``pipeline_compose.py``)."""
        micro = "any" if any_microbatches else (self.microbatches if self.pp > 1 else 1)
        return (self.dp_replicate, self.dp_shard, self.tp, self.pp, micro, self.checkpoint)

    def describe(self) -> str:
        """The ``--parallel`` spelling, then micro-batches and checkpointing."""
        parts = [f"{name}={getattr(self, name)}" for name in ("dp_replicate", "dp_shard", "tp", "pp")
                 if getattr(self, name) > 1] or ["single device"]
        text = ",".join(parts)
        if self.pp > 1 or self.microbatches > 1:
            text += f" microbatches={self.microbatches}"
        return text + (" checkpoint" if self.checkpoint else "")


@dataclass(frozen=True)
class PlanResult:
    time_ns: float
    peak_bytes: int
    fits: bool
    mfu: float


@dataclass(frozen=True)
class SearchSpace:
    nodes: int
    gpus_per_node: int
    global_batch: int
    layers: int
    heads: int
    kv_heads: Optional[int] = None
    tp_within_node: bool = True
    checkpoint: tuple[bool, ...] = (False, True)
    max_microbatches: Optional[int] = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(space: SearchSpace) -> list[Plan]:
    """Every valid plan (module docstring), in a fixed order."""
    if min(space.nodes, space.gpus_per_node, space.global_batch, space.layers, space.heads) < 1:
        raise OptionError("--search needs at least one node, GPU, sequence, layer and head")
    world = space.world
    heads = [space.heads] + ([space.kv_heads] if space.kv_heads else [])
    plans: list[Plan] = []
    for tp in _divisors(world):
        if any(h % tp for h in heads):
            continue
        if space.tp_within_node and space.gpus_per_node % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > space.layers:
                continue
            dp = world // (tp * pp)
            if space.global_batch % dp:
                continue
            local_batch = space.global_batch // dp
            micro = [m for m in _divisors(local_batch) if m >= pp
                     and (space.max_microbatches is None or m <= space.max_microbatches)]
            for shard in _divisors(dp):
                for m in micro:
                    for ckpt in space.checkpoint:
                        plans.append(Plan(dp // shard, shard, tp, pp, m, ckpt))
    return plans


def state_lower_bound_bytes(plan: Plan, state_bytes: int) -> float:
    """A lower bound of any rank's parameters + gradients + optimizer state (module docstring)."""
    return state_bytes / (plan.dp_shard * plan.tp * plan.pp)


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[tuple[Plan, PlanResult], ...]       # the fastest plans that fit, fastest first
    evaluated: int
    pruned: tuple[Plan, ...]                          # over memory by the bound, never evaluated
    not_fitting: int                                  # evaluated, over memory

    @property
    def best(self) -> Optional[tuple[Plan, PlanResult]]:
        return self.ranked[0] if self.ranked else None


def search(plans: Iterable[Plan], evaluate: Callable[[Plan], PlanResult], device_memory_bytes: int,
           state_bytes: int, top: int = 5) -> SearchResult:
    """Evaluate each plan the memory bound does not rule out; the ``top`` fastest that fit, ties by description."""
    if top < 1:
        raise OptionError(f"--search: --top must be at least 1, got {top}")
    fitting: list[tuple[Plan, PlanResult]] = []
    pruned: list[Plan] = []
    evaluated = not_fitting = 0
    for plan in plans:
        if state_lower_bound_bytes(plan, state_bytes) > device_memory_bytes:
            pruned.append(plan)
            continue
        result = evaluate(plan)
        evaluated += 1
        if result.fits:
            fitting.append((plan, result))
        else:
            not_fitting += 1
    fitting.sort(key=lambda pr: (pr[1].time_ns, pr[0].describe()))
    return SearchResult(tuple(fitting[:top]), evaluated, tuple(pruned), not_fitting)


A = TypeVar("A")


class ReusingEvaluator(Generic[A]):
    """``build(program_key)`` once per distinct per-rank program set (the expensive, symbolic part: capture,
    rank rewrites, passes), then ``evaluate(built, plan)`` per plan (bind sizes, price, simulate)."""

    def __init__(self, build: Callable[[Hashable], A], evaluate: Callable[[A, Plan], PlanResult]) -> None:
        self._build = build
        self._evaluate = evaluate
        self._built: dict[Hashable, A] = {}

    @property
    def builds(self) -> int:
        return len(self._built)

    def __call__(self, plan: Plan) -> PlanResult:
        key = plan.program_key()
        built = self._built.get(key)
        if built is None:
            built = self._built[key] = self._build(key)
        return self._evaluate(built, plan)


def plan_rows(result: SearchResult) -> Sequence[tuple[str, float, int, float]]:
    """(description, time_ns, peak_bytes, mfu) of the ranked plans, for ``report/plan_table.py``."""
    return [(plan.describe(), r.time_ns, r.peak_bytes, r.mfu) for plan, r in result.ranked]
