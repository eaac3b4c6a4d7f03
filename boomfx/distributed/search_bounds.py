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

plus the memory outside the caching allocator (CUDA context, cuBLAS workspace). With ``tp > 1`` the
search reads these from the TP rank's own program (``tensor_parallel.tp_rank_program``, ``tp_local``) and
does not divide by ``tp``: without sequence parallelism the norms and the residual stream are whole on
every TP rank, which ``/ tp`` of the single-device sizes would miss. Why each term is a floor:

- FSDP2 shards parameters, gradients and AdamW state over ``dp_shard`` (the largest shard is at least the
  mean; padding only adds); DDP replicas hold all of it; at the optimizer step all three are live;
- a data-parallel rank runs the single-device ops on its batch: every activation storage exists with the
  same size and the same program order (the FSDP and DDP rewrites add all-gather and bucket buffers and
  never move an activation's last use), so the single-device activation timeline is a floor of the rank's;
- tensor parallelism splits a tensor at most ``tp`` ways (replicated ones stay whole);
- pipeline stages partition the storages live at the single-device peak: each stage holds its part
  of them at once (same relative order, one micro-batch; more micro-batches in flight only add), so the
  stages' peaks sum to at least that peak and the heaviest is at least ``1/pp`` of it.

With ``pp > 1`` two more floors use the layer each storage and kernel belongs to (``layer_shares``):

- memory: before stage ``s`` runs its first backward it has run the forward of ``f_s`` micro-batches and
  holds what each saved for its backward (``f_s = m`` for GPipe, ``min(pp - s, m)`` for 1F1B, as
  torch.distributed.pipelining's schedules run them), so it holds at least its layers' parameters and
  optimizer state over ``dp_shard x tp`` plus ``f_s`` times its layers' saved activations over ``tp``;
  and after its first backward (GPipe or 1F1B) every micro-batch's gradients accumulate into its layers'
  ``.grad`` and, with FSDP (``dp_shard > 1``) not resharding after forward (torchtitan's default with pp),
  its layers' parameters stay gathered (``PipelineStage`` turns off resharding after backward and
  gradient sync until the last; ``pp_fsdp.py``) to the end of its last backward (with DDP its
  gradient buckets are a second copy unless ``.grad`` is their view), while 1F1B runs forwards until ``f_s`` micro-batches are in flight again (GPipe:
  ``m - 1`` left), so it then also holds its layers' elements over ``tp`` times the gradients' and the
  gathered parameters' bytes (the narrowest ``MixedPrecisionPolicy`` allows). At 80 layers and global
  batch 512 this discards the plans of pp = 2, 4 and 8 whose stage programs were built only to not fit;
- time: stage ``s`` cannot start before micro-batch 1 passed the stages before it, runs ``m`` forwards and
  backwards, and stage 0 cannot end before the last backward passed back, so the step is at least
  ``sum_{r<s} c_r + m c_s`` for every ``s``, ``c_s`` the kernels of stage ``s``'s layers per micro-batch
  over ``tp`` (the bubble: ``(m + pp - 1) c`` when stages are alike).

``tests/test_parallel_search.py`` checks every bound against full evaluations (allocator replay included)
of every modelled plan (data, tensor and pipeline parallel) of a small model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from boomfx.core.layers import module_path
from boomfx.core.program import (PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, PHASE_RECOMPUTE, ROLE_OPT_STATE,
                                 ROLE_PARAM, Program)
from boomfx.distributed.comm_floor import smallest_dtype
from boomfx.distributed.depth_probe import ProbeDepths, carried_peak, phase_peaks
from boomfx.distributed.graph_edit import owning_layer
from boomfx.distributed.pipeline_stages import stage_layer_ranges
from boomfx.distributed.search import Plan
from boomfx.passes.liveness import Category, LivenessInfo, StorageInterval
from boomfx.training.checkpointing import find_layer_list, layer_names

# what a data-parallel rank holds at the single-device size (module docstring)
_BATCH_CATEGORIES = frozenset({Category.ACT, Category.TEMP, Category.INPUT})
_BATCH_PHASES = frozenset({PHASE_FORWARD, PHASE_RECOMPUTE, PHASE_BACKWARD})
_STATE_CATEGORIES = frozenset({Category.PARAM, Category.OPT})
_COLLECTIVES = "_c10d_functional"


class FootprintBounds(ABC):
    """The plan-level floors (module docstring) over what a footprint gives: its state, activation peak,
    kernels and pipeline floors, whether it is a single-device program's or a TP rank's."""

    tp_local: bool
    outside_bytes: int
    pp_schedule: str
    data_parallel: "DataParallelOptions"   # the search's FSDP / DDP options every plan shares

    # what each footprint gives (ModelFootprint, CarriedFootprint): totals, then per layer of the layer list
    @abstractmethod
    def state_bytes(self) -> tuple[int, int]:
        """(parameters + optimizer state, gradients) of the whole model."""

    @abstractmethod
    def activation_peak_bytes(self, batch: int) -> int:
        """The largest live sum of the batch-sized storages at ``batch``."""

    @abstractmethod
    def compute_ns(self, batch: int) -> float:
        """Device time of the forward, recompute and backward kernels at ``batch``."""

    @abstractmethod
    def optimizer_ns(self) -> float:
        """Device time of the optimizer step's kernels."""

    @abstractmethod
    def layer_count(self) -> int:
        """Layers of the layer list."""

    @abstractmethod
    def layer_compute(self, batch: int) -> Sequence[float]:
        """Per layer, its kernels' device time at ``batch``."""

    @abstractmethod
    def end_compute(self, batch: int) -> tuple[float, float]:
        """The kernels outside the layer list a pipeline's first and last stage run."""

    @abstractmethod
    def layer_saved_bytes(self, batch: int) -> Sequence[int]:
        """Per layer, the bytes its forward leaves alive for the backward at ``batch``."""

    @abstractmethod
    def layer_state_bytes(self) -> Sequence[int]:
        """Per layer, its parameters and optimizer state."""

    @abstractmethod
    def layer_param_elems(self) -> Sequence[int]:
        """Per layer, its parameter elements."""

    @abstractmethod
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype (the smallest, if several)."""

    @abstractmethod
    def memory_bandwidth(self) -> float:
        """The device memory's peak bandwidth, bytes/s."""

    def _tp_split(self, plan: Plan) -> int:
        """How many ways tensor parallelism still splits this footprint's sizes (1: a TP rank's program)."""
        return 1 if self.tp_local else plan.tp

    def step_lower_bound_ns(self, plan: Plan, micro_batch: int, layer_comm_ns: float = 0.0) -> float:
        """A floor of the plan's step time (docs/design.md, "Parallel plan search"): the compute stream runs
        at least the rank's share of the model's kernels. Exact for data parallelism (the rank runs the
        single-device kernels on its batch; collectives and the sharded optimizer only add); for tensor and
        pipeline parallelism it assumes a kernel cut ``k`` ways takes at least ``1/k`` of its time (the cost
        model's efficiency never rises as kernels shrink). ``layer_comm_ns``: the collectives each layer's
        forward waits on at once per micro-batch (tensor parallelism's rowwise all-reduces), which the
        compute stream sits idle for."""
        layers = self.layer_count()
        per_micro = self.compute_ns(micro_batch) / self._tp_split(plan) + layers * layer_comm_ns
        share = per_micro * plan.microbatches / plan.pp
        return max(share, self.pipeline_step_floor_ns(plan, micro_batch, layer_comm_ns))

    def lower_bound_bytes(self, plan: Plan, micro_batch: int) -> int:
        """Any rank's device memory under ``plan`` is at least this (module docstring)."""
        resident, grads = self.state_bytes()
        tp = self._tp_split(plan)
        state_split = plan.dp_shard * tp * plan.pp
        at_optimizer = (resident + grads) / state_split
        at_activation_peak = resident / state_split + self.activation_peak_bytes(micro_batch) / (tp * plan.pp)
        return int(max(at_optimizer, at_activation_peak, self.pipeline_bound_bytes(plan, micro_batch))) + self.outside_bytes

    def _inflight(self, plan: Plan, stage: int) -> int:
        """Micro-batches stage ``stage`` has run the forward of before its first backward."""
        if self.pp_schedule == "gpipe":
            return plan.microbatches
        return min(plan.pp - stage, plan.microbatches)

    def _stage_ranges(self, plan: Plan) -> Sequence[tuple[int, int]]:
        layers = self.layer_count()
        return stage_layer_ranges(layers, plan.pp) if layers >= plan.pp else ()

    def pipeline_step_floor_ns(self, plan: Plan, micro_batch: int, layer_comm_ns: float = 0.0) -> float:
        """``max_s sum_{r<s} c_r + m c_s + (m - 1) a_s`` (module docstring); 0 without pp or layers. ``c_s``:
        a micro-batch's kernels on stage ``s``, its layers' and, on the first and last stage, the model's
        own ops before and after the layer list (``pipeline_stages.py`` puts them there); ``a_s``: adding a
        micro-batch's gradients into the stage's ``.grad`` (every micro-batch after the first reads two and
        writes one gradient per parameter) at the memory's peak bandwidth."""
        ranges = self._stage_ranges(plan)
        if plan.pp == 1 or not ranges:
            return 0.0
        per_layer = self.layer_compute(micro_batch)
        split = self._tp_split(plan)
        stage = [sum(per_layer[lo:hi]) / split + (hi - lo) * layer_comm_ns for lo, hi in ranges]
        first, last = self.end_compute(micro_batch)
        stage[0] += first / split
        stage[-1] += last / split
        elems, itemsize = self.layer_param_elems(), self.param_dtype().itemsize
        bandwidth = self.memory_bandwidth()
        best = before = 0.0
        for c, (lo, hi) in zip(stage, ranges):
            accumulate_ns = 0.0
            if elems and bandwidth:
                grad_bytes = sum(elems[lo:hi]) * itemsize / split
                accumulate_ns = 3 * grad_bytes / bandwidth * 1e9
            best = max(best, before + plan.microbatches * c + (plan.microbatches - 1) * accumulate_ns)
            before += c
        return best

    def pipeline_bound_bytes(self, plan: Plan, micro_batch: int) -> int:
        """The heaviest stage's floor at its first backward and right after it (module docstring); 0 without
        pp or layers."""
        ranges = self._stage_ranges(plan)
        if plan.pp == 1 or not ranges:
            return 0
        layer_state, saved = self.layer_state_bytes(), self.layer_saved_bytes(micro_batch)
        per_elem = self._bytes_per_elem_after_backward(plan)
        elems = self.layer_param_elems() if per_elem else ()
        best = 0.0
        tp = self._tp_split(plan)
        for s, (lo, hi) in enumerate(ranges):
            state = sum(layer_state[lo:hi]) / (plan.dp_shard * tp)
            inflight = self._inflight(plan, s)
            best = max(best, state + inflight * sum(saved[lo:hi]) / tp)
            if elems:
                # after the first backward: its gradients (and FSDP's gathered parameters) stay; 1F1B then
                # runs forwards until ``f_s`` micro-batches are in flight again, GPipe backs out of ``m``
                held = inflight if plan.microbatches > inflight else inflight - 1
                best = max(best, state + (sum(elems[lo:hi]) * per_elem + held * sum(saved[lo:hi])) / tp)
        return int(best)

    def _bytes_per_elem_after_backward(self, plan: Plan) -> int:
        """Bytes per parameter element a GPipe or 1F1B stage holds from its first backward to the end of its
        last: the accumulated gradient; with FSDP the gathered parameter too, unless the layers reshard
        after forward (each forward reshards them again, pp_fsdp.py); with DDP its gradient bucket, unless
        ``.grad`` is the bucket's view (fsdp.ddp_rank_program). 0: not floored so (interleaved schedules)."""
        if self.pp_schedule not in ("1f1b", "gpipe"):
            return 0
        param, dp = self.param_dtype(), self.data_parallel
        if plan.dp_shard == 1:
            buckets = plan.dp_replicate > 1 and not dp.gradient_as_bucket_view
            return param.itemsize * (2 if buckets else 1)
        grad = smallest_dtype(dp.fsdp_reduce_dtype, dp.fsdp_param_dtype, param).itemsize
        return grad if dp.reshard_after_forward else grad + smallest_dtype(dp.fsdp_param_dtype, param).itemsize


@dataclass(frozen=True)
class DataParallelOptions:
    """The ``ParallelConfig`` options of a search's plans that change what a pipeline stage holds
    (``FootprintBounds._bytes_per_elem_after_backward``), as ``SearchRequest.config_options`` gives them."""

    fsdp_param_dtype: Optional[torch.dtype] = None
    fsdp_reduce_dtype: Optional[torch.dtype] = None
    reshard_after_forward: bool = False      # with pp (torchtitan's default with pp: not)
    gradient_as_bucket_view: bool = False    # DDP's (torch's default: not)


@dataclass
class ModelFootprint(FootprintBounds):
    """The single-device program's state and activation timeline (module docstring), per batch cached."""

    analysis: Any                                   # boomfx.analysis.analysis.Analysis of the single-device step
    batch_symbol: sympy.Symbol
    fixed: Mapping[sympy.Symbol, int]               # every other symbol's binding (seq, ...)
    outside_bytes: int                              # memory outside the allocator (CUDA: context, cuBLAS)
    pp_schedule: str = "1f1b"
    tp_local: bool = False                          # the analysis is a TP rank's program: its sizes are split already
    data_parallel: "DataParallelOptions" = field(default_factory=lambda: DataParallelOptions())
    _per_batch: dict[int, dict[str, int]] = field(default_factory=dict)
    _compute: dict[int, float] = field(default_factory=dict)
    _layer_compute: dict[int, list[float]] = field(default_factory=dict)
    _end_compute: dict[int, tuple[float, float]] = field(default_factory=dict)   # (first stage's, last stage's)
    _end_of: Optional[dict[str, int]] = None      # ``_end_stages`` of the program, found once
    _layer_saved: dict[int, list[int]] = field(default_factory=dict)
    _shares: Optional["LayerShares"] = None
    _intervals: tuple[StorageInterval, ...] = ()
    _state: tuple[int, int] = (-1, -1)
    _optimizer: float = -1.0

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
        return max(self.activation_phase_peaks(batch).values())

    def activation_phase_peaks(self, batch: int) -> dict[str, int]:
        """The largest live sum of the batch-sized storages at ``batch`` in each training phase (what a
        ``CarriedFootprint`` carries on phase by phase)."""
        hit = self._per_batch.get(batch)
        if hit is None:
            ev = self.analysis.evaluator(self._bindings(batch))
            liveness = self.analysis.liveness
            steps = len(liveness.order)
            diff = [0] * (steps + 1)
            base = 0
            for iv in self._intervals:
                size = ev(iv.nbytes)
                if iv.resident:
                    base += size
                else:
                    diff[iv.start_step] += size
                    diff[iv.end_step + 1] -= size
            timeline, live = [], base
            for d in diff[:steps]:
                live += d
                timeline.append(int(live))
            hit = phase_peaks(timeline, liveness.order, self.analysis.program.phases) or {"": int(base)}
            self._per_batch[batch] = hit
        return hit

    def compute_ns(self, batch: int) -> float:
        """Device time of the forward, recompute and backward kernels at ``batch``, as the analysis prices
        them (each repeated block's kernels priced once): what a data-parallel rank runs on its batch."""
        hit = self._compute.get(batch)
        if hit is None:
            analysis, phases, shares = self.analysis, self.analysis.program.phases, self.shares()
            ev = analysis.evaluator(self._bindings(batch))
            prices: dict[str, float] = {}
            total = optimizer = 0.0
            per_layer = [0.0] * len(shares.layers)
            ends = [0.0, 0.0]
            if self._end_of is None:
                self._end_of = _end_stages(analysis.program, shares)
            end_of = self._end_of
            for node in analysis.program.graph.nodes:
                if node.name not in analysis.costs.by_node or getattr(node.target, "namespace", "") == _COLLECTIVES:
                    continue      # (a TP rank's all-reduces run on the tp stream: not compute)
                phase = phases.get(node.name, PHASE_FORWARD)
                rep = analysis.representative(node.name)
                if phase == PHASE_OPTIMIZER:
                    if self._optimizer < 0:
                        optimizer += analysis.price_node(rep, ev).time_ns
                    continue
                if phase not in _BATCH_PHASES:
                    continue
                if rep not in prices:
                    prices[rep] = analysis.price_node(rep, ev).time_ns
                total += prices[rep]
                layer = shares.node_layer.get(node.name)
                if layer is not None:
                    per_layer[layer] += prices[rep]
                elif node.name in end_of:
                    ends[end_of[node.name]] += prices[rep]
            hit = self._compute[batch] = total
            self._layer_compute[batch] = per_layer
            self._end_compute[batch] = (ends[0], ends[1])
            if self._optimizer < 0:
                self._optimizer = optimizer
        return hit

    def optimizer_ns(self) -> float:
        """Device time of the optimizer step's kernels (no batch dimension): a rank whose state is cut
        ``k`` ways runs at least ``1/k`` of it (each price is affine in the elements, latency >= 0)."""
        if self._optimizer < 0:
            self.compute_ns(1)
        return self._optimizer

    def shares(self) -> "LayerShares":
        if self._shares is None:
            self._shares = layer_shares(self.analysis.program, self.analysis.liveness)
        return self._shares

    def layer_count(self) -> int:
        return len(self.shares().layers)

    def layer_saved_bytes(self, batch: int) -> list[int]:
        """Per layer, the bytes its forward leaves alive for the backward at ``batch``."""
        hit = self._layer_saved.get(batch)
        if hit is None:
            ev = self.analysis.evaluator(self._bindings(batch))
            shares = self.shares()
            hit = [0] * len(shares.layers)
            for layer, nbytes in shares.saved:
                hit[layer] += int(ev(nbytes))
            self._layer_saved[batch] = hit
        return hit

    def layer_compute(self, batch: int) -> Sequence[float]:
        self.compute_ns(batch)
        return self._layer_compute[batch]

    def end_compute(self, batch: int) -> tuple[float, float]:
        self.compute_ns(batch)
        return self._end_compute[batch]

    def layer_state_bytes(self) -> Sequence[int]:
        return self.shares().state_bytes

    def layer_param_elems(self) -> Sequence[int]:
        return self.shares().param_elems

    def param_dtype(self) -> torch.dtype:
        return self.shares().param_dtype

    def memory_bandwidth(self) -> float:
        return self.analysis.device.memory_bandwidth_bytes_per_s


@dataclass
class CarriedFootprint(FootprintBounds):
    """A TP rank's footprint at the model's depth carried on from the same rank's program at two probe depths
    (``depth_probe.py``), so ``--search`` does not build and analyse the TP rank at 80 layers to tighten a
    TP plan's floors. Totals (state, kernels, the optimizer's kernels) on the line through the probes (a
    stack of identical layers adds the same of each per layer), activation peaks phase by phase
    (``depth_probe.carried_peak``); per layer, the deeper probe's layers with its last copy of the
    template layer repeated up to the model's depth, as ``training/expand.py`` synthesises the stack
    (layers ``0 .. deep-2``, copies of the template, then the last layer)."""

    shallow: ModelFootprint
    deep: ModelFootprint
    depths: ProbeDepths
    tp_local: bool = True
    _per_batch: dict[int, float] = field(default_factory=dict)
    _compute: dict[int, float] = field(default_factory=dict)

    @property
    def outside_bytes(self) -> int:
        return self.deep.outside_bytes

    @property
    def pp_schedule(self) -> str:
        return self.deep.pp_schedule

    @property
    def data_parallel(self) -> "DataParallelOptions":
        return self.deep.data_parallel

    def _carry(self, shallow: float, deep: float) -> float:
        return self.depths.carry(shallow, deep)

    def _per_layer(self, deep: Sequence[Any]) -> list[Any]:
        """The deeper probe's per-layer list at the model's depth: its middle layer repeated."""
        return [*deep[:-1], *[deep[-2]] * (self.depths.full - len(deep)), deep[-1]]

    def state_bytes(self) -> tuple[int, int]:
        low, high = self.shallow.state_bytes(), self.deep.state_bytes()
        return int(self._carry(low[0], high[0])), int(self._carry(low[1], high[1]))

    def activation_peak_bytes(self, batch: int) -> int:
        if batch not in self._per_batch:
            self._per_batch[batch] = carried_peak(self.shallow.activation_phase_peaks(batch),
                                                  self.deep.activation_phase_peaks(batch), self.depths)
        return int(self._per_batch[batch])

    def compute_ns(self, batch: int) -> float:
        if batch not in self._compute:
            self._compute[batch] = self._carry(self.shallow.compute_ns(batch), self.deep.compute_ns(batch))
        return self._compute[batch]

    def optimizer_ns(self) -> float:
        return self._carry(self.shallow.optimizer_ns(), self.deep.optimizer_ns())

    def layer_count(self) -> int:
        return self.depths.full

    def layer_compute(self, batch: int) -> Sequence[float]:
        return self._per_layer(self.deep.layer_compute(batch))

    def end_compute(self, batch: int) -> tuple[float, float]:
        return self.deep.end_compute(batch)

    def layer_saved_bytes(self, batch: int) -> Sequence[int]:
        return self._per_layer(self.deep.layer_saved_bytes(batch))

    def layer_state_bytes(self) -> Sequence[int]:
        return self._per_layer(self.deep.layer_state_bytes())

    def layer_param_elems(self) -> Sequence[int]:
        return self._per_layer(self.deep.layer_param_elems())

    def param_dtype(self) -> torch.dtype:
        return self.deep.param_dtype()

    def memory_bandwidth(self) -> float:
        return self.deep.memory_bandwidth()


def _end_stages(program: Program, shares: "LayerShares") -> dict[str, int]:
    """Kernel nodes outside the layer list that a pipeline's first (0) or last (1) stage runs: forward ops
    before the layers and backward ops after them (embedding) on the first, forward ops after the layers
    and backward ops before them (head, loss) on the last; ops between layers are left out (a floor)."""
    by_phase: dict[str, list[fx.Node]] = {}
    for node in program.graph.nodes:
        if node.op == "call_function":
            by_phase.setdefault(program.phases.get(node.name, PHASE_FORWARD), []).append(node)
    out: dict[str, int] = {}
    for phase, nodes in by_phase.items():
        if phase not in (PHASE_FORWARD, PHASE_BACKWARD):
            continue
        own = [i for i, n in enumerate(nodes) if n.name in shares.node_layer]
        if not own:
            continue
        before, after = (0, 1) if phase == PHASE_FORWARD else (1, 0)
        for i, node in enumerate(nodes):
            if node.name in shares.node_layer:
                continue
            if i < own[0]:
                out[node.name] = before
            elif i > own[-1]:
                out[node.name] = after
    return out


@dataclass(frozen=True)
class LayerShares:
    """What of the single-device program belongs to each layer of its layer list."""

    layers: tuple[str, ...]
    node_layer: Mapping[str, int]                  # kernel node -> layer index (forward, recompute, backward)
    state_bytes: tuple[int, ...]                   # parameters + optimizer state per layer
    saved: tuple[tuple[int, sympy.Expr], ...]      # (layer, bytes) of each storage its forward saves for backward
    param_elems: tuple[int, ...] = ()              # parameter elements per layer (what FSDP gathers per unit)
    root_param_elems: int = 0                      # parameter elements outside the layers (FSDP's root unit)
    param_dtype: torch.dtype = torch.float32       # the parameters' dtype (the smallest, if several)


def layer_shares(program: Program, liveness: LivenessInfo) -> LayerShares:
    """Each layer's kernels, parameters with their optimizer state, and saved activations: a storage counts
    for a layer when a forward node of the layer creates it and it lives into the backward."""
    graph = program.graph
    prefix = find_layer_list(graph)
    layers = tuple(layer_names(graph, prefix)) if prefix else ()
    index = {name: i for i, name in enumerate(layers)}
    node_layer: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            layer = owning_layer(module_path(node), index)
            if layer is not None:
                node_layer[node.name] = index[layer]
    param_layer: dict[str, int] = {}
    for name, fqn in program.param_names.items():
        layer = owning_layer(fqn, index)
        if layer is not None and program.input_roles.get(name) == ROLE_PARAM:
            param_layer[name] = index[layer]
    state = [0] * len(layers)
    elems = [0] * len(layers)
    root_elems, dtypes = 0, set()
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        role = program.input_roles.get(node.name)
        owner = param_layer.get(node.name) if role == ROLE_PARAM else (
            _opt_state_owner(node.name, param_layer) if role == ROLE_OPT_STATE else None)
        if owner is not None:
            state[owner] += _concrete_nbytes(node)
        val = node.meta.get("val")
        if role == ROLE_PARAM and val is not None:
            dtypes.add(val.dtype)
            if owner is not None:
                elems[owner] += int(val.numel())
            else:
                root_elems += int(val.numel())
    phases = program.phases
    first_backward = next((step for step, name in enumerate(liveness.order) if phases.get(name) == PHASE_BACKWARD),
                          None)
    saved = []
    if first_backward is not None:
        for iv in liveness.intervals:
            layer = node_layer.get(iv.node)
            if (layer is not None and iv.category == Category.ACT and not iv.resident
                    and phases.get(iv.node) == PHASE_FORWARD and iv.end_step >= first_backward):
                saved.append((layer, iv.nbytes))
    return LayerShares(layers, node_layer, tuple(state), tuple(saved), tuple(elems), root_elems,
                       min(dtypes, key=lambda d: d.itemsize, default=torch.float32))


def _opt_state_owner(name: str, param_layer: Mapping[str, int]) -> Optional[int]:
    """The layer of the parameter an optimizer-state placeholder belongs to (``exp_avg_p_layers_0_q_weight``
    holds state of ``p_layers_0_q_weight``): the longest suffix after an underscore that is a parameter."""
    for i, ch in enumerate(name):
        if ch == "_" and name[i + 1:] in param_layer:
            return param_layer[name[i + 1:]]
    return None


def _concrete_nbytes(node: Any) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if val is not None else 0
