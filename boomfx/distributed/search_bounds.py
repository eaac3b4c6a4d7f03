"""A lower bound of a parallel plan's per-GPU memory from the single-device training program alone, so
``--search`` discards plans that cannot fit before it builds a single per-rank program.

Read once per checkpointing setting from the single-device ``Analysis`` (its liveness, no allocator):

- ``state``: parameters, their gradients and the optimizer state (bytes of the whole model);
- ``activation peak`` at a batch: the largest sum, over the steps of the program, of the live storages
  that a data-parallel rank holds at the same size: activations, temporaries and inputs created by the
  forward, recompute and backward phases (gradients, parameters, buffers, optimizer state and the
  optimizer's temporaries, which shard with the parameters, are left out).

Then for a plan ``dp_replicate x dp_shard x tp x pp`` at micro-batch ``b``, any rank holds at least

    max( state / (dp_shard x tp x pp),                                   at the optimizer step
         (params + optimizer state) / (dp_shard x tp x pp) + activation_peak(b) / (tp x pp) )

plus the memory outside the caching allocator (CUDA context, cuBLAS workspace). Why each term is a floor:

- FSDP2 shards parameters, gradients and AdamW state over ``dp_shard`` (the largest shard is at least the
  mean; padding only adds); DDP replicas hold all of it; at the optimizer step all three are live;
- a data-parallel rank runs the single-device ops on its batch: every activation storage exists with the
  same size and the same program order (the FSDP and DDP rewrites add all-gather and bucket buffers and
  never move an activation's last use), so the single-device activation timeline is a floor of the rank's;
- tensor parallelism splits a tensor at most ``tp`` ways (replicated ones stay whole);
- pipeline stages partition the storages live at the single-device peak: each stage holds its part
  of them at once (same relative order, one micro-batch; more micro-batches in flight only add), so the
  stages' peaks sum to at least that peak and the heaviest is at least ``1/pp`` of it.

``tests/test_search_bounds.py`` checks the bound against full evaluations (allocator replay included) of
every data-parallel plan of small models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy

from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD, PHASE_RECOMPUTE
from boomfx.distributed.search import Plan
from boomfx.passes.liveness import Category, StorageInterval

# what a data-parallel rank holds at the single-device size (module docstring)
_BATCH_CATEGORIES = frozenset({Category.ACT, Category.TEMP, Category.INPUT})
_BATCH_PHASES = frozenset({PHASE_FORWARD, PHASE_RECOMPUTE, PHASE_BACKWARD})
_STATE_CATEGORIES = frozenset({Category.PARAM, Category.OPT})


@dataclass
class ModelFootprint:
    """The single-device program's state and activation timeline (module docstring), per batch cached."""

    analysis: Any                                   # boomfx.analysis.analysis.Analysis of the single-device step
    batch_symbol: sympy.Symbol
    fixed: Mapping[sympy.Symbol, int]               # every other symbol's binding (seq, ...)
    outside_bytes: int                              # memory outside the allocator (CUDA: context, cuBLAS)
    _per_batch: dict[int, int] = field(default_factory=dict)
    _compute: dict[int, float] = field(default_factory=dict)
    _intervals: tuple[StorageInterval, ...] = ()
    _state: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        phases = self.analysis.program.phases
        self._intervals = tuple(
            iv for iv in self.analysis.liveness.intervals
            if iv.category in _BATCH_CATEGORIES and (iv.resident or phases.get(iv.node, PHASE_FORWARD) in _BATCH_PHASES))

    def _bindings(self, batch: int) -> dict[sympy.Symbol, int]:
        return {**self.fixed, self.batch_symbol: int(batch)}

    def state_bytes(self) -> tuple[int, int]:
        """(parameters + optimizer state, gradients) of the whole model."""
        if self._state[0] < 0:
            ev = self.analysis.evaluator(self._bindings(1))
            resident = sum(ev(iv.nbytes) for iv in self.analysis.liveness.intervals
                           if iv.resident and iv.category in _STATE_CATEGORIES)
            grads = sum(ev(iv.nbytes) for iv in self.analysis.liveness.intervals if iv.category == Category.GRAD)
            self._state = (int(resident), int(grads))
        return self._state

    def activation_peak_bytes(self, batch: int) -> int:
        """The largest live sum of the batch-sized storages (module docstring) at ``batch``."""
        hit = self._per_batch.get(batch)
        if hit is None:
            ev = self.analysis.evaluator(self._bindings(batch))
            steps = len(self.analysis.liveness.order)
            diff = [0] * (steps + 1)
            base = 0
            for iv in self._intervals:
                size = ev(iv.nbytes)
                if iv.resident:
                    base += size
                else:
                    diff[iv.start_step] += size
                    diff[iv.end_step + 1] -= size
            live = peak = base
            for d in diff[:steps]:
                live += d
                peak = max(peak, live)
            hit = self._per_batch[batch] = int(peak)
        return hit

    def compute_ns(self, batch: int) -> float:
        """Device time of the forward, recompute and backward kernels at ``batch``, as the analysis prices
        them (each repeated block's kernels priced once): what a data-parallel rank runs on its batch."""
        hit = self._compute.get(batch)
        if hit is None:
            analysis, phases = self.analysis, self.analysis.program.phases
            ev = analysis.evaluator(self._bindings(batch))
            prices: dict[str, float] = {}
            total = 0.0
            for node in analysis.program.graph.nodes:
                if node.name not in analysis.costs.by_node or phases.get(node.name, PHASE_FORWARD) not in _BATCH_PHASES:
                    continue
                rep = analysis.representative(node.name)
                if rep not in prices:
                    prices[rep] = analysis.price_node(rep, ev).time_ns
                total += prices[rep]
            hit = self._compute[batch] = total
        return hit

    def step_lower_bound_ns(self, plan: Plan, micro_batch: int) -> float:
        """A floor of the plan's step time (docs/design.md, "Parallel plan search"): the compute stream runs
        at least the rank's share of the model's kernels. Exact for data parallelism (the rank runs the
        single-device kernels on its batch; collectives and the sharded optimizer only add); for tensor and
        pipeline parallelism it assumes a kernel cut ``k`` ways takes at least ``1/k`` of its time (the cost
        model's efficiency never rises as kernels shrink)."""
        return self.compute_ns(micro_batch) * plan.microbatches / (plan.tp * plan.pp)

    def lower_bound_bytes(self, plan: Plan, micro_batch: int) -> int:
        """Any rank's device memory under ``plan`` is at least this (module docstring)."""
        resident, grads = self.state_bytes()
        state_split = plan.dp_shard * plan.tp * plan.pp
        at_optimizer = (resident + grads) / state_split
        at_activation_peak = resident / state_split + self.activation_peak_bytes(micro_batch) / (plan.tp * plan.pp)
        return int(max(at_optimizer, at_activation_peak)) + self.outside_bytes
