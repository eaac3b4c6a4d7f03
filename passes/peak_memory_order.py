"""Inductor's reordering of each compiled graph for peak memory.

After fusion, Inductor's scheduler reorders the kernels of every graph it compiles
(``Scheduler._init`` -> ``reorder_for_peak_memory`` in torch/_inductor/memory.py, on by default:
``config.reorder_for_peak_memory``, torch 2.13): it estimates the graph's peak under its traced order and
under three topological orders (``lpmf``: least peak memory first, a greedy walk; ``bfs``: earliest
predecessors first; ``dfs``: smallest reads and writes first) and keeps the lowest, the traced order on a
tie. Its estimate counts each buffer from the kernel that writes it to the last kernel that reads it;
the graph's inputs that it may free (saved activations in a backward, never parameters or tangents:
``is_nonfreeable_buffers``) from the start to their last reader; and the graph's outputs to its end.

Why it matters: a weight gradient is a backward-graph output, read by nothing in the graph, so the
greedy orders compute it late instead of where the traced order has it (read in the output code of a
compiled ConvNeXt step: the last stage's MLP weight gradients, 2 MiB, are computed at the end of the
backward; traced order put them before the stage's convolutions and the predicted peak 2 MiB high).

``reorder_for_peak_memory(program)`` applies the same choice to each compiled graph of a compiled
program (the forward; the backward with its recomputation), on our fused kernels and extern ops: views
and ``getitem`` nodes are not kernels (Inductor's ``reinterpret_tensor``) and follow the kernel whose
storage they name; an in-place output (``FusedKernel.inplace``) counts as a buffer of its own, as in
Inductor's estimate (made before its memory planning), and its kernel runs after every other reader of
the storage it overwrites. A reordering is taken only where our estimate gains more than
``ESTIMATE_RESOLUTION``; where every graph keeps its order the program is returned unchanged. When the
backward is reordered, AccumulateGrad's eager copies move after it (they run once it has returned).
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx

from boomfx.core.fx_copy import copy_node
from boomfx.core.program import META_EAGER, PHASE_BACKWARD, PHASE_FORWARD, PHASE_RECOMPUTE, Program
from boomfx.passes.aliasing import output_aliases
from boomfx.passes.layout import size_hint
from boomfx.passes.liveness import liveness_pass

# Our buffers are a reconstruction of Inductor's (our fusion, our in-place reuse), so a reordered graph
# is taken only where its estimated gain is larger than that reconstruction resolves. Measured with
# Inductor's own estimates (TORCH_LOGS=+inductor, torch/_inductor/memory.py): it kept its traced order
# where ours gained 0.7% (tests' Linear-BatchNorm-ReLU6) and 2.4% (transformers ResNet backward; our
# estimate 10.1 MB against its 7.9 MB) and reordered where ours gained 15.5% (ConvNeXt backward: its
# own 16.2%) and 38% (tests/test_peak_memory_order.py).
ESTIMATE_RESOLUTION = 0.05

_GRAPH_OF_PHASE = {PHASE_FORWARD: "forward", PHASE_BACKWARD: "backward", PHASE_RECOMPUTE: "backward"}


@dataclass(eq=False)
class _Kernel:
    """One scheduler node: a kernel node and the views/getitems that name its storages."""
    index: int
    node: torch.fx.Node
    attached: list[torch.fx.Node] = field(default_factory=list)
    size: int = 0                                           # bytes its outputs allocate
    preds: set["_Kernel"] = field(default_factory=set)
    succs: set["_Kernel"] = field(default_factory=set)
    pred_buffers: set[int] = field(default_factory=set)     # storages it reads (last use frees them)
    outputs: list[int] = field(default_factory=list)        # storages it allocates


@dataclass
class _Buffer:
    size: int
    readers: set[_Kernel]
    graph_output: bool
    freeable_input: bool                                    # allocated before the graph, freed in it
    writer: Optional[_Kernel] = None                        # the kernel allocating it (None: an input)


def compiled_graph_runs(program: Program) -> dict[str, list[torch.fx.Node]]:
    """The nodes of each compiled graph ("forward", "backward" with its recomputation), in program order."""
    return _graph_runs(program)[0]


def _graph_runs(program: Program) -> tuple[dict[str, list[torch.fx.Node]], list[torch.fx.Node],
                                           dict[torch.fx.Node, Optional[str]]]:
    """``compiled_graph_runs``, AccumulateGrad's eager copies that run once the backward returned, and
    each node's graph (``_graph_of``)."""
    graph_of: dict[torch.fx.Node, Optional[str]] = {}
    members: dict[str, list[torch.fx.Node]] = {"forward": [], "backward": []}
    deferred: list[torch.fx.Node] = []
    for node in program.graph.nodes:
        graph = graph_of[node] = _graph_of(node, graph_of, program)
        if graph in members:
            members[graph].append(node)
        elif graph == "eager" and not any(graph_of.get(u) in members or _GRAPH_OF_PHASE.get(program.phase_of(u))
                                          for u in node.users if u.op == "call_function"
                                          and not u.meta.get(META_EAGER)):
            deferred.append(node)
    return members, deferred, graph_of


def reorder_for_peak_memory(program: Program) -> Program:
    """``program`` with each compiled graph's nodes in the order Inductor's memory pass picks."""
    nodes = list(program.graph.nodes)
    members, deferred, graph_of = _graph_runs(program)
    if sum(len(m) for m in members.values()) <= 2:
        return program
    info = liveness_pass(program, buffer_reuse=False)
    sizes = storage_sizes(info, program)
    creator = {iv.storage_id: iv.node for iv in info.intervals}
    made_by_kernel = {n.name for n in nodes if n.op == "call_function"}
    chosen = {graph: _reorder_run(run, info.node_storages, sizes, creator, made_by_kernel) if len(run) > 2 else None
              for graph, run in members.items()}
    if all(order is None for order in chosen.values()):
        return program                            # every graph keeps its traced order
    for graph, order in chosen.items():
        if order is None:
            chosen[graph] = members[graph]
    chosen["backward"] = chosen["backward"] + deferred
    placed = set(deferred)
    for run in members.values():
        placed.update(run)
    order: list[torch.fx.Node] = []
    for node in nodes:
        graph = graph_of[node] if node not in deferred else "backward"
        if node in placed:
            if graph in chosen and chosen[graph] is not None:
                order.extend(chosen[graph])       # the whole graph where its first node was
                chosen[graph] = None
            continue
        order.append(node)
    position = {n: i for i, n in enumerate(order)}
    if len(order) != len(nodes) or any(position[i] > position[n] for n in order for i in n.all_input_nodes):
        return program                            # a node the graphs read is made between them: keep the trace
    if order == nodes:
        return program
    new_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in order:
        env[node] = copy_node(new_graph, node, lambda n: env[n])
    return program.rewritten(new_graph)


def _graph_of(node: torch.fx.Node, graph_of: dict[torch.fx.Node, Optional[str]], program: Program) -> Optional[str]:
    """Which compiled graph runs ``node`` ("forward", "backward"), "eager" for a node the runtime runs
    itself, None for a placeholder, a constant or an optimizer node. A view or getitem belongs with
    the kernel whose storage it names, whatever its phase label (a view is not a kernel)."""
    if node.op != "call_function":
        return None
    if node.meta.get(META_EAGER):
        return "eager"
    src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if src is not None and src.op == "call_function" and _is_view(node):
        return graph_of.get(src)
    return _GRAPH_OF_PHASE.get(program.phase_of(node))


def storage_sizes(info: Any, program: Program) -> dict[int, int]:
    """Bytes of each storage at the sizes a compiled run specialises on."""
    out: dict[int, int] = {}
    for iv in info.intervals:
        try:
            out[iv.storage_id] = int(size_hint(iv.nbytes, program))
        except (TypeError, ValueError):
            out[iv.storage_id] = 0
    return out


def _is_view(node: torch.fx.Node) -> bool:
    """A node that names storages of its first argument without a kernel (a view, a getitem)."""
    aliases = output_aliases(node)
    return bool(aliases) and all(a is not None and not a[1] for a in aliases) \
        and not getattr(node.target, "boomfx_fused", False)


@dataclass
class GraphModel:
    """One compiled graph as Inductor's memory estimate sees it: its scheduler nodes in order, its buffers
    (keyed by storage id; an in-place output is a synthetic id of its own, ``inplace_of`` names the
    storage it is written over) and the views of storages made before the graph."""
    kernels: list[_Kernel]
    buffers: dict[int, _Buffer]
    leading: list[torch.fx.Node]
    storages: Callable[[torch.fx.Node], list[int]]
    inplace_of: dict[int, int]


def graph_model(run: list[torch.fx.Node], node_sids: Any, sizes: dict[int, int], creator: dict[int, str],
                made_by_kernel: set[str]) -> GraphModel:
    """The ``GraphModel`` of a compiled graph's nodes ``run`` (in order).
    ``made_by_kernel``: names of the program's call_function nodes; a storage one of them made before the
    run is a freeable graph input (a saved activation), a placeholder's never is."""
    in_run = set(run)
    kernels: list[_Kernel] = []
    kernel_of: dict[torch.fx.Node, _Kernel] = {}
    leading: list[torch.fx.Node] = []                 # views of storages made before the run
    for node in run:
        src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if _is_view(node) and src is not None:
            owner = kernel_of.get(src)
            if owner is not None:
                owner.attached.append(node)
                kernel_of[node] = owner
            elif src not in in_run:
                leading.append(node)
                continue
            else:
                k = _Kernel(len(kernels), node)
                kernels.append(k)
                kernel_of[node] = k
            continue
        k = _Kernel(len(kernels), node)
        kernels.append(k)
        kernel_of[node] = k
    made_here = {n.name for n in run}
    # Inductor estimates before its memory planning: an output a kernel will write over a dying input
    # (``FusedKernel.inplace``) is a buffer of its own there, allocated while that input is still live
    sids: dict[str, list[int]] = {}
    sizes = dict(sizes)
    fresh = {}
    inplace_of: dict[int, int] = {}
    for node in run:
        src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        own = list(node_sids.get(node.name, ()))
        if getattr(node.target, "boomfx_fused", False):
            for i, alias in enumerate(output_aliases(node)):
                if alias is not None and alias[1] and i < len(own):
                    synthetic = -1 - len(fresh)
                    sizes[synthetic] = sizes.get(own[i], 0)
                    fresh[synthetic] = node.name
                    inplace_of[synthetic] = own[i]
                    own[i] = synthetic
        elif _is_view(node) and src is not None and src.name in sids:
            base = sids[src.name]
            index = node.args[1] if node.target is operator.getitem else 0
            own = [base[index]] if isinstance(index, int) and index < len(base) else own
        sids[node.name] = own
    creator = {**creator, **fresh}

    def storages_of(n: torch.fx.Node) -> list[int]:
        return sids.get(n.name, list(node_sids.get(n.name, ())))

    buffers: dict[int, _Buffer] = {}
    for k in kernels:
        for n in [k.node] + k.attached:
            for sid in storages_of(n):
                if creator.get(sid) == n.name and sid not in buffers:
                    buffers[sid] = _Buffer(sizes.get(sid, 0), set(), False, False, k)
                    k.outputs.append(sid)
        k.size = sum(buffers[s].size for s in k.outputs)
    for k in kernels:
        for n in [k.node] + k.attached:
            for inp in n.all_input_nodes:
                owner = kernel_of.get(inp)
                if owner is not None and owner is not k:
                    k.preds.add(owner)
                    owner.succs.add(k)
                for sid in storages_of(inp):
                    buf = buffers.get(sid)
                    if buf is None and creator.get(sid) not in made_here and creator.get(sid) in made_by_kernel:
                        buf = buffers[sid] = _Buffer(sizes.get(sid, 0), set(), False, True)
                    if buf is not None and sid not in k.outputs:
                        buf.readers.add(k)
                        k.pred_buffers.add(sid)
    # an in-place kernel overwrites a storage: every other reader of the value it replaces runs first
    for k in kernels:
        for alias in output_aliases(k.node):
            if alias is None or not alias[1]:
                continue
            for reader in alias[0].users:
                r = kernel_of.get(reader)
                if r is not None and r is not k and r not in k.succs:
                    r.succs.add(k)
                    k.preds.add(r)
    # storages read after the run (a later graph, the optimizer, the output) are the graph's outputs
    for k in kernels:
        for n in [k.node] + k.attached:
            if any(u not in in_run for u in n.users):
                for sid in storages_of(n):
                    if sid in buffers:
                        buffers[sid].graph_output = True
    return GraphModel(kernels, buffers, leading, storages_of, inplace_of)


def _reorder_run(run: list[torch.fx.Node], node_sids: Any, sizes: dict[int, int], creator: dict[int, str],
                 made_by_kernel: set[str]) -> Optional[list[torch.fx.Node]]:
    """The run's nodes in the order Inductor's memory pass picks for it (see the module docstring), or
    None when it keeps the traced order (``graph_model`` for the arguments)."""
    model = graph_model(run, node_sids, sizes, creator, made_by_kernel)
    kernels, buffers, leading = model.kernels, model.buffers, model.leading
    methods: list[Callable[[list[_Kernel], dict[int, _Buffer]], list[_Kernel]]] = [_lpmf, _bfs, _dfs]
    baseline = _peak(kernels, buffers)
    best, best_peak = kernels, baseline
    for method in methods:
        order = method(kernels, buffers)
        if len(order) != len(kernels):
            continue
        peak = _peak(order, buffers)
        if peak < best_peak:
            best, best_peak = order, peak
    if best_peak > baseline * (1 - ESTIMATE_RESOLUTION):
        return None
    out = list(leading)
    for k in best:
        out.append(k.node)
        out.extend(k.attached)
    return out


def _peak(order: list[_Kernel], buffers: dict[int, _Buffer]) -> int:
    """``estimate_peak_memory``: each buffer from its writer (or the start) to its last reader."""
    return max(memory_at_steps(order, buffers), default=0)


def memory_at_steps(order: list[_Kernel], buffers: dict[int, _Buffer]) -> list[int]:
    """Live bytes at each step of ``order`` (and one after), as ``peak_memory_from_buf_info_list`` counts
    them: a buffer from its writer's step (or the start) through its last reader's step."""
    step = {k: i for i, k in enumerate(order)}
    delta = [0] * (len(order) + 1)
    for buf in buffers.values():
        if buf.writer is None and not buf.freeable_input:
            continue
        start = 0 if buf.writer is None else step[buf.writer]
        delta[start] += buf.size
        if not buf.graph_output:
            end = max((step[r] for r in buf.readers), default=start)
            delta[end + 1] -= buf.size
    out, live = [], 0
    for d in delta:
        live += d
        out.append(live)
    return out


def _lpmf(kernels: list[_Kernel], buffers: dict[int, _Buffer]) -> list[_Kernel]:
    """``topological_sort_lpmf``: among the ready kernels, the one that keeps the peak lowest."""
    indegree = {k: len(k.preds) for k in kernels}
    outdegree = {sid: len(b.readers) + (1 if b.graph_output else 0) for sid, b in buffers.items()}
    to_free = {k: 0 for k in kernels}
    for k in kernels:
        to_free[k] += sum(buffers[s].size for s in k.pred_buffers if outdegree[s] == 1)
        to_free[k] += sum(buffers[s].size for s in k.outputs if outdegree[s] == 0)
    live = sum(b.size for b in buffers.values() if b.freeable_input)
    max_memory = max(live, sum(b.size for b in buffers.values() if b.graph_output))
    ready = [k for k in kernels if indegree[k] == 0]
    schedule: list[_Kernel] = []
    while ready:
        gap = max_memory - live
        k = min(ready, key=lambda n: (n.size if n.size > gap else 0, n.size - to_free[n], n.index))
        ready.remove(k)
        schedule.append(k)
        live += k.size
        max_memory = max(max_memory, live)
        live -= to_free[k]
        for s in k.succs:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
        for sid in k.pred_buffers:
            outdegree[sid] -= 1
            if outdegree[sid] == 1:
                for r in buffers[sid].readers:
                    to_free[r] += buffers[sid].size
    return schedule


def _bfs(kernels: list[_Kernel], buffers: dict[int, _Buffer]) -> list[_Kernel]:
    """``topological_sort_bfs``: the ready kernel whose predecessors ran earliest."""
    indegree = {k: len(k.preds) for k in kernels}
    ran: dict[_Kernel, int] = {}

    def entry(k: _Kernel) -> tuple[list[int], int, int]:
        return sorted({ran[p] for p in k.preds}), k.index, id(k)

    heap = [entry(k) + (k,) for k in kernels if indegree[k] == 0]
    heapq.heapify(heap)
    schedule: list[_Kernel] = []
    while heap:
        k = heapq.heappop(heap)[-1]
        ran[k] = len(schedule)
        schedule.append(k)
        for s in sorted(k.succs, key=lambda n: n.index):
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(heap, entry(s) + (s,))
    return schedule


def _dfs(kernels: list[_Kernel], buffers: dict[int, _Buffer]) -> list[_Kernel]:
    """``topological_sort_dfs``: visit kernels by the bytes they write and read, smallest first,
    each after its predecessors (visited the same way)."""
    weight = {k: k.size + sum(buffers[s].size for s in k.pred_buffers) for k in kernels}
    seen: set[_Kernel] = set()
    schedule: list[_Kernel] = []

    def visit(k: _Kernel) -> None:
        stack = [(k, iter(sorted(k.preds, key=lambda n: (weight[n], n.index))))]
        seen.add(k)
        while stack:
            node, preds = stack[-1]
            nxt = next((p for p in preds if p not in seen), None)
            if nxt is None:
                stack.pop()
                schedule.append(node)
                continue
            seen.add(nxt)
            stack.append((nxt, iter(sorted(nxt.preds, key=lambda n: (weight[n], n.index)))))

    for k in sorted(kernels, key=lambda n: (weight[n], n.index)):
        if k not in seen:
            visit(k)
    return schedule
