"""Host time of a compiled step outside its kernels: entering the compiled graphs.

A ``torch.compile``'d forward is entered through dynamo (frame evaluation, the cache lookup, guard
checks on every parameter and input) and AOTAutograd's runtime wrappers before Inductor's ``call`` runs
the kernels; in training the forward is an ``autograd.Function`` and the backward graph is called by the
autograd engine, which then hands each parameter its gradient (AccumulateGrad). Fused groups are timed
as Inductor's compiled callables (``collect_fused``), which include that ``call`` but none of the layers
above it, and extern kernels are timed as eager ATen calls. So a compiled step costs, on top of its
kernels::

    inference:  graph_call      + graph_call_per_input      * graph inputs
    training:   train_calls     + train_calls_per_input     * graph inputs   (forward and backward)

Each term is measured on the host as the difference between a real compiled call and its kernels timed
the way the database times them (``measure_compiled_call_overheads``), on a calibration module of N
one-element parameters at two N (the per-input slope: dynamo guards every parameter, AOTAutograd
unpacks and returns each one). ``boomfx kernels collect --compile`` stores them as rows of op
``HOST_OP`` next to the kernels; ``Analysis`` adds them to the step (``compiled_call_ns``), or the
``DEFAULT_NS`` measured on the development CPU when the database has none.

Measured on the 2-vCPU development VM (torch 2.13, one thread, thread CPU time): see ``DEFAULT_NS``.
Entering one compiled forward costs ~30 us, a training forward + backward ~130 us plus ~2 us per
parameter: 0.2-1.7% of the CPU benchmark's steps (benchmarks/compiled_cpu_accuracy.py), more for a
small-batch GPU step that the host bounds.

Known limitations:
- One backward per forward, no graph breaks (each break is another graph call; boomfx traces one graph).
- The per-input slope is measured with parameters; buffers and user inputs are priced the same.
- On a GPU target these are the CPU host's costs: the defaults come from the development CPU unless a
  database collected on the GPU's own host is given.
"""
from __future__ import annotations

import json
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

# Measured on the development CPU (measure_compiled_call_overheads, thread CPU time, median of 3 runs).
# Three runs: graph_call 27.5/28.8/32.8 us, per input 0.42/0.29/0.21 us; train_calls 138/134/124 us, per
# input 1.6/1.7/3.0 us.
DEFAULT_NS: Mapping[str, float] = {GRAPH_CALL: 30_000.0, GRAPH_CALL_PER_INPUT: 300.0,
                                   TRAIN_CALLS: 130_000.0, TRAIN_CALLS_PER_INPUT: 2_000.0}
_SMALL_N, _LARGE_N = 1, 33


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
    def from_records(cls, records: Sequence[KernelRecord]) -> "CompiledCallCosts":
        found = {event_of(r.key): r.median_ns for r in records if event_of(r.key) is not None}
        if all(e in found for e in EVENTS):
            return cls(found, "measured")
        return cls(dict(DEFAULT_NS), "default")

    def step_ns(self, train: bool, graph_inputs: int) -> float:
        """Host time to enter a step's compiled graphs (forward, and the backward in training)."""
        fixed, per_input = (TRAIN_CALLS, TRAIN_CALLS_PER_INPUT) if train else (GRAPH_CALL, GRAPH_CALL_PER_INPUT)
        return self.values[fixed] + self.values[per_input] * graph_inputs


class _Calibration(torch.nn.Module):
    """N one-element parameters summed into the input: one fused kernel forward, one backward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(1)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for p in self.params:
            out = out + p
        return out.sum()


def _inductor_callable(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Callable[[], Any]:
    """``fn`` traced to ATen and compiled by Inductor alone, as ``passes.compiled`` compiles a group."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    compiled = compile_fx(make_fx(fn)(*inputs), list(inputs))
    return lambda: compiled(*inputs)


def _aot_graphs(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """AOTAutograd's forward and backward graphs of ``module(x)`` (what torch.compile hands Inductor)."""
    from functorch.compile import aot_module, make_boxed_func

    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example: Any) -> Any:
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    aot_module(module, fw_compiler=keep("fw"), bw_compiler=keep("bw"))(x).backward()
    return graphs["fw"], graphs["bw"]


def _example(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    return [torch.ones(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in gm.graph.nodes if n.op == "placeholder"]


def _graph_callable(gm: torch.fx.GraphModule) -> Callable[[], Any]:
    from torch._inductor.compile_fx import compile_fx

    inputs = _example(gm)
    compiled = compile_fx(gm, inputs)
    return lambda: compiled(*inputs)


def _median(measurer: Measurer, fn: Callable[[], Any]) -> float:
    return summarize(measurer._time_cpu(fn))[0]


def _inference_overhead_ns(measurer: Measurer, n: int) -> float:
    module, x = _Calibration(n).eval(), torch.ones(1)
    params = [p.detach() for p in module.params]

    def functional(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        out = x
        for p in ps:
            out = out + p
        return out.sum()

    torch._dynamo.reset()
    compiled = torch.compile(module)
    with torch.no_grad():
        whole = _median(measurer, lambda: compiled(x))
        kernels = _median(measurer, _inductor_callable(functional, [x, *params]))
    return whole - kernels


def _training_overhead_ns(measurer: Measurer, n: int) -> float:
    module, x = _Calibration(n), torch.ones(1)
    fw, bw = _aot_graphs(_Calibration(n), x)
    params = list(module.params)

    def reset() -> None:
        for p in params:
            p.grad = None

    torch._dynamo.reset()
    compiled = torch.compile(module)

    def step() -> None:
        compiled(x).backward()
        reset()

    whole = _median(measurer, step) - _median(measurer, reset)
    kernels = _median(measurer, _graph_callable(fw)) + _median(measurer, _graph_callable(bw))
    return whole - kernels


def measure_compiled_call_overheads(measurer: Optional[Measurer] = None) -> dict[str, Measurement]:
    """Measure every event on this host's CPU (the thread that calls the compiled graphs)."""
    measurer = measurer if measurer is not None else Measurer("cpu")
    values: dict[str, float] = {}
    for fixed, per_input, measure in ((GRAPH_CALL, GRAPH_CALL_PER_INPUT, _inference_overhead_ns),
                                      (TRAIN_CALLS, TRAIN_CALLS_PER_INPUT, _training_overhead_ns)):
        small, large = measure(measurer, _SMALL_N), measure(measurer, _LARGE_N)
        slope = max((large - small) / (_LARGE_N - _SMALL_N), 0.0)
        values[fixed] = max(small - slope * (_SMALL_N + 1), 0.0)     # graph inputs: the params and x
        values[per_input] = slope
    torch._dynamo.reset()
    return {e: Measurement(v, v, v, 1, v, 0, measurer.source) for e, v in values.items()}


def collect_compiled_call_overheads(store: Any, measurer: Optional[Measurer] = None) -> list[str]:
    """Measure the events and store them under the measurer's fingerprint; returns the events stored."""
    measurer = measurer if measurer is not None else Measurer("cpu")
    fingerprint = measurer.fingerprint()
    measured = measure_compiled_call_overheads(measurer)
    with store:
        store.put_many([m.record(fingerprint, host_key(e)) for e, m in measured.items()])
    return list(measured)
