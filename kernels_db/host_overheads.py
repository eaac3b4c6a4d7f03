"""Host time outside the kernels' prices: entering compiled graphs, and host code run from cold caches.

1. **Entering compiled graphs.** A ``torch.compile``'d forward is entered through dynamo (frame
   evaluation, the cache lookup, guards on every parameter and input) and AOTAutograd's runtime wrappers
   before Inductor's ``call`` runs the kernels; in training the forward is an ``autograd.Function`` and
   the backward graph is called by the autograd engine, which then hands each parameter its gradient
   (AccumulateGrad). The database times fused groups as Inductor's compiled callables
   (``collect_fused``) and extern kernels as eager ATen calls: none of that is in a kernel's price::

       inference:  graph_call  + graph_call_per_input  * graph inputs  [+ graph_call_cold  * cold]
       training:   train_calls + train_calls_per_input * graph inputs  [+ train_calls_cold * cold]

2. **Cold caches.** Host code run right after a kernel that streamed more than the core's L2 finds its
   instructions and data evicted: on the development CPU a one-element ``add`` costs 2 us warm and
   26-33 us after a 512^3 matmul, a 4-16 MB ``add`` or a 64 MiB fill; 10 us after a 256^3 matmul
   (768 KiB), nothing after a 64^3 one (48 KiB). Dynamo's entry, a much larger body of Python, goes from
   ~47 us warm to 90-130 us after a fill of four L2s, 170 us after a 64 MiB one and 290-570 us after
   milliseconds of matmuls. On a CPU target, whose kernels run on the same core, every kernel after a
   kernel moving B bytes pays ``op_cold * min(1, B / L2)`` more than its warm dispatch (``cold`` above:
   the same fraction, of the step's last kernel for the entry). A GPU target's host only issues
   kernels: no cold terms.

3. **Eager dispatch between kernels** (CPU targets, eager only). Kernels are measured one op at a time in
   a loop, where its dispatch path stays hot; a step runs hundreds of different ops in turn. Measured
   here, a chain of 20 distinct small ops takes 1.1 us more per op than the same ops each repeated
   (``op_switch``): a kernel after a small one pays it, after one that streamed the L2 the full ``op_cold``
   instead (the switch is part of a cold start: ``switch x (1 - cold fraction)``), after its own price's
   flush nothing more. And the program's aliasing ops (view, t, transpose, expand, slice, ...)
   priced at zero as kernels still go through the dispatcher, 2.2 us each here: every such aten node
   costs ``alias_op`` (a chain of distinct aliasing ops, per op), as does ``.item()``
   (``_local_scalar_dense``). In training, autograd records a node per differentiable op and its engine
   runs each in the backward: ``autograd_node`` per node (a chain of scalar ``mul``/``neg`` forward and
   backward minus twice the chain without autograd: 2.2 us here). A compiled step's wrapper calls its
   kernels directly, and its backward is one graph: none of these terms.

``measure_host_costs`` measures every term on this host: the entry as the median difference between
a real compiled step of a calibration module (tiny Linear layers, at two depths for the per-input slope)
and the Inductor graphs it compiled, recorded and called directly, warm and after ``_Polluter`` (a fill
of four L2s); ``op_cold`` as a one-element ``add`` after the polluter minus warm; ``op_switch`` and
``alias_op`` and ``autograd_node`` as above. ``boomfx kernels
collect`` on a CPU stores them as rows of op ``HOST_OP`` next to the kernels; ``Analysis`` adds them to
the step (``boomfx/analysis/host_time.py``), or ``DEFAULT_NS`` of the target's kind without them.

Known limitations:
- One backward per forward, no graph breaks (each break is another graph call; boomfx traces one graph).
- The per-input slope is measured with parameters; buffers and user inputs are priced the same, and
  only the fixed part of the entry is measured cold.
- A kernel's price from a database collected with the CPU protocol (a cache flush before each sample of
  a kernel of ``MIN_SAMPLE_NS`` or more, ``kernels_db.measure``) already holds one cold start: such a
  kernel pays the difference to its own predecessor's (``cold_start_ns``).
- The fraction is linear in the predecessor's bytes up to the L2 (checked at three sizes); a cache
  model of the interpreter's working set it is not. The host's other tenants move the cold values.
- GPU defaults come from the development CPU; a database collected on a GPU's host does not measure
  them yet (the collector measures on a CPU only).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from boomfx.kernels_db.measure import MIN_SAMPLE_NS, Measurement, Measurer, l2_cache_bytes, summarize
from boomfx.kernels_db.price import PriceSource
from boomfx.kernels_db.schema import KernelKey, KernelRecord, canonical_json

HOST_OP = "boomfx::host"
GRAPH_CALL = "graph_call"
GRAPH_CALL_PER_INPUT = "graph_call_per_input"
GRAPH_CALL_COLD = "graph_call_cold"
TRAIN_CALLS = "train_calls"
TRAIN_CALLS_PER_INPUT = "train_calls_per_input"
TRAIN_CALLS_COLD = "train_calls_cold"
OP_COLD = "op_cold"
OP_SWITCH = "op_switch"
ALIAS_OP = "alias_op"
AUTOGRAD_NODE = "autograd_node"
FSDP_UNIT = "fsdp_unit"
FSDP_PARAM = "fsdp_param"
TP_LINEAR = "tp_linear"
# torch.distributed's frameworks' host work (kernels_db/framework_overheads.py, measured by `kernels collect
# --collectives` on a CPU); not part of a plain collection, so not needed for its "measured" label
FRAMEWORK_EVENTS = (FSDP_UNIT, FSDP_PARAM, TP_LINEAR)
# transformers' Python per nn.Module call of a decode step (boomfx/serving/host_overhead.py, measured by
# `boomfx serve --collect --kv-write concat` on a CPU); like the frameworks', not part of a plain collection
MODULE_CALL = "transformers_module_call"
OPTIONAL_EVENTS = FRAMEWORK_EVENTS + (MODULE_CALL,)
EVENTS = (GRAPH_CALL, GRAPH_CALL_PER_INPUT, GRAPH_CALL_COLD, TRAIN_CALLS, TRAIN_CALLS_PER_INPUT, TRAIN_CALLS_COLD,
          OP_COLD, OP_SWITCH, ALIAS_OP, AUTOGRAD_NODE) + OPTIONAL_EVENTS
EAGER_EVENTS = (OP_COLD, OP_SWITCH, ALIAS_OP, AUTOGRAD_NODE)   # what an eager CPU step reads (no graph entries)

# Measured on the development CPU (measure_host_costs, thread CPU time), three runs each: graph_call
# 47.0/46.6/47.2 us, per input 0.40/0.29/0.32 us, cold extra 85/71/43 us; train_calls 151/148/145 us, per
# input 6.8/7.4/5.5 us, cold extra 162/178/103 us; op_cold 25.7/25.3/24.3 us. 2026-12-04 (thread time, three
# runs): op_switch 1.08/1.15/1.14 us, alias_op 2.19/2.20/2.19 us, autograd_node 2.5/1.7/2.3 us (under load),
# and op_cold then 2.46/2.45/2.47 us: the VM's host had changed (the defaults keep the earlier op_cold; a
# collected database holds its own). FSDP2 at world size 1 (framework_overheads.py's calibration, one run):
# 427 us per unit + 181 us per parameter (units of 2, 6 and 12 parameters: 789, 1515, 2498 us per unit);
# tensor parallelism 757 us per parallel linear with a bias (542 us without), under a test run's load.
DEFAULT_NS: Mapping[str, Mapping[str, float]] = {
    "cuda": {GRAPH_CALL: 47_000.0, GRAPH_CALL_PER_INPUT: 350.0, GRAPH_CALL_COLD: 0.0,
             TRAIN_CALLS: 148_000.0, TRAIN_CALLS_PER_INPUT: 6_500.0, TRAIN_CALLS_COLD: 0.0, OP_COLD: 0.0,
             OP_SWITCH: 0.0, ALIAS_OP: 0.0, AUTOGRAD_NODE: 0.0, FSDP_UNIT: 0.0, FSDP_PARAM: 0.0, TP_LINEAR: 0.0,
             MODULE_CALL: 0.0},
    "cpu": {GRAPH_CALL: 47_000.0, GRAPH_CALL_PER_INPUT: 350.0, GRAPH_CALL_COLD: 70_000.0,
            TRAIN_CALLS: 148_000.0, TRAIN_CALLS_PER_INPUT: 6_500.0, TRAIN_CALLS_COLD: 150_000.0,
            OP_COLD: 25_000.0, OP_SWITCH: 1_100.0, ALIAS_OP: 2_200.0,
            AUTOGRAD_NODE: 2_200.0, FSDP_UNIT: 430_000.0, FSDP_PARAM: 180_000.0, TP_LINEAR: 760_000.0,
            MODULE_CALL: 0.0},
}
_LAYERS = (1, 32)      # calibration depths: 3 and 65 graph inputs


def host_key(event: str) -> KernelKey:
    """The database key of one host event (no tensors: the value depends only on the host)."""
    if event not in EVENTS:
        raise ValueError(f"unknown host event {event!r}; known: {', '.join(EVENTS)}")
    return KernelKey(HOST_OP, "none", canonical_json({"op": HOST_OP, "args": [event], "tensors": [], "context": {}}))


def event_of(key: KernelKey) -> Optional[str]:
    """The host event a stored key names, or None for a kernel's key."""
    if key.op != HOST_OP:
        return None
    args = json.loads(key.key_json).get("args") or [None]
    return args[0] if args[0] in EVENTS else None


def stored_ns(host_records: Mapping[str, KernelRecord], event: str) -> Optional[float]:
    """The value a pricer's host rows hold for ``event``, if any (events without a default to fall back
    to, such as ``MODULE_CALL``)."""
    for record in host_records.values():
        if event_of(record.key) == event:
            return record.median_ns
    return None


@dataclass(frozen=True)
class HostCosts:
    """The host terms in ns (every event), where they came from, and the L2 size the cold terms scale by."""

    values: Mapping[str, float]
    source: str            # "measured" (a database row for every event), "default" or "partly measured"
    l2_bytes: int
    # the price sources (``PriceSource`` values) whose prices already hold what the kernels before them left
    # (their op switch and cold start): rows timed in their program's step, and the CPU model's prices when
    # its probe measured the in-step ratio (``in_step_calibration.py``)
    in_step_sources: frozenset = frozenset({PriceSource.MEASURED_IN_STEP.value})

    def holds_in_step(self, source: str) -> bool:
        """Whether a kernel priced from ``source`` already holds its op switch and cold start."""
        return source in self.in_step_sources

    @classmethod
    def from_records(cls, records: Sequence[KernelRecord], device_kind: str,
                     l2_bytes: Optional[int] = None, probed: Optional[Mapping[str, float]] = None) -> "HostCosts":
        """The database's rows, each missing event from ``probed`` (this host's probe, ``host_probe``), else
        the defaults of ``device_kind`` ("cpu"/"cuda")."""
        found = {event_of(r.key): r.median_ns for r in records if event_of(r.key) is not None}
        defaults = {**DEFAULT_NS["cpu" if device_kind == "cpu" else "cuda"], **(probed or {})}
        needed = [e for e in EVENTS if e not in OPTIONAL_EVENTS]
        source = ("measured" if all(e in found for e in needed) else "partly measured" if found
                  else "this host's probe and defaults" if probed else "default")
        return cls({e: found.get(e, defaults[e]) for e in EVENTS}, source,
                   l2_cache_bytes() if l2_bytes is None else int(l2_bytes))

    def cold_fraction(self, previous_bytes: float) -> float:
        """How much of a full cold start host code pays after a kernel that moved ``previous_bytes``."""
        return min(1.0, max(float(previous_bytes), 0.0) / max(self.l2_bytes, 1))

    def entry_ns(self, train: bool, graph_inputs: int, previous_bytes: float = 0.0) -> float:
        """Host time to enter a step's compiled graphs (forward, and the backward in training), after a
        kernel that moved ``previous_bytes`` (0: warm)."""
        fixed, per_input, cold = ((TRAIN_CALLS, TRAIN_CALLS_PER_INPUT, TRAIN_CALLS_COLD) if train
                                  else (GRAPH_CALL, GRAPH_CALL_PER_INPUT, GRAPH_CALL_COLD))
        return (self.values[fixed] + self.values[per_input] * graph_inputs
                + self.values[cold] * self.cold_fraction(previous_bytes))

    def cold_start_ns(self, previous_bytes: float, price_ns: float, measured: bool) -> float:
        """The cold start one kernel pays after a kernel that moved ``previous_bytes``, less the one its
        price holds (``measured`` on the CPU protocol for ``MIN_SAMPLE_NS`` or more: after a cache flush)."""
        held = self.values[OP_COLD] if _holds_cold_start(price_ns, measured) else 0.0
        return self.values[OP_COLD] * self.cold_fraction(previous_bytes) - held

    def switch_ns(self, previous_bytes: float, price_ns: float, measured: bool) -> float:
        """An eager kernel's dispatch after a different op (module doc, 3): the part of a cold start the
        predecessor's bytes leave out, none for a price measured after a flush (it holds a whole one)."""
        if _holds_cold_start(price_ns, measured):
            return 0.0
        return self.values[OP_SWITCH] * (1.0 - self.cold_fraction(previous_bytes))

    def alias_ns(self, count: int) -> float:
        """Dispatch of ``count`` aliasing (zero-priced) aten ops run eagerly."""
        return self.values[ALIAS_OP] * count

    def fsdp_ns(self, params: int) -> float:
        """FSDP2's hooks for one unit of ``params`` parameters, once a step (framework_overheads.py)."""
        return self.values[FSDP_UNIT] + self.values[FSDP_PARAM] * params

    def tp_ns(self, linears: int) -> float:
        """DTensor's host work for ``linears`` tensor-parallel linears, once a step (framework_overheads.py)."""
        return self.values[TP_LINEAR] * linears

    def autograd_ns(self, nodes: int) -> float:
        """The autograd engine's own work for ``nodes`` graph nodes (record, schedule, hand over gradients)."""
        return self.values[AUTOGRAD_NODE] * nodes


def _holds_cold_start(price_ns: float, measured: bool) -> bool:
    """A price measured on the CPU protocol for ``MIN_SAMPLE_NS`` or more was taken after a cache flush."""
    return measured and price_ns >= MIN_SAMPLE_NS


class _Calibration(torch.nn.Module):
    """``n`` tiny Linear layers, a ReLU and a mean: kernels of a few microseconds, so that a compiled call
    is almost all entry; ``n`` sets the number of graph inputs (2n parameters and x)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layers(x)).mean()


class _Polluter:
    """What a large kernel leaves the next host code: a fill of four L2s of data (L1 and L2 evicted).
    Each cold sample follows one. Measured here, a one-element op pays 25 us after it, 24-33 us after a
    512^3 matmul, a 4-16 MB add or a 64 MiB fill; dynamo's entry pays 70-85 us (after 2-8 ms of matmuls
    instead, 240-570 us: more than a fill leaves, and unsteady from run to run, so not the calibration)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(l2_cache_bytes(), dtype=torch.float32)     # 4 bytes x L2

    def __call__(self) -> None:
        self.buffer.fill_(1.0)


class _RecordedGraphs:
    """The Inductor graphs a ``torch.compile`` call compiles (forward, and backward in training), and the
    inputs of their last call, so that they can be called again without dynamo and AOTAutograd above."""

    def __init__(self) -> None:
        self.graphs: list[Any] = []
        self.calls: list[tuple[Any, list]] = []

    def inner_compile(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        self.graphs.append(compiled)
        return compiled

    def backend(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs, inner_compile=self.inner_compile)

    def record(self, step: Callable[[], None]) -> None:
        """Run ``step`` once, keeping each graph's inputs (Inductor clears the list it is given)."""
        originals = [g.current_callable for g in self.graphs]
        for graph, original in zip(self.graphs, originals):
            def keep(inputs: list, graph: Any = graph, original: Any = original) -> Any:
                self.calls.append((graph, list(inputs)))
                return original(inputs)
            graph.current_callable = keep
        try:
            step()
        finally:
            for graph, original in zip(self.graphs, originals):
                graph.current_callable = original

    def replay(self) -> None:
        with torch.no_grad():     # as inside AOTAutograd's forward and the engine's backward
            for graph, inputs in self.calls:
                graph(list(inputs))


def _paired_median(first: Callable[[], Any], second: Callable[[], Any], clock: Callable[[], int], pairs: int,
                   before: Callable[[], Any]) -> float:
    """Median over interleaved pairs of time(first) - time(second), each call after ``before()``."""
    diffs = []
    for _ in range(pairs):
        before()
        t0 = clock()
        first()
        a = clock() - t0
        before()
        t0 = clock()
        second()
        diffs.append(a - (clock() - t0))
    return summarize(diffs)[0]


def _entry_ns(n: int, train: bool, clock: Callable[[], int], pairs: int) -> tuple[float, float, int]:
    """(warm, after the polluter) host time of entering the compiled graphs of ``_Calibration(n)``: a real
    compiled step minus its Inductor graphs called directly; and the graph inputs."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    module, x = _Calibration(n), torch.randn(4, 8)
    params = list(module.parameters())
    recorded = _RecordedGraphs()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=recorded.backend)

    def step() -> None:
        if train:
            compiled(x).backward()
            for p in params:
                p.grad = None
        else:
            with torch.no_grad():
                compiled(x)

    # no cache hits: every graph must go through inner_compile to be recorded
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        for _ in range(3):
            step()
    recorded.record(step)
    if len(recorded.calls) != (2 if train else 1):
        raise RuntimeError(f"calibration compiled {len(recorded.calls)} graphs, expected {2 if train else 1}")
    warm = _paired_median(step, recorded.replay, clock, pairs, lambda: None)
    cold = _paired_median(step, recorded.replay, clock, pairs, _Polluter())
    torch._dynamo.reset()
    return warm, cold, len(params) + 1


def _op_cold_ns(clock: Callable[[], int], pairs: int) -> float:
    """A one-element ``add`` after the polluter minus the same warm."""
    a, b = torch.ones(1), torch.ones(1)
    add = torch.ops.aten.add.Tensor
    pollute = _Polluter()
    samples = []
    for _ in range(pairs):
        add(a, b)
        t0 = clock()
        add(a, b)
        warm = clock() - t0
        pollute()
        t0 = clock()
        add(a, b)
        samples.append((clock() - t0) - warm)
    return max(summarize(samples)[0], 0.0)


# small ops of distinct code paths (``_op_switch_ns``) and aliasing ops (``_alias_op_ns``), on 16x16 operands
def _distinct_ops(x: torch.Tensor, y: torch.Tensor) -> list[Callable[[], Any]]:
    aten = torch.ops.aten
    positive, mask = x.abs() + 1.0, x > 0
    return [lambda: aten.add.Tensor(x, y), lambda: aten.mul.Tensor(x, y), lambda: aten.sub.Tensor(x, y),
            lambda: aten.div.Tensor(x, positive), lambda: aten.neg.default(x), lambda: aten.exp.default(x),
            lambda: aten.relu.default(x), lambda: aten.sigmoid.default(x), lambda: aten.tanh.default(x),
            lambda: aten.sum.dim_IntList(x, [1]), lambda: aten.mean.dim(x, [1]), lambda: aten.mm.default(x, y),
            lambda: aten.clone.default(x), lambda: aten.where.self(mask, x, y), lambda: aten.pow.Tensor_Scalar(x, 2),
            lambda: aten.rsqrt.default(positive), lambda: aten.cat.default([x, y]),
            lambda: aten._softmax.default(x, 1, False),
            lambda: aten.gelu.default(x), lambda: aten.silu.default(x)]


def _alias_ops(x: torch.Tensor) -> list[Callable[[], Any]]:
    aten = torch.ops.aten
    return [lambda: aten.view.default(x, [256]), lambda: aten.t.default(x), lambda: aten.transpose.int(x, 0, 1),
            lambda: aten.expand.default(x, [16, 16]), lambda: aten.unsqueeze.default(x, 0),
            lambda: aten.slice.Tensor(x, 0, 0, 8), lambda: aten.alias.default(x),
            lambda: aten._unsafe_view.default(x, [256]),
            lambda: aten.permute.default(x, [1, 0]), lambda: aten.select.int(x, 0, 1)]


def _per_call_ns(calls: Sequence[Callable[[], Any]], clock: Callable[[], int], loops: int, samples: int) -> float:
    """Median over ``samples`` of the time of ``loops`` runs of every call in turn, per call."""
    for _ in range(max(loops // 10, 1)):
        for call in calls:
            call()
    times = []
    for _ in range(samples):
        t0 = clock()
        for _ in range(loops):
            for call in calls:
                call()
        times.append((clock() - t0) / (loops * len(calls)))
    return summarize(times)[0]


def _op_switch_ns(clock: Callable[[], int], samples: int) -> float:
    """Per op, a chain of distinct small ops minus the same ops each repeated (as kernels are measured)."""
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    calls = _distinct_ops(x, y)
    chained = _per_call_ns(calls, clock, 50, samples)
    alone = statistics.fmean(_per_call_ns([call], clock, 200, samples) for call in calls)
    return max(chained - alone, 0.0)


def _alias_op_ns(clock: Callable[[], int], samples: int) -> float:
    """Per op, a chain of distinct aliasing ops."""
    return _per_call_ns(_alias_ops(torch.randn(16, 16)), clock, 100, samples)


def _autograd_node_ns(clock: Callable[[], int], samples: int, length: int = 50) -> float:
    """Per autograd node: a chain of ``length`` ops (scalar ``mul`` and ``neg`` in turn, whose backward is
    one op of the same kind and size) run forward and backward on a tensor requiring grad, less twice the
    same forward without autograd (the backward's own ops)."""
    x, leaf, grad = torch.randn(16, 16), torch.randn(16, 16, requires_grad=True), torch.ones(16, 16)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for i in range(length):
            t = t * 1.01 if i % 2 == 0 else -t
        return t

    def step() -> None:
        chain(leaf).backward(grad)

    plain = _per_call_ns([lambda: chain(x)], clock, 20, samples)
    trained = _per_call_ns([step], clock, 20, samples)
    return max((trained - 2.0 * plain) / length, 0.0)


def measure_host_costs(measurer: Optional[Measurer] = None, pairs: int = 60,
                       compiled: bool = True) -> dict[str, Measurement]:
    """Measure the events on this host's CPU with the measurer's clock: ``pairs`` interleaved samples
    each; the entry events (calibration at 1 and 32 layers) only with ``compiled``."""
    measurer = measurer if measurer is not None else Measurer("cpu")
    clock = time.thread_time_ns if measurer.cpu_clock == "thread" else time.perf_counter_ns
    samples = max(pairs // 6, 3)
    values: dict[str, float] = {OP_COLD: _op_cold_ns(clock, 4 * pairs), OP_SWITCH: _op_switch_ns(clock, samples),
                                ALIAS_OP: _alias_op_ns(clock, samples),
                                AUTOGRAD_NODE: _autograd_node_ns(clock, samples)}
    events = ((False, GRAPH_CALL, GRAPH_CALL_PER_INPUT, GRAPH_CALL_COLD),
              (True, TRAIN_CALLS, TRAIN_CALLS_PER_INPUT, TRAIN_CALLS_COLD)) if compiled else ()
    for train, fixed, per_input, cold in events:
        (warm_s, cold_s, n_small), (warm_l, _, n_large) = (_entry_ns(n, train, clock, pairs) for n in _LAYERS)
        slope = max((warm_l - warm_s) / (n_large - n_small), 0.0)
        values[fixed] = max(warm_s - slope * n_small, 0.0)
        values[per_input] = slope
        values[cold] = max(cold_s - warm_s, 0.0)
    return {e: Measurement(v, v, v, pairs, v, 0, measurer.source) for e, v in values.items()}


def collect_host_costs(store: Any, measurer: Optional[Measurer] = None, pairs: int = 60,
                       compiled: bool = True) -> list[str]:
    """Measure the events this store lacks for the measurer's fingerprint (all of them, or only the eager
    ones without ``compiled``) and store them; returns the events stored."""
    measurer = measurer if measurer is not None else Measurer("cpu")
    fingerprint = measurer.fingerprint()
    wanted = [e for e in EVENTS if e not in OPTIONAL_EVENTS] if compiled else EAGER_EVENTS
    with store:
        have = store.key_hashes(fingerprint)
    if all(host_key(e).key_hash in have for e in wanted):
        return []
    measured = measure_host_costs(measurer, pairs=pairs, compiled=compiled)
    with store:
        store.put_many([m.record(fingerprint, host_key(e)) for e, m in measured.items()])
    return list(measured)
