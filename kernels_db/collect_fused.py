"""Measure compiled (Inductor) fused kernels on the local device and store them like eager kernels.

A compiled program (``ProgramOptions(compile=True)``) prices each fused group through the OpCall of
``boomfx::fused(inputs, scalars, desc)`` (``passes/compiled.py``). Its kernel key is the canonical
description of the group (member ops and wiring, ``desc``) plus the bound input shapes/strides/dtypes,
so it is stored and looked up exactly like an eager aten kernel. Running the op compiles the group with
Inductor once per shape (``compile_fx`` on the group's aten graph, no dynamo guards in the timed call);
``FusedMeasurer`` times that compiled callable directly, as Inductor's graph calls its kernels. The CLI
entry point is ``boomfx kernels collect --for model.pt2 --compile``.

Example::

    analysis = Analysis(capture(ep, options=ProgramOptions(compile=True, target_kind="cpu")), get_device("cpu"))
    with Store(default_db_path("cpu")) as store:
        result = collect_fused(store, analysis, bindings)

Known limitations:
- Host overhead on CPU is the calibrated one-element ``aten.add`` dispatch (a one-element call of a
  compiled group would recompile it); on CPU it is part of the measured time anyway.
- Each unique group costs one Inductor compilation (seconds on a small CPU).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import sympy
import torch

from boomfx.kernels_db.collect import CollectResult, collect_calls
from boomfx.kernels_db.host_overheads import collect_host_costs
from boomfx.kernels_db.keys import SymbolicKeyError, UnkeyableCallError, kernel_key
from boomfx.kernels_db.measure import Measurer
from boomfx.kernels_db.schema import KernelKey
from boomfx.kernels_db.store import Store
from boomfx.passes.fused_op import compiled_group
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.opcall import bind_call


class FusedMeasurer(Measurer):
    """A Measurer that times a compiled group as Inductor's graph calls it, and whose CPU host estimate
    never re-runs a compiled group on one-element inputs."""

    @staticmethod
    def timed_call(op: Any, args: list, kwargs: dict) -> Any:
        """The compiled group itself, called directly: a compiled graph calls each kernel from its Python
        wrapper (~1-2 us a call here), not through the ``boomfx::fused`` custom op (its Python dispatch
        costs ~4.3 us and ``run_fused``'s per-call shape lookup ~1.1 us on the dev CPU: measured with a
        one-element group, 9.2 us through the op vs 3.8 us for the compiled callable)."""
        if getattr(op, "_schema", None) is None or op._schema.name != "boomfx::fused":
            return Measurer.timed_call(op, args, kwargs)
        inputs, scalars, desc = args
        compiled = compiled_group(desc, tuple(int(s) for s in scalars), inputs)
        return lambda: compiled(*inputs)

    def _cpu_host_ns(self, key: KernelKey) -> float:
        return self._calibrated_host_ns()

    @staticmethod
    def _cpu_workspace_bytes(op: Any, args: list, kwargs: dict) -> int:
        return 0   # Inductor's scratch is inside its kernels; temporaries are graph buffers already


def fused_calls(analysis: Any, bindings: Mapping[sympy.Symbol, int]) -> list[OpCall]:
    """The bound ``boomfx::fused`` OpCalls of a compiled analysis at ``bindings``."""
    ev = analysis.evaluator(bindings)
    calls = []
    for node in analysis.program.graph.nodes:
        if not getattr(node.target, "boomfx_fused", False):
            continue
        nc = analysis.costs.by_node.get(node.name)
        if nc is not None:
            calls.append(bind_call(nc.call, ev))
    return calls


def collect_fused(
    store: Store,
    analysis: Any,
    bindings: Mapping[sympy.Symbol, int],
    device: Union[str, torch.device] = "cpu",
    **options: Any,
) -> CollectResult:
    """Compile, time and store every unique fused group of ``analysis`` the store lacks.

    Args:
        store: the device's kernel database.
        analysis: an ``Analysis`` of a compiled program (``ProgramOptions(compile=True)``).
        bindings: the symbol values to measure at (``resolve_bindings``).
        device: where to measure with the default ``FusedMeasurer``; ignored when ``measurer`` is given.
        options: ``budget_s``, ``progress`` and ``measurer``, as in ``collect.collect_calls``.
    """
    if options.get("measurer") is None:
        options["measurer"] = FusedMeasurer(device)
    calls = [call for call in fused_calls(analysis, bindings) if _keyable(call)]
    return collect_calls(store, calls, **options)


def collect_compiled(
    store: Store,
    analysis: Any,
    bindings: Mapping[sympy.Symbol, int],
    measurer: Measurer,
    fused_measurer: "FusedMeasurer",
    budget_s: Optional[float] = None,
    progress: Any = None,
) -> tuple[CollectResult, CollectResult]:
    """Everything a compiled program runs, the store lacks: its fused groups (``fused_measurer``), then
    its library kernels (matmuls, convolutions, attention, the eager optimizer step: ``measurer``) in
    what is left of ``budget_s``. On a CPU it also measures, once per database, the host costs of entering
    compiled graphs and of cold starts (``host_overheads``). Returns (fused, library) results."""
    if torch.device(measurer.device).type == "cpu":
        collect_host_costs(store, measurer)       # graph entry and cold starts, once per database
    fused = collect_fused(store, analysis, bindings, budget_s=budget_s, progress=progress, measurer=fused_measurer)
    if budget_s is not None:
        budget_s = max(budget_s - fused.elapsed_s, 1.0)
    calls = [c for c in analysis.kernel_calls(bindings) if not str(c.op).startswith("boomfx.") and _keyable(c)]
    return fused, collect_calls(store, calls, budget_s=budget_s, progress=progress, measurer=measurer)


def _keyable(call: OpCall) -> bool:
    try:
        kernel_key(call)
    except (SymbolicKeyError, UnkeyableCallError):
        return False   # a data-dependent scalar (no fixed kernel to measure): priced by its roofline
    return True
