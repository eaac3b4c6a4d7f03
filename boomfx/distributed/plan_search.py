"""``--search``: the fastest parallel plans that fit, found with as few full evaluations as the answer allows.

Every plan of ``search.enumerate_plans`` goes through stages, each cheaper than the next and each
discarding only plans the next could not have accepted:

1. **memory bound** (``search_bounds.ModelFootprint``): sharded state plus the single-device activation
   peak at the plan's micro-batch, from the single-device liveness (a TP plan's sizes over ``tp``, then,
   once the visit reaches it, from the TP rank's own program: ``memory_footprint``, whose trace the plan's
   build reuses); no per-rank program is built for a plan over the device's memory by it;
2. **per-rank programs**, once per ``Plan.program_key`` (degrees and checkpointing; pipeline plans of
   every micro-batch count share one build, their stages replayed from three micro-batches,
   ``pipeline_compose.py``; interleaved ones are built per count): ``DistributedAnalysis``. A rewrite that raises ``OptionError`` (tensor and pipeline
   parallelism, until their rewrites land) marks the plans of that key "not modelled", with its reason;
3. **rank liveness**: each rank class's live-bytes peak (no allocator) plus the memory outside the
   allocator; over the device's memory, the replay would run out too;
4. **time**: each remaining plan's step on compute and communication streams, without the allocator
   replay (time does not depend on it);
5. **fit**: the plan's full evaluation (``DistributedAnalysis.evaluate``: allocator replay and streams,
   exactly what ``--parallel`` reports), only while its time can still enter the ``top`` found so far
   (slower ones are counted "not checked", as are listed ones pushed out later).

Plans are visited in the order of a step-time floor (``ModelFootprint.step_lower_bound_ns``: the rank's
share of the single-device compute kernels; ``comm_floor.py``: the data-parallel collectives on one
group's stream, whichever is longer), best first; a TP plan's floor is tightened with its TP rank's own
kernels the first time it comes up (``_tight_step_floor``) and it goes back in line, so builds run in
the order of the tightest floors known. The visit stops once the next floor exceeds the slowest of
the ``top`` plans found ("skipped by the time bound": their floors, hence their times, are slower).

So the plans listed are the ``top`` fastest that fit among the modelled ones, and every number in a row
is the full evaluation's. Stage 4's time equals stage 5's for the same single-stage plan (same spans, same
schedule), so skipping a plan at stage 4 never drops one that would have been listed
(``tests/test_parallel_search.py`` compares the listed plans with a brute-force full evaluation of all).
How the analyses are reused across plans is in docs/design.md ("Parallel plan search").

Example::

    >>> out = search_plans("llama.pt2", nodes=8, gpus_per_node=8, global_batch=512, seq=2048,
    ...                    device="h100-sxm", amp="bf16")                                  # doctest: +SKIP
    >>> out.best.plan.describe(), out.best.step_ns, out.best.peak_bytes
"""
from __future__ import annotations

import copy
import heapq
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import sympy
import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.core.devices import DeviceSpec, get_device
from boomfx.core.errors import OptionError
from boomfx.core.gc_pause import gc_paused
from boomfx.core.networks import UnknownNetworkError, get_network
from boomfx.core.program import ROLE_INPUT, ROLE_PARAM, Program, ProgramOptions
from boomfx.distributed.accumulation import accumulated_step_ns
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.comm_floor import DataParallelComm, data_parallel_comm, overlapped_step_floor_ns
from boomfx.distributed.depth_probe import (FIT_MARGIN, ProbeDepths, carried_peak, carry_class, phase_peaks,
                                            probe_depths)
from boomfx.distributed.mesh_groups import MESH_ORDER, mesh_groups
from boomfx.distributed.metrics import NS_PER_S, mfu, model_flops_per_token
from boomfx.distributed.model_shape import _SDPA, colwise_inputs, model_shape, rowwise_outputs
from boomfx.distributed.pipeline_compose import composable
from boomfx.distributed.mixed_precision import torch_dtype
from boomfx.distributed.plan import DEGREES, ParallelConfig
from boomfx.distributed.rank_schedule import default_pricer, default_slowdown, schedule_rank
from boomfx.distributed.search import Plan, SearchSpace, enumerate_plans
from boomfx.distributed.search_bounds import CarriedFootprint, DataParallelOptions, FootprintBounds, ModelFootprint
from boomfx.distributed.step_time import topology_of
from boomfx.frontend.capture import capture, resolve_bindings, to_exported_program
from boomfx.kernels_db.collective_model import ClusterTopology
from boomfx.passes.specs import to_sympy

DEFAULT_NETWORK = "ib-ndr"
_PLAN_PREFIX = re.compile(r"^--parallel \S+: ")


@dataclass(frozen=True)
class SearchRequest:
    """What the user asks: a world, a global batch, and what to bind or hold fixed."""

    nodes: int
    gpus_per_node: int
    global_batch: int
    seq: Optional[int] = None
    dims: Mapping[str, int] = field(default_factory=dict)
    top: int = 5
    checkpoint: tuple[bool, ...] = (False, True)
    pinned: Mapping[str, int] = field(default_factory=dict)     # degrees held fixed (``--parallel tp=8``)
    network: str = DEFAULT_NETWORK
    max_microbatches: Optional[int] = None
    config_options: Mapping[str, Any] = field(default_factory=dict)  # other ParallelConfig fields of every plan
    # build deep stacks at two shallow depths and carry the numbers on (depth_probe.py); False: build every
    # plan at the model's depth
    depth_probes: bool = True

    def check(self) -> None:
        for name in ("nodes", "gpus_per_node", "global_batch"):
            if getattr(self, name) < 1:
                raise OptionError(f"--search: --{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.top < 1:
            raise OptionError(f"--search: --top must be at least 1, got {self.top}")
        world = self.nodes * self.gpus_per_node
        fixed = 1
        for name, degree in self.pinned.items():
            if name not in DEGREES or degree < 1:
                raise OptionError(f"--search --parallel: {name}={degree} is not one of {', '.join(DEGREES)}=N (N >= 1)")
            fixed *= degree
        if world % fixed:
            raise OptionError(f"--search --parallel: the fixed degrees multiply to {fixed} ranks, which does not divide "
                              f"the world of {self.nodes} node(s) x {self.gpus_per_node} GPUs = {world}")
        try:
            get_network(self.network)
        except UnknownNetworkError as exc:
            raise OptionError(f"--network: {exc}") from None
        dp = self.pinned.get("dp_replicate", 1) * self.pinned.get("dp_shard", 1)
        if self.global_batch % dp:
            raise OptionError(f"--global-batch {self.global_batch} does not split over the fixed data-parallel "
                              f"degree {dp}")


@dataclass(frozen=True)
class PlanRow:
    """One plan that fits, with its full evaluation's numbers (the slowest rank class's step)."""

    plan: Plan
    micro_batch: int
    step_ns: float
    peak_bytes: int                 # the largest per-GPU device total (allocator replay + outside memory)
    mfu: float
    tokens_per_s_per_gpu: float
    exposed_comm_ns: float
    hidden_comm_ns: float
    probed_from: Optional[tuple[int, int]] = None   # the depths its numbers were carried from (None: built whole)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.describe(), **{k: getattr(self.plan, k) for k in
                                                 ("dp_replicate", "dp_shard", "tp", "pp", "microbatches", "checkpoint")},
                "micro_batch": self.micro_batch, "step_ns": self.step_ns, "peak_bytes": self.peak_bytes,
                "mfu": self.mfu, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "exposed_comm_ns": self.exposed_comm_ns, "hidden_comm_ns": self.hidden_comm_ns,
                "probed_from": list(self.probed_from) if self.probed_from else None}


@dataclass
class SearchOutcome:
    ranked: list[PlanRow]                       # the ``top`` fastest plans that fit, fastest first
    plans: int                                  # valid plans enumerated
    pruned_by_bound: int = 0                    # stage 1
    not_modelled: Counter = field(default_factory=Counter)   # stage 2: reason -> plans
    pruned_by_liveness: int = 0                 # stage 3
    over_memory: int = 0                        # stage 5: the allocator ran out
    not_checked: int = 0                        # evaluated slower than the last plan listed
    skipped_by_time_bound: int = 0              # step-time floor above the last plan listed: never built
    evaluations: Counter = field(default_factory=Counter)    # what each stage ran, by kind
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage

    @property
    def best(self) -> Optional[PlanRow]:
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict[str, Any]:
        return {"ranked": [r.to_dict() for r in self.ranked], "plans": self.plans,
                "pruned_by_memory_bound": self.pruned_by_bound, "not_modelled": dict(self.not_modelled),
                "pruned_by_rank_liveness": self.pruned_by_liveness, "over_memory": self.over_memory,
                "not_checked": self.not_checked, "skipped_by_time_bound": self.skipped_by_time_bound,
                "evaluations": dict(self.evaluations), "seconds": self.seconds}


@dataclass
class _Candidate:
    plan: Plan
    dist: DistributedAnalysis          # the deeper probe where ``probes`` is set
    bindings: dict[sympy.Symbol, int]
    micro_batch: int
    time_ns: float = 0.0
    probes: Optional[tuple[ProbeDepths, DistributedAnalysis]] = None   # (depths, the shallow probe)


class ParallelSearch:
    """One search over the plans of a world for the programs ``program_for(checkpoint)`` returns."""

    def __init__(self, program_for: Callable[..., Program], device: DeviceSpec, request: SearchRequest,
                 options: AnalyzeOptions = AnalyzeOptions(), reuse_blocks: bool = True) -> None:
        request.check()
        self.request = request
        self.device = device
        self.options = options
        self.reuse_blocks = reuse_blocks
        self._program_for = program_for
        self._programs: dict[tuple[bool, Optional[int]], Program] = {}
        self._footprints: dict[bool, ModelFootprint] = {}
        self._tp_footprints: dict[tuple[bool, int], FootprintBounds] = {}
        self.outcome = SearchOutcome([], 0)
        self._built: dict[tuple, Optional[DistributedAnalysis]] = {}
        self._refusals: dict[tuple, str] = {}
        self._refusal = ""                                 # the reason of the last build refused
        self._synthesised: dict[tuple[bool, int], bool] = {}   # (checkpoint, depth) -> the program has that depth
        self._peaks: dict[tuple, list[dict[str, int]]] = {}
        self._floors: dict[Plan, float] = {}
        self._comm_prices: dict[tuple, float] = {}
        self._groups: dict[tuple[int, ...], Mapping[str, Any]] = {}
        self._clock = time.perf_counter()

    # -- shared, built once ---------------------------------------------------------------------
    def program(self, checkpoint: bool, depth: Optional[int] = None) -> Program:
        """The training program; ``depth``: its stack synthesised at that many layers (``program_for(checkpoint,
        depth)``, ``ProgramOptions.stack_depth``), for the depth probes."""
        key = (checkpoint, depth)
        if key not in self._programs:
            self._programs[key] = self._program_for(checkpoint) if depth is None else self._program_for(checkpoint, depth)
            self.outcome.evaluations["captures" if depth is None else "probe_captures"] += 1
        return self._programs[key]

    def memory_footprint(self, plan: Plan) -> FootprintBounds:
        """The footprint the plan's memory floor reads: the TP rank's program for ``tp > 1`` (its sizes
        split as the plan splits them; built at the two probe depths of a deep stack and carried on,
        ``search_bounds.CarriedFootprint``), else the single-device one; the single-device one where the
        TP rewrite is not built for this model (it divides by ``tp``)."""
        if plan.tp == 1:
            return self.footprint(plan.checkpoint)
        key = (plan.checkpoint, plan.tp)
        if key not in self._tp_footprints:
            depths = self._stack_depths(plan.checkpoint, 1)
            try:
                if depths is None:
                    self._tp_footprints[key] = self._tp_rank_footprint(plan, None)
                else:
                    self._tp_footprints[key] = CarriedFootprint(self._tp_rank_footprint(plan, depths.shallow),
                                                                self._tp_rank_footprint(plan, depths.deep), depths)
            except OptionError:
                self._tp_footprints[key] = self.footprint(plan.checkpoint)
        return self._tp_footprints[key]

    def _tp_rank_footprint(self, plan: Plan, depth: Optional[int]) -> ModelFootprint:
        """The footprint of one TP rank's program (``tp_rank_program``, kept per program: the plan's
        build at the same depth reuses its trace) at ``depth`` of the stack (None: the model's)."""
        from boomfx.distributed.tensor_parallel import tp_rank_program

        base = self.footprint(plan.checkpoint)
        tp_only = ParallelConfig(1, 1, plan.tp, 1, nodes=1, gpus_per_node=plan.tp, **self.request.config_options)
        program = tp_rank_program(self.program(plan.checkpoint, depth), tp_only)
        analysis = Analysis(program, self.device, self.options, reuse_blocks=self.reuse_blocks)
        self.outcome.evaluations["tp_rank_analyses"] += 1
        return ModelFootprint(analysis, base.batch_symbol, base.fixed, base.outside_bytes, base.pp_schedule,
                              tp_local=True, data_parallel=base.data_parallel)

    def footprint(self, checkpoint: bool) -> ModelFootprint:
        if checkpoint not in self._footprints:
            program = self.program(checkpoint)
            analysis = Analysis(program, self.device, self.options, reuse_blocks=self.reuse_blocks)
            batch = _batch_symbol(program)
            fixed = resolve_bindings(program, self.request.dims, None, self.request.seq, allow_unbound=True)
            fixed.pop(batch, None)
            unbound = [s for s in program.symbols.values() if s.symbol not in fixed and s.symbol != batch]
            if unbound:
                raise OptionError("--search: bind the other dimensions first: " + ", ".join(s.describe() for s in unbound))
            outside = analysis.outside.total_bytes if self.device.kind == "cuda" else 0
            schedule = self.request.config_options.get("pp_schedule", "1f1b")
            options = self.request.config_options
            data_parallel = DataParallelOptions(
                torch_dtype(options.get("fsdp_param_dtype")), torch_dtype(options.get("fsdp_reduce_dtype")),
                bool(options.get("reshard_after_forward")), bool(options.get("gradient_as_bucket_view")))
            self._footprints[checkpoint] = ModelFootprint(analysis, batch, fixed, outside, schedule,
                                                          data_parallel=data_parallel)
            self.outcome.evaluations["single_device_analyses"] += 1
        return self._footprints[checkpoint]

    def _lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.outcome.seconds[stage] = self.outcome.seconds.get(stage, 0.0) + now - self._clock
        self._clock = now

    # -- the stages ----------------------------------------------------------------------------
    def run(self) -> SearchOutcome:
        """The search (module docstring). Python's cyclic collector is paused for it, as ``boomfx analyze``
        pauses it (``core/gc_pause.py``): each automatic collection walks every node of the programs built
        so far, a third of an 80-layer search (benchmarks/results/search_speed.md)."""
        with gc_paused():
            return self._run()

    def _run(self) -> SearchOutcome:
        req, out = self.request, self.outcome
        first = self.program(req.checkpoint[0])
        shape = model_shape(first)
        if not shape.layers or not shape.heads:
            raise OptionError("--search needs a model with a layer list and attention (found "
                              f"{shape.layers} layers, {shape.heads or 0} attention heads)")
        space = SearchSpace(req.nodes, req.gpus_per_node, req.global_batch, shape.layers, shape.heads,
                            shape.kv_heads, checkpoint=req.checkpoint, max_microbatches=req.max_microbatches)
        plans = [p for p in enumerate_plans(space) if all(getattr(p, k) == v for k, v in req.pinned.items())]
        if not plans:
            raise OptionError(f"--search: no plan of {req.nodes} x {req.gpus_per_node} GPUs splits the global batch "
                              f"{req.global_batch} and the model's {shape.layers} layers and {shape.heads} heads"
                              + (f" with {_pins(req.pinned)}" if req.pinned else ""))
        out.plans = len(plans)
        self._flops_per_token = _model_flops_per_token(first, shape.layers)
        self._lap("setup")
        kept = self._bound(plans)
        self._lap("memory bound")
        # best first on the floor; a TP plan's floor is tightened (its TP rank's kernels) the first time it
        # comes up, and it goes back in line: builds run in the order of the tightest floors known
        queue = [(self._step_floor(p), p.describe(), p, p.tp == 1) for p in kept]
        heapq.heapify(queue)
        self._lap("time bound")
        while queue:
            floor, name, plan, tight = heapq.heappop(queue)
            if len(out.ranked) == req.top and floor > out.ranked[-1].step_ns:
                out.skipped_by_time_bound += 1 + len(queue)     # their floors only rise from here
                break
            if not tight:
                if self._tp_bound_fits(plan):
                    heapq.heappush(queue, (self._tight_step_floor(plan), name, plan, True))
                self._lap("time bound")
                continue
            self._consider(plan)
        return out

    def _step_floor(self, plan: Plan) -> float:
        """A floor of the plan's step (docs/design.md, "Parallel plan search") from the single-device
        footprint, cached per plan: the order of the visit."""
        if plan not in self._floors:
            self._floors[plan] = self._floor_from(plan, self.footprint(plan.checkpoint))
        return self._floors[plan]

    def _tight_step_floor(self, plan: Plan) -> float:
        """The floor again for a TP plan about to be built, from the TP rank's own kernels (the norms and
        the residual stream whole on every rank, not ``1/tp`` of the single-device ones); its trace is
        the one the build reuses."""
        footprint = self.memory_footprint(plan)
        if not footprint.tp_local:
            return self._step_floor(plan)
        return max(self._step_floor(plan), self._floor_from(plan, footprint))

    def _floor_from(self, plan: Plan, footprint: FootprintBounds) -> float:
        """The compute floor (``ModelFootprint.step_lower_bound_ns``), the busiest data-parallel stream
        (``comm_floor.data_parallel_comm``), the tp stream's all-reduces and, for a single stage, the
        compute stream's whole work (kernels, the rank's share of the optimizer, FSDP's copies at the
        memory's peak bandwidth) slowed while collectives run (``comm_floor.overlapped_step_floor_ns``);
        with pipeline stages, the mean stage's work with its collectives in line, as ``pipeline_time.py``
        runs them."""
        before = len(footprint._compute)
        micro_batch = self._micro_batch(plan)
        layer_comm = self._tp_layer_comm_ns(plan, micro_batch)
        backward_comm = self._tp_layer_comm_ns(plan, micro_batch, backward=True)
        # a pipeline stage's passes run their TP all-reduces in line (pipeline_time.py), both directions
        in_pass = layer_comm + (backward_comm if plan.pp > 1 else 0.0)
        floor = footprint.step_lower_bound_ns(plan, micro_batch, in_pass)
        self.outcome.evaluations["compute_bounds"] += len(footprint._compute) - before
        comm = self._dp_comm(plan)
        # the tp stream runs every layer's forward and backward all-reduces, each micro-batch (the mean stage's)
        layers = footprint.layer_count()
        tp_stream = (layer_comm + backward_comm) * layers
        tp_stream *= plan.microbatches / plan.pp
        floor = max(floor, comm.busiest_ns, tp_stream)
        split = footprint._tp_split(plan)
        copies_ns = comm.copy_bytes / self.device.memory_bandwidth_bytes_per_s * 1e9
        optimizer_ns = footprint.optimizer_ns() / (plan.dp_shard * split * plan.pp)
        if plan.pp == 1:   # every accumulated micro-batch runs the kernels, copies and collectives again
            m = plan.microbatches
            work = (footprint.compute_ns(micro_batch) / split + copies_ns) * m + optimizer_ns
            busiest = comm.busiest_ns * m
            floor = max(floor, busiest, overlapped_step_floor_ns(work, layers * layer_comm * m, max(busiest, tp_stream),
                                                                 self._slowdown.factor))
        else:   # pipeline_time runs a stage's collectives in line with its passes: the mean stage's serial work
            work = footprint.compute_ns(micro_batch) / split * plan.microbatches / plan.pp + optimizer_ns + copies_ns
            floor = max(floor, work + tp_stream + comm.busiest_ns)
        return floor

    def _dp_comm(self, plan: Plan) -> DataParallelComm:
        """``comm_floor.data_parallel_comm`` of the plan, its messages priced as the rank schedule prices
        them over rank 0's groups (a floor of rank 0's step, hence of the slowest rank's)."""
        if plan.dp == 1:
            return DataParallelComm({})
        shares = self.footprint(plan.checkpoint).shares()    # single-device sizes, over tp (no TP rank traced)
        try:
            cfg = self._config(plan)
        except OptionError:
            return DataParallelComm({})
        groups = self._rank0_groups(plan)
        degrees = (plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp)

        def price(op: str, nbytes: int, dim: str, dtype: torch.dtype) -> float:
            key = (degrees, op, nbytes, dim, dtype)
            if key not in self._comm_prices:
                self._comm_prices[key] = self._collectives().price(
                    op, nbytes, groups[dim], str(dtype).replace("torch.", "")).time_ns
            return self._comm_prices[key]

        return data_parallel_comm(
            shares.param_elems, shares.root_param_elems, shares.param_dtype, plan.dp_replicate, plan.dp_shard,
            plan.tp, plan.pp, cfg.reshards_after_forward, cfg.fsdp_wrap == "root", price,
            torch_dtype(cfg.fsdp_param_dtype), torch_dtype(cfg.fsdp_reduce_dtype))

    def _rank0_groups(self, plan: Plan) -> Mapping[str, Any]:
        """Rank 0's process groups under the plan's degrees on the requested cluster (what the floors price
        collectives over), kept per degrees."""
        degrees = tuple(int(getattr(plan, name)) for name in MESH_ORDER)
        if degrees not in self._groups:
            topology = ClusterTopology(self.request.nodes, self.request.gpus_per_node, self.request.network)
            self._groups[degrees] = mesh_groups(dict(zip(MESH_ORDER, degrees)), 0, topology)
        return self._groups[degrees]

    @property
    def _slowdown(self) -> Any:
        """The compute slowdown the rank schedules apply while collectives run (``default_slowdown``)."""
        return default_slowdown(self.footprint(self.request.checkpoint[0]).analysis, self.request.gpus_per_node)

    def _collectives(self) -> Any:
        """The collective prices the rank schedules use (the ``--db``'s rows, else the model), read once."""
        if not hasattr(self, "_pricer"):
            self._pricer = default_pricer(self.footprint(self.request.checkpoint[0]).analysis)
        return self._pricer

    def _tp_layer_comm_ns(self, plan: Plan, micro_batch: int, backward: bool = False) -> float:
        """Per layer and micro-batch, the forward all-reduces of the rowwise projections' partial outputs
        (``[tokens, out features]`` in the activation dtype) over the plan's tp group, as the rank schedule
        prices them: the next op reads each at once, so the compute stream waits them out. ``backward``:
        instead the backward's all-reduces of the colwise projections' input gradients (``[tokens, in
        features]``, one per projection, as DTensor issues them; ``tensor_parallel.py``), which the compute
        stream may overlap with the next projection's backward."""
        if plan.tp == 1:
            return 0.0
        footprint = self.footprint(plan.checkpoint)
        layers = footprint.layer_count()
        if not layers:
            return 0.0
        program = footprint.analysis.program
        if not hasattr(self, "_rowwise"):      # (features, dtype) -> how many projections all-reduce them
            self._rowwise = Counter((features, dtype) for _, features, dtype in rowwise_outputs(program))
            self._colwise = Counter((features, dtype) for _, features, dtype in colwise_inputs(program))
        amp = _training_dtype(program)
        tokens = micro_batch * _tokens_per_sample(program, footprint.analysis.evaluator(footprint._bindings(micro_batch)))
        group_key = (plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp)
        total = 0.0
        for (features, dtype), count in (self._colwise if backward else self._rowwise).items():
            act = amp if amp != torch.float32 else dtype
            nbytes = tokens * features * act.itemsize
            key = (group_key, nbytes, act)
            if key not in self._comm_prices:
                group = self._rank0_groups(plan)["tp"]
                self._comm_prices[key] = self._collectives().price("all_reduce", nbytes, group,
                                                                   str(act).replace("torch.", "")).time_ns
            total += count * self._comm_prices[key]
        return total / layers

    def _consider(self, plan: Plan) -> None:
        """Stages 2-5 for one plan, its floor below the slowest of the ``top`` found so far."""
        ranked = self.outcome.ranked
        c = self._candidate(plan)
        self._lap("per-rank programs")
        if c is None:
            return
        if not self._liveness_fits(c):
            self._lap("rank liveness")
            return
        self._lap("rank liveness")
        c.time_ns = self._time(c)
        self._lap("time")
        if len(ranked) == self.request.top and (c.time_ns, plan.describe()) >= (ranked[-1].step_ns,
                                                                                ranked[-1].plan.describe()):
            self.outcome.not_checked += 1        # slower than every listed plan: never replayed
            return
        row = self._full(c)
        self._lap("fit")
        if row is None:
            self.outcome.over_memory += 1
            return
        ranked.append(row)
        ranked.sort(key=lambda r: (r.step_ns, r.plan.describe()))
        if len(ranked) > self.request.top:
            ranked.pop()
            self.outcome.not_checked += 1        # pushed out: replayed, but slower than the listed plans

    def _micro_batch(self, plan: Plan) -> int:
        return self.request.global_batch // plan.dp // plan.microbatches

    def _bound(self, plans: Sequence[Plan]) -> list[Plan]:
        """Stage 1 from the single-device footprint (a TP plan's sizes over ``tp``: no TP rank is traced
        for it); ``_tp_bound_fits`` tightens it for the TP plans the visit reaches."""
        return [plan for plan in plans if self._bound_fits(plan, self.footprint(plan.checkpoint))]

    def _bound_fits(self, plan: Plan, footprint: FootprintBounds) -> bool:
        before = len(footprint._per_batch)
        bound = footprint.lower_bound_bytes(plan, self._micro_batch(plan))
        self.outcome.evaluations["activation_bounds"] += len(footprint._per_batch) - before
        if bound > self.device.memory_bytes:
            self.outcome.pruned_by_bound += 1
            return False
        return True

    def _tp_bound_fits(self, plan: Plan) -> bool:
        """Stage 1 again for a TP plan the visit reaches, from the TP rank's program (what TP leaves whole
        counted whole); its trace is the one the plan's build reuses (``tp_rank_program`` is cached)."""
        return plan.tp == 1 or self._bound_fits(plan, self.memory_footprint(plan))

    def _config(self, plan: Plan) -> ParallelConfig:
        cfg = ParallelConfig(plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp, nodes=self.request.nodes,
                             gpus_per_node=self.request.gpus_per_node, microbatches=plan.microbatches,
                             network=self.request.network, **self.request.config_options)
        cfg.check()
        return cfg

    def _candidate(self, plan: Plan) -> Optional[_Candidate]:
        """The plan's per-rank analyses (None: not modelled, counted): at two shallow depths of its stack
        where ``depth_probe.probe_depths`` gives them, else at the model's."""
        try:
            cfg = self._config(plan)
        except OptionError as exc:
            self.outcome.not_modelled[_PLAN_PREFIX.sub("", str(exc).splitlines()[0])] += 1
            return None
        depths = self._probe_depths(plan, cfg)
        dist = self._dist(plan, cfg, depths.deep if depths else None)
        shallow = self._dist(plan, cfg, depths.shallow) if depths and dist is not None else None
        if depths and shallow is None:        # not built at a probe's depth: the model's depth decides
            depths, dist = None, self._dist(plan, cfg, None)
        if dist is None:
            self.outcome.not_modelled[self._refusal] += 1
            return None
        local = self.request.global_batch // plan.dp
        bindings = {**self.footprint(plan.checkpoint).fixed, _batch_symbol(dist.program): local}
        return _Candidate(plan, dist, bindings, self._micro_batch(plan),
                          probes=(depths, shallow) if depths else None)

    def _probe_depths(self, plan: Plan, cfg: ParallelConfig) -> Optional[ProbeDepths]:
        """The depths the plan is built at instead of the model's, or None (probes off, a stack too shallow to
        gain, or a step the synthesis cannot shorten: its program keeps the export's depth)."""
        return self._stack_depths(plan.checkpoint, plan.pp * (cfg.stages_per_rank if plan.pp > 1 else 1))

    def _stack_depths(self, checkpoint: bool, stages: int) -> Optional[ProbeDepths]:
        """``depth_probe.probe_depths`` for ``stages`` pipeline stages where the stack synthesises them."""
        if not self.request.depth_probes:
            return None
        depths = probe_depths(model_shape(self.program(checkpoint)).layers, stages)
        if depths is None:
            return None
        key = (checkpoint, depths.shallow)
        if key not in self._synthesised:
            self._synthesised[key] = model_shape(self.program(checkpoint, depths.shallow)).layers == depths.shallow
        return depths if self._synthesised[key] else None

    def _dist(self, plan: Plan, cfg: ParallelConfig, depth: Optional[int]) -> Optional[DistributedAnalysis]:
        """The per-rank analyses of the plan's program key at ``depth`` (None: the model's), built once; None
        where the rewrite refuses (its reason kept under ``(program key, depth)``)."""
        key = (plan.program_key(), depth)
        # pipeline stages replayed from a 3-micro-batch template: one build for every micro-batch count
        template = (plan.program_key(any_microbatches=True), depth)
        if composable(cfg) and self._built.get(template, True) is not False:
            key = template
        if key not in self._built:
            self._built[key] = None
            try:
                dist = DistributedAnalysis(self.program(plan.checkpoint, depth), cfg, self.device, self.options,
                                           reuse_blocks=self.reuse_blocks, replay_microbatches=key == template)
            except OptionError as exc:
                # the reason without the plan's own spelling, so plans refused alike count together
                self._refusals[key] = _PLAN_PREFIX.sub("", str(exc).splitlines()[0])
            self.outcome.evaluations["rank_program_builds" if depth is None else "probe_builds"] += 1
            if key == template and not dist.replayed:    # built whole for this count: later ones build theirs
                self._built[template] = False
                key = (plan.program_key(), depth)
            self._built[key] = dist
        dist = self._built.get(key)
        if dist is None:
            self._refusal = self._refusals[key]
            return None
        if dist.cfg != cfg:           # same programs, another micro-batch count: only the config differs
            dist = copy.copy(dist)
            dist.cfg = cfg
        return dist

    def _liveness_fits(self, c: _Candidate) -> bool:
        """Stage 3: every rank class's live-bytes peak (the allocator holds at least that) fits; with depth
        probes, each class's phase peaks carried on to the model's depth."""
        if c.plan.pp > 1 and not c.dist.replayed:
            return True           # stage programs built whole: left to the full evaluation
        outside = self.footprint(c.plan.checkpoint).outside_bytes
        if c.probes is not None:
            depths, shallow = c.probes
            peaks = [carried_peak(s, d, depths)
                     for s, d in zip(self._phase_peaks(shallow, c), self._phase_peaks(c.dist, c))]
        else:
            peaks = [max(p.values(), default=0) for p in self._phase_peaks(c.dist, c)]
        for peak in peaks:
            self.outcome.evaluations["rank_liveness_peaks"] += 1
            if peak + outside > self.device.memory_bytes:
                self.outcome.pruned_by_liveness += 1
                return False
        return True

    def _phase_peaks(self, dist: DistributedAnalysis, c: _Candidate) -> list[dict[str, int]]:
        """Each rank class's live-bytes peak per training phase (no allocator), kept per analysis."""
        bindings = dist.program_bindings(c.bindings)      # pipeline stages: one micro-batch's sizes
        key = (id(dist.analyses[0]), dist.cfg.num_microbatches, tuple(sorted(bindings.items(), key=str)))
        if key not in self._peaks:
            liveness = dist.step_liveness()     # accumulation: the later micro-batches' (gradients held)
            self._peaks[key] = [phase_peaks(info.timeline(a.evaluator(bindings)), info.order, a.program.phases)
                                for a, info in zip(dist.analyses, liveness)]
        return self._peaks[key]

    def _time(self, c: _Candidate) -> float:
        """Stage 4: the step without the allocator replay (pipelines through ``DistributedAnalysis``); with
        depth probes, carried on from theirs."""
        self.outcome.evaluations["time_evaluations"] += 1
        if c.probes is not None:
            depths, shallow = c.probes
            return depths.carry(self._time_of(shallow, c), self._time_of(c.dist, c))
        return self._time_of(c.dist, c)

    def _time_of(self, dist: DistributedAnalysis, c: _Candidate) -> float:
        if c.plan.pp > 1:
            report = dist.evaluate(c.bindings, replay_allocator=False).report
            return max(row["step_time_ns"] for row in report.parallel["classes"])
        topology = topology_of(dist.cfg)
        degrees = {name: int(getattr(dist.cfg, name)) for name in MESH_ORDER}
        bindings = dist.program_bindings(c.bindings)      # gradient accumulation: one micro-batch's sizes
        worst = 0.0
        for rc, analysis in zip(dist.classes, dist.analyses):
            point = analysis.evaluate(bindings, replay_allocator=False)
            step = schedule_rank(analysis, bindings, mesh_groups(degrees, rc.ranks[0], topology), self._collectives(),
                                 point=point)
            worst = max(worst, accumulated_step_ns(step, analysis.program, dist.cfg.accumulation_steps))
        return worst

    def _full(self, c: _Candidate) -> Optional[PlanRow]:
        """Stage 5: the full evaluation (allocator replay and streams, as ``--parallel`` reports); None when a
        rank class runs out of memory. With depth probes, both probes' evaluations carried on
        (``depth_probe.carry_class``); a plan whose carried total lies within ``FIT_MARGIN`` of the device's
        memory is evaluated again at the model's depth, which decides."""
        self.outcome.evaluations["full_evaluations"] += 1
        if c.probes is None:
            parallel = c.dist.evaluate(c.bindings, exact_total=False).report.parallel   # fits or not is enough
            classes = [{"step_ns": cls["step_time_ns"], "total_device_bytes": cls["total_device_bytes"],
                        "fits": cls["fits"], **_comm(parallel, i)} for i, cls in enumerate(parallel["classes"])]
            return self._row(c, classes)
        depths, shallow = c.probes
        at = [self._probe_numbers(dist, c) for dist in (shallow, c.dist)]
        classes = []
        for s, d in zip(*at):
            carried = carry_class(depths, s, d)
            classes.append({"step_ns": carried.step_ns, "total_device_bytes": carried.total_device_bytes,
                            "fits": carried.total_device_bytes <= self.device.memory_bytes,
                            "exposed_comm_ns": carried.exposed_comm_ns, "hidden_comm_ns": carried.hidden_comm_ns})
        if any(abs(cls["total_device_bytes"] / self.device.memory_bytes - 1) <= FIT_MARGIN for cls in classes):
            self.outcome.evaluations["full_depth_fit_checks"] += 1
            whole = self._dist(c.plan, c.dist.cfg, None)
            if whole is None:
                self.outcome.not_modelled[self._refusal] += 1
                return None
            return self._full(_Candidate(c.plan, whole, c.bindings, c.micro_batch, c.time_ns))
        return self._row(c, classes, (depths.shallow, depths.deep))

    def _probe_numbers(self, dist: DistributedAnalysis, c: _Candidate) -> list[dict[str, Any]]:
        """What ``carry_class`` reads of each rank class at one probe (its replay run to the end)."""
        parallel = dist.evaluate(c.bindings, exact_total=True).report.parallel
        return [{"step_ns": cls["step_time_ns"], "total_device_bytes": cls["total_device_bytes"],
                 "phase_peaks": peaks, **_comm(parallel, i)}
                for i, (cls, peaks) in enumerate(zip(parallel["classes"], self._phase_peaks(dist, c)))]

    def _row(self, c: _Candidate, classes: Sequence[Mapping[str, Any]],
             probed_from: Optional[tuple[int, int]] = None) -> Optional[PlanRow]:
        if not all(cls["fits"] for cls in classes):
            return None
        slowest = max(range(len(classes)), key=lambda k: classes[k]["step_ns"])
        step_ns = classes[slowest]["step_ns"]
        seq = self._tokens_per_sample(c)
        tokens = self.request.global_batch * seq
        return PlanRow(c.plan, c.micro_batch, step_ns, int(max(cls["total_device_bytes"] for cls in classes)),
                       mfu(self._flops_per_token(seq) * tokens, step_ns, c.plan.world,
                           self.device.peak_for(_training_dtype(c.dist.program))),
                       tokens / (step_ns / NS_PER_S) / c.plan.world,
                       float(classes[slowest]["exposed_comm_ns"]), float(classes[slowest]["hidden_comm_ns"]),
                       probed_from)

    def _tokens_per_sample(self, c: _Candidate) -> int:
        return _tokens_per_sample(c.dist.program, c.dist.analyses[0].evaluator(c.bindings))


def _comm(parallel: Mapping[str, Any], k: int) -> dict[str, float]:
    """Rank class ``k``'s exposed and hidden communication in a ``ParallelReport``."""
    times = parallel["time_by_class"][k] if parallel["time_by_class"] else {}
    return {"exposed_comm_ns": float(times.get("exposed_comm_ns", 0.0)),
            "hidden_comm_ns": float(times.get("hidden_comm_ns", 0.0))}


# -- model facts for MFU ------------------------------------------------------------------------------
def _batch_symbol(program: Program) -> sympy.Symbol:
    for info in program.symbols.values():
        if info.role == "batch":
            return info.symbol
    raise OptionError("--search needs an export with a dynamic batch dimension (the plans split the global "
                      "batch over data-parallel ranks); export with dynamic_shapes={...: {0: Dim('batch')}}")


def _tokens_per_sample(program: Program, ev: Any) -> int:
    """Tokens of one sequence: dimension 1 of the first integer input (token ids), else 1."""
    for node in program.graph.nodes:
        if node.op != "placeholder" or program.input_roles.get(node.name) != ROLE_INPUT:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and val.dim() >= 2:
            return int(ev(to_sympy(val.shape[1])))
    return 1


def _model_flops_per_token(program: Program, layers: int) -> Callable[[int], float]:
    """torchtitan's ``6 N + 12 L H Q T`` (boomfx/distributed/metrics.py) as a function of the sequence length:
    N the parameters outside embedding tables, H and Q the attention's heads and head dimension."""
    embedding = {n.args[0].name for n in program.graph.nodes
                 if n.op == "call_function" and n.target == torch.ops.aten.embedding.default}
    params = 0
    for node in program.graph.nodes:
        if node.op == "placeholder" and program.input_roles.get(node.name) == ROLE_PARAM and node.name not in embedding:
            params += int(node.meta["val"].numel())          # parameters have concrete shapes
    heads = head_dim = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in _SDPA:
            q = node.args[0].meta["val"]
            heads, head_dim = int(q.shape[1]), int(q.shape[-1])
            break
    return lambda seq: model_flops_per_token(params, layers, heads, head_dim, seq)


def _training_dtype(program: Program) -> torch.dtype:
    amp = getattr(program.options, "amp", None)
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "", torch.float32)


def _pins(pinned: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in pinned.items())


def parse_pinned(text: Optional[str]) -> dict[str, int]:
    """``"tp=8,pp=2"`` -> the degrees ``--search`` holds fixed (``--parallel`` with ``--search``)."""
    out: dict[str, int] = {}
    for item in (p.strip() for p in (text or "").split(",") if p.strip()):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in DEGREES:
            raise OptionError(f"--search --parallel: {item!r} is not one of {', '.join(DEGREES)}=N")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise OptionError(f"--search --parallel: {item!r}: {value!r} is not an integer") from None
    return out


def search_plans(source: Any, *example_inputs: Any, nodes: int, gpus_per_node: int, global_batch: int,
                 device: str | DeviceSpec = "h100-sxm", seq: Optional[int] = None,
                 dims: Optional[Mapping[str, int]] = None, top: int = 5, checkpoint: Sequence[bool] = (False, True),
                 parallel: Optional[str] = None, network: str = DEFAULT_NETWORK,
                 max_microbatches: Optional[int] = None, db: Optional[str] = None, alloc_conf: str = "",
                 outside_memory: str = "", **program_options: Any) -> SearchOutcome:
    """The Python API of ``boomfx analyze --train --search``: the ``top`` fastest plans of ``nodes x
    gpus_per_node`` GPUs that fit, training ``global_batch`` sequences per step (``program_options``:
    ``amp``, ``optimizer``, ... as ``boomfx.capture`` takes them; ``checkpoint`` the settings searched)."""
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    request = SearchRequest(nodes, gpus_per_node, global_batch, seq, dict(dims or {}), top, tuple(checkpoint),
                            parse_pinned(parallel), network, max_microbatches)
    if not request.checkpoint:
        raise OptionError("--search: no checkpointing setting to search")
    program_options.pop("train", None)
    program_for = program_maker(source, *example_inputs,
                                options=ProgramOptions(train=True, target_kind=spec.kind, **program_options))

    options = AnalyzeOptions(spec.name, alloc_conf, outside_memory, db)
    return ParallelSearch(program_for, spec, request, options).run()


def program_maker(source: Any, *example_inputs: Any, options: ProgramOptions,
                  log: Optional[Callable[[str], None]] = None) -> Callable[..., Program]:
    """``(checkpoint, depth=None) -> Program``: the training program with activation checkpointing on or off
    (``depth``: its stack synthesised at that many layers, a search's depth probe), the file loaded (or
    the module exported) once for all."""
    from dataclasses import replace
    exported = to_exported_program(source, example_inputs, log=log)

    def program_for(checkpoint: bool, depth: Optional[int] = None) -> Program:
        return capture(exported, options=replace(options, checkpoint=checkpoint, stack_depth=depth),
                       log=log if depth is None else None)

    return program_for
