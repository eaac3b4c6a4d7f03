"""Host time of a compiled step outside its kernels: entering the compiled graphs.

A ``torch.compile``'d forward is entered through dynamo (frame evaluation, the cache lookup, guard
checks on every parameter and input) and AOTAutograd's runtime wrappers before Inductor's ``call`` runs
the kernels; in training the forward is an ``autograd.Function`` and the backward graph is called by the
autograd engine, which then hands each parameter its gradient (AccumulateGrad). The database times
fused groups as Inductor's compiled callables (``collect_fused``) and extern kernels as eager ATen
calls: none of that is in a kernel's price. So a compiled step costs, on top of its kernels::

    inference:  graph_call  + graph_call_per_input  * graph inputs
    training:   train_calls + train_calls_per_input * graph inputs   (forward and backward)

``measure_compiled_call_overheads`` measures each term as the median difference between a real
compiled step of a calibration module (tiny Linear layers, at two depths: the per-input slope, as
dynamo guards every parameter and AOTAutograd unpacks and returns each one) and the Inductor graphs it
compiled, recorded and called directly. Where the step runs matters most: that Python code is ~10x
slower after real kernels than in a warm loop (its caches and predictors are gone), so for a CPU target,
whose kernels run on the same core, every sample follows ~2 ms of matmuls (``_Polluter``: "in situ");
a GPU target's host only issues kernels and is measured warm. ``boomfx kernels collect --compile`` on a
CPU stores the in-situ values as rows of op ``HOST_OP`` next to the kernels; ``Analysis`` adds them to
the step (``Analysis._with_graph_entries``), or ``DEFAULT_NS`` of the target's kind without them.

Measured on the 2-vCPU development VM (torch 2.13, one thread, thread CPU time), see ``DEFAULT_NS``:
warm, ~46 us per inference call and ~140 us + ~6 us per input for a training forward + backward; in
situ ~500 us and ~900 us + ~7 us per input (one earlier run: 290 and 610 us: the machine's other tenants
move it). Cross-check in situ on real models (a steady-state loop of ``torch.compile(model)`` calls
minus its graph called directly): 210-364 us for the tiny GPT/Llama/MLP inference, 800-1000 us for a
small MLP's training step.

Known limitations:
- One backward per forward, no graph breaks (each break is another graph call; boomfx traces one graph).
- The per-input slope is measured with parameters; buffers and user inputs are priced the same.
- In situ values depend on what ran before (a 64 MiB data fill instead of the matmuls: ~170 us) and on
  the host's other tenants: a calibration, not a law. The kernels' own host code (Inductor's wrapper
  between kernels, eager dispatch) is still priced as the database measured it.
- GPU defaults come from the development CPU; a database collected on the GPU's host does not
  measure them yet (its collector measures the CPU target's in-situ values only on a CPU).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from boomfx.kernels_db.measure import Measurement, Measurer, summarize
from boomfx.kernels_db.schema import KernelKey, KernelRecord, canonical_json

HOST_OP = "boomfx::host"
GRAPH_CALL = "graph_call"
GRAPH_CALL_PER_INPUT = "graph_call_per_input"
TRAIN_CALLS = "train_calls"
TRAIN_CALLS_PER_INPUT = "train_calls_per_input"
EVENTS = (GRAPH_CALL, GRAPH_CALL_PER_INPUT, TRAIN_CALLS, TRAIN_CALLS_PER_INPUT)

# Measured on the development CPU (measure_compiled_call_overheads, thread CPU time), per target kind.
# Warm ("cuda": the host only issues kernels), three runs: graph_call 46.5/46.0/46.9 us, per input
# 0.37/0.44/0.38 us; train_calls 149/144/136 us, per input 5.2/5.8/6.6 us. In situ ("cpu"), three runs:
# graph_call 513/516/571 us, per input 0.3/0/0.6 us; train_calls 940/864/951 us, per input 7.4/6.7/6.3 us.
DEFAULT_NS: Mapping[str, Mapping[str, float]] = {
    "cuda": {GRAPH_CALL: 46_000.0, GRAPH_CALL_PER_INPUT: 400.0, TRAIN_CALLS: 143_000.0, TRAIN_CALLS_PER_INPUT: 5_800.0},
    "cpu": {GRAPH_CALL: 516_000.0, GRAPH_CALL_PER_INPUT: 300.0, TRAIN_CALLS: 940_000.0, TRAIN_CALLS_PER_INPUT: 6_700.0},
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


@dataclass(frozen=True)
class CompiledCallCosts:
    """Per-call host costs of entering compiled graphs, in ns, and where they came from."""

    values: Mapping[str, float]
    source: str            # "measured" (a database row for every event) or "default"

    @classmethod
    def from_records(cls, records: Sequence[KernelRecord], device_kind: str) -> "CompiledCallCosts":
        """The database's rows when it has every event, else the defaults of ``device_kind`` ("cpu" or
        "cuda")."""
        found = {event_of(r.key): r.median_ns for r in records if event_of(r.key) is not None}
        if all(e in found for e in EVENTS):
            return cls(found, "measured")
        return cls(dict(DEFAULT_NS["cpu" if device_kind == "cpu" else "cuda"]), "default")

    def step_ns(self, train: bool, graph_inputs: int) -> float:
        """Host time to enter a step's compiled graphs (forward, and the backward in training)."""
        fixed, per_input = (TRAIN_CALLS, TRAIN_CALLS_PER_INPUT) if train else (GRAPH_CALL, GRAPH_CALL_PER_INPUT)
        return self.values[fixed] + self.values[per_input] * graph_inputs


class _Calibration(torch.nn.Module):
    """``n`` tiny Linear layers, a ReLU and a mean: kernels of a few microseconds, so that a compiled call
    is almost all entry; ``n`` sets the number of graph inputs (2n parameters and x)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layers(x)).mean()


class _Polluter:
    """What runs before each sample: ~2 ms of matmuls (4 x 512^3 on one core here), the work that
    precedes every graph entry of a real step. The entry's Python (dynamo's guards, AOTAutograd, the
    engine) then runs with the caches and predictors that work left, as in situ: on the development CPU
    a compiled call's entry took 47 us warm, 169 us after a 64 MiB data fill and 289 us after the
    matmuls; measured in steady-state loops of real models (a compiled call minus its graphs called
    directly) 210-364 us."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(512, 512, generator=gen)
        self.b = torch.randn(512, 512, generator=gen)

    def __call__(self) -> None:
        for _ in range(4):
            torch.mm(self.a, self.b)


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


def _entry_ns(n: int, train: bool, clock: Callable[[], int], pairs: int,
              pollute: Optional[_Polluter]) -> tuple[float, int]:
    """Median over interleaved pairs of (a real compiled step) - (its Inductor graphs called directly),
    each after ``pollute`` (if any): the host time of entering the graphs. Returns (ns, graph inputs)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    module, x = _Calibration(n), torch.randn(4, 8)
    pollute = pollute if pollute is not None else (lambda: None)
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
    diffs = []
    for _ in range(pairs):
        pollute()
        t0 = clock()
        step()
        whole = clock() - t0
        pollute()
        t0 = clock()
        recorded.replay()
        diffs.append(whole - (clock() - t0))
    torch._dynamo.reset()
    return summarize(diffs)[0], len(params) + 1


def measure_compiled_call_overheads(measurer: Optional[Measurer] = None, pairs: int = 60,
                                    in_situ: bool = True) -> dict[str, Measurement]:
    """Measure every event on this host's CPU (the thread that calls the compiled graphs), with the
    measurer's clock: ``pairs`` interleaved samples per calibration, at 1 and 32 layers. ``in_situ``:
    each sample after the polluter (a CPU target, whose kernels run on the same core); else warm (a GPU
    target's host, which only issues kernels)."""
    measurer = measurer if measurer is not None else Measurer("cpu")
    pollute = _Polluter() if in_situ else None
    clock = time.thread_time_ns if measurer.cpu_clock == "thread" else time.perf_counter_ns
    values: dict[str, float] = {}
    for train, fixed, per_input in ((False, GRAPH_CALL, GRAPH_CALL_PER_INPUT), (True, TRAIN_CALLS, TRAIN_CALLS_PER_INPUT)):
        (small, n_small), (large, n_large) = (_entry_ns(n, train, clock, pairs, pollute) for n in _LAYERS)
        slope = max((large - small) / (n_large - n_small), 0.0)
        values[fixed] = max(small - slope * n_small, 0.0)
        values[per_input] = slope
    return {e: Measurement(v, v, v, pairs, v, 0, measurer.source) for e, v in values.items()}


def collect_compiled_call_overheads(store: Any, measurer: Optional[Measurer] = None, pairs: int = 60) -> list[str]:
    """Measure the events in situ (a CPU target) and store them under the measurer's fingerprint;
    returns the events stored."""
    measurer = measurer if measurer is not None else Measurer("cpu")
    fingerprint = measurer.fingerprint()
    measured = measure_compiled_call_overheads(measurer, pairs=pairs)
    with store:
        store.put_many([m.record(fingerprint, host_key(e)) for e, m in measured.items()])
    return list(measured)
