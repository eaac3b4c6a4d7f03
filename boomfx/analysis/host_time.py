"""Where a step's host time outside its kernels' prices goes in the schedule.

Three terms, priced by ``kernels_db/host_overheads.py`` (measured rows of the database, else defaults):

- **cold starts** (CPU targets): the host code of a kernel run right after a kernel that streamed the
  L2 (dispatch, Inductor's wrapper) finds its caches evicted. Each kernel's time on the one CPU thread
  grows by ``HostCosts.cold_start_ns(bytes of the kernel before it, its price)``; the step is a loop, so
  an eager step's first kernel follows its last one.
- **eager dispatch** (CPU targets, eager): each kernel after a different op pays ``HostCosts.switch_ns``
  (its dispatch path is no longer hot, as it was while its price was measured; a price timed inside its
  program's step, ``kernels_db/in_step.py``, holds its switch and cold start: neither is added), and the program's
  aliasing aten ops (priced at zero as kernels: views, transposes, ``.item()``) cost
  ``HostCosts.alias_ns`` each, charged to the kernel after them (``host_ops_before``); a training step
  also pays the autograd engine, ``HostCosts.autograd_ns`` per node of the graph eager autograd builds
  (``autograd_nodes``), spread over the backward's kernels; a rank program the distributed frameworks'
  own host work (``framework_ns``: FSDP2's hooks per unit, DTensor's per tensor-parallel linear;
  kernels_db/framework_overheads.py).
  Kernels and views ATen's own C++ loops issue (a GRU's per-step cell ops and their backward,
  ``META_NATIVE_LOOP``) pay no switch and no aliasing-op cost: no Python runs between them, and the loop
  body's few ops stay hot.
- **graph entries** (``--compile``): dynamo's guards and AOTAutograd's wrappers before the forward's first
  kernel, and the backward graph's call and gradient hand-over before the backward's first kernel, as
  host-only entries (no kernel, no report row). On a CPU target they follow the step's last kernel (the
  step is a loop) and pay its cold fraction.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Container, Optional, Sequence

import torch

from boomfx.core.program import (META_FSDP_UNIT, META_NATIVE_LOOP, META_TP_LINEAR, PHASE_BACKWARD, PHASE_FORWARD,
                                 PHASE_RECOMPUTE, ROLE_PARAM)
from boomfx.kernels_db.price import DATABASE_SOURCES
from boomfx.simulate.timeline import ScheduledKernel

_MEASURED = tuple(source.value for source in DATABASE_SOURCES)   # report sources priced from database rows


def with_cold_starts(kernels: Sequence[Any], scheduled: list[ScheduledKernel], costs: Any,
                     compiled: bool) -> tuple[list[ScheduledKernel], list[float]]:
    """``scheduled`` (index-aligned with ``kernels``, KernelReports) with each kernel's cold start added
    to its time on the CPU thread (never below zero), and what was added to each. A compiled step's
    first kernel follows the graph entry's own host code (warm), an eager step's the step's last kernel."""
    out: list[ScheduledKernel] = []
    added: list[float] = []
    for i, (kernel, sk) in enumerate(zip(kernels, scheduled)):
        extra = 0.0 if (i == 0 and compiled) or costs.holds_in_step(kernel.source) else costs.cold_start_ns(
            kernels[i - 1].bytes_moved, kernel.time_ns, kernel.source in _MEASURED)
        device_ns = max(sk.device_ns + extra, 0.0)
        added.append(device_ns - sk.device_ns)
        out.append(dataclasses.replace(sk, device_ns=device_ns))
    return out, added


# export and trace artefacts that eager code never dispatches (asserts, the detach of each tensor saved for
# the backward), and size queries (Python attribute reads)
_NOT_DISPATCHED = ("sym_", "_assert", "detach")


def _dispatched(node: Any) -> bool:
    """Whether eager PyTorch dispatches ``node``'s aten op (not an export or trace artefact)."""
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
            and not target.__name__.startswith(_NOT_DISPATCHED))


def _counted_before(nodes: Sequence[Any], priced: Container[str], counted: Callable[[Any], bool]) -> dict[str, int]:
    """For each priced node, how many nodes ``counted`` accepts (never kernels themselves: a collective is
    priced but runs on its own stream) run between the kernel before it and itself; those after the last
    kernel go to the first (the step is a loop)."""
    out: dict[str, int] = {}
    pending = 0
    first: Optional[str] = None
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.name in priced and not counted(node):
            out[node.name] = pending
            first = first or node.name
            pending = 0
        elif counted(node):
            pending += 1
    if first is not None:
        out[first] += pending
    return out


def host_ops_before(nodes: Sequence[Any], priced: Container[str]) -> dict[str, int]:
    """For each priced node, how many aliasing aten ops (unpriced, dispatched eagerly from Python) run between
    the kernel before it and itself (those ATen's own C++ loops issue, ``META_NATIVE_LOOP``, cost no Python)."""
    return _counted_before(nodes, priced, lambda node: node.name not in priced and _dispatched(node)
                           and not node.meta.get(META_NATIVE_LOOP))


def native_loop_nodes(nodes: Sequence[Any]) -> set[str]:
    """The nodes ATen's own C++ loops issue (a recurrent layer's per-step cell ops): no op switch through
    Python between them."""
    return {node.name for node in nodes if node.meta.get(META_NATIVE_LOOP)}


def tp_linears_before(nodes: Sequence[Any], priced: Container[str]) -> dict[str, int]:
    """For each priced node, how many tensor-parallel linears' collectives (``META_TP_LINEAR``) run between
    the kernel before it and itself: each stands for one parallel linear's DTensor host work."""
    return _counted_before(nodes, priced, lambda node: bool(node.meta.get(META_TP_LINEAR)))


def autograd_nodes(program: Any) -> int:
    """The autograd graph an eager training step builds: one node per forward (or recomputed) aten op
    that reads a tensor requiring grad (the parameters, and what is computed from them), and one
    AccumulateGrad per parameter."""
    requires: set[str] = set()
    nodes = 0
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if program.input_roles.get(node.name) == ROLE_PARAM:
                requires.add(node.name)
                nodes += 1
            continue
        if node.op != "call_function" or program.phase_of(node) not in (PHASE_FORWARD, PHASE_RECOMPUTE):
            continue
        if not any(isinstance(a, torch.fx.Node) and a.name in requires for a in node.all_input_nodes):
            continue
        requires.add(node.name)
        nodes += _dispatched(node)
    return nodes


def with_autograd(kernels: Sequence[Any], scheduled: list[ScheduledKernel], costs: Any,
                  nodes: int) -> tuple[list[ScheduledKernel], list[float]]:
    """``scheduled`` with the engine's work for ``nodes`` autograd nodes spread over the backward's kernels
    (where the engine runs it), and what was added to each."""
    backward = [k.phase == PHASE_BACKWARD for k in kernels]
    share = costs.autograd_ns(nodes) / max(sum(backward), 1)
    added = [share if b else 0.0 for b in backward]
    return [dataclasses.replace(sk, device_ns=sk.device_ns + a) for sk, a in zip(scheduled, added)], added


def fsdp_units(nodes: Sequence[Any]) -> dict[str, int]:
    """Node name -> parameter count of the FSDP unit whose post-backward it is (``META_FSDP_UNIT``, set by
    the rank rewrite on the unit's ``_chunk_cat``): where FSDP2's hooks for that unit are charged."""
    return {n.name: int(n.meta[META_FSDP_UNIT]) for n in nodes if n.meta.get(META_FSDP_UNIT) is not None}


def framework_ns(nodes: Sequence[Any], priced: Container[str], costs: Any) -> dict[str, float]:
    """Per priced node, the host work torch.distributed's frameworks do there (kernels_db/
    framework_overheads.py): FSDP2's hooks of the unit whose post-backward it is (``fsdp_units``), and
    DTensor's for the tensor-parallel linears whose collectives run just before it (``tp_linears_before``)."""
    out = {name: costs.fsdp_ns(params) for name, params in fsdp_units(nodes).items()}
    for name, linears in tp_linears_before(nodes, priced).items():
        if linears:
            out[name] = out.get(name, 0.0) + costs.tp_ns(linears)
    return out


def with_eager_dispatch(kernels: Sequence[Any], scheduled: list[ScheduledKernel], costs: Any,
                        host_ops: Sequence[int], framework: Optional[Sequence[float]] = None,
                        native_loop: Container[str] = ()) -> tuple[list[ScheduledKernel], list[float]]:
    """``scheduled`` with each eager kernel's switch and the aliasing ops before it (``host_ops``, aligned
    with ``kernels``) added to its time on the CPU thread, and the distributed frameworks' host work charged
    to it (``framework``, ns, aligned too); what was added to each. A kernel ATen's C++ loop issues
    (``native_loop``, node names) after another of that loop pays no switch: the switch is Python's."""
    out: list[ScheduledKernel] = []
    added: list[float] = []
    framework = framework or [0.0] * len(kernels)
    for i, (kernel, sk) in enumerate(zip(kernels, scheduled)):
        in_loop = kernel.node in native_loop and i > 0 and kernels[i - 1].node in native_loop
        switch = (0.0 if costs.holds_in_step(kernel.source) or in_loop else
                  costs.switch_ns(kernels[i - 1].bytes_moved, kernel.time_ns, kernel.source in _MEASURED))
        extra = switch + costs.alias_ns(host_ops[i]) + framework[i]
        added.append(extra)
        out.append(dataclasses.replace(sk, device_ns=sk.device_ns + extra))
    return out, added


def with_graph_entries(kernels: Sequence[Any], scheduled: list[ScheduledKernel], costs: Any, train: bool,
                       graph_inputs: int, cpu: bool) -> tuple[list[ScheduledKernel], set[int]]:
    """``scheduled`` with the compiled graphs' entries inserted, and the indices of those entries."""
    if not kernels:
        return scheduled, set()
    first_backward = next((i for i, k in enumerate(kernels) if k.phase == PHASE_BACKWARD), None)
    before = kernels[-1].bytes_moved if cpu else 0.0      # the step is a loop: its last kernel came before
    forward_ns = costs.entry_ns(False, graph_inputs, before)
    at = {0: ("compiled forward call", forward_ns)}
    if train and first_backward is not None:
        # the training terms were measured for both calls together: what the forward's leave is the
        # backward's (on a CPU, where the cold terms are, the split does not change the step's time)
        at[first_backward] = ("compiled backward call", max(costs.entry_ns(True, graph_inputs, before) - forward_ns, 0.0))
    out: list[ScheduledKernel] = []
    entries: set[int] = set()
    for i, sk in enumerate(scheduled):
        if i in at:
            name, ns = at[i]
            entries.add(len(out))
            out.append(ScheduledKernel(name, 0.0 if cpu else ns, ns if cpu else 0.0))
        out.append(sk)
    return out, entries
