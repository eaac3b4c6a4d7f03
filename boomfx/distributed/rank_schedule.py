"""One rank's step on a compute stream and communication streams: the program's kernels as the analysis
prices them, its ``_c10d_functional`` collectives as ``price_collective`` prices them.

``schedule_rank(analysis, bindings, groups)`` evaluates the rank's ``Analysis`` once (kernel prices, host
issue costs, cold starts: the spans of its single-stream timeline), then rebuilds the step for
``boomfx/simulate/streams.py``:

- every kernel node is a compute op with the span's host and device time;
- a collective node (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``all_to_all_single``, ``broadcast``, their in-place / ``_out`` / ``_coalesced`` variants) is an op on
  the stream of its process group (``comm:<group name>``), priced by ``CollectivePricer.price`` with its
  message bytes (nccl-tests' convention, ``kernels_db/collectives.py``: all-gather its output,
  reduce-scatter its input, the others their input) and the ``CollectiveGroup`` ``groups`` maps its group
  name to;
- ``wait_tensor`` is a zero-length compute op depending on the collective it waits for (on a CPU device it
  blocks the host thread, as gloo's ``work.wait()`` does), placed where the runtime waits: before the first
  op reading the result (or, for an in-place collective, its buffer), at the latest before the optimizer
  (``waits="first_use"``, the default; ``"as_placed"`` keeps the graph's position). The rank rewrites put
  each wait right after its collective, which is where the buffers' lifetimes need it; DDP's bucket
  all-reduces and FSDP2's reduce-scatters are waited for only at the end of the backward.

Dependencies, as the runtime has them:

- a collective waits for the kernels producing its inputs (through views and bookkeeping nodes). FSDP2's
  all-gather reads a resident shard: it depends on nothing and overlaps whatever compute runs when the host
  issues it (the prefetch falls out of the program order and the host running ahead);
- a collective that writes in place into a graph input (DDP's bucket: the runtime copied gradients into it
  outside the graph, on the compute stream) waits for every compute op issued before it
  (ProcessGroupNCCL makes its stream wait for the current stream);
- collectives of one group run in issue order on that group's stream; groups run concurrently.

Example::

    >>> step = schedule_rank(analysis, {}, {"tp": CollectiveGroup.of(8)})      # doctest: +SKIP
    >>> step.timeline.total_ns, step.timeline.exposed_comm_ns

Known limitations:
- Ranks of one class are assumed to arrive at each collective together (no cross-rank skew); pipeline
  stages, which do differ, are scheduled by ``boomfx/simulate/pipeline.py`` (``pipeline_step.py``).
- Coalesced collectives are priced as one collective of their summed bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Protocol

import sympy
import torch
import torch.fx

from boomfx.analysis.analysis import Analysis, PointResult
from boomfx.core.devices import host_cores
from boomfx.core.errors import CollectiveError
from boomfx.core.program import PHASE_OPTIMIZER
from boomfx.kernels_db.collective_model import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, REDUCE_SCATTER,
                                                SEND_RECV, CollectiveGroup)
from boomfx.kernels_db.collectives import CollectivePrice, CollectivePricer
from boomfx.passes.specs import dtype_itemsize, to_sympy
from boomfx.simulate.streams import (COMM_PREFIX, COMPUTE, DEFAULT_GPU_SLOWDOWN, NO_SLOWDOWN, OverlapSlowdown,
                                     StreamOp, StreamTimeline, cpu_core_sharing, simulate_streams)

C10D_NAMESPACE = "_c10d_functional"
WAIT = "wait_tensor"
# functional collective packet name -> (model op, whether its message is the output rather than the input)
COLLECTIVE_OPS: Mapping[str, tuple[str, bool]] = {
    "all_reduce": (ALL_REDUCE, False), "all_reduce_": (ALL_REDUCE, False),
    "all_reduce_coalesced": (ALL_REDUCE, False), "all_reduce_coalesced_": (ALL_REDUCE, False),
    "all_gather_into_tensor": (ALL_GATHER, True), "all_gather_into_tensor_out": (ALL_GATHER, True),
    "all_gather_into_tensor_coalesced": (ALL_GATHER, True),
    "reduce_scatter_tensor": (REDUCE_SCATTER, False), "reduce_scatter_tensor_out": (REDUCE_SCATTER, False),
    "reduce_scatter_tensor_coalesced": (REDUCE_SCATTER, False),
    "all_to_all_single": (ALL_TO_ALL, False), "broadcast": (BROADCAST, False), "broadcast_": (BROADCAST, False),
    "send": (SEND_RECV, False), "recv": (SEND_RECV, True),
}


class CollectivePriceSource(Protocol):
    """What prices a collective (``kernels_db.collectives.CollectivePricer``)."""

    def price(self, op: str, message_bytes: int, group: CollectiveGroup,
              dtype: Optional[str] = None) -> CollectivePrice: ...


@dataclass(frozen=True)
class ScheduledCollective:
    node: str
    op: str                   # the model's name: all_reduce, all_gather, ...
    group: str                # the process group's name in the graph (a mesh dimension)
    message_bytes: int
    price: CollectivePrice
    group_size: int           # ranks in that group (the world its measured row needs)


@dataclass(frozen=True)
class RankStep:
    """One rank's simulated step, the collectives it ran and the single-stream point it came from."""

    timeline: StreamTimeline
    collectives: tuple[ScheduledCollective, ...]
    point: PointResult
    ops: tuple[StreamOp, ...] = ()
    synchronous: bool = False

    @property
    def step_ns(self) -> float:
        return self.timeline.total_ns

    def communication_cost_ns(self) -> float:
        """What the collectives add to the step: this step minus the same step with free collectives.

        Unlike ``timeline.exposed_comm_ns`` (a collective running while the compute stream is idle), this
        is zero when the compute stream would have idled anyway, waiting for a host that issues slower
        than the device runs (a host-bound step).
        """
        free = [replace(op, device_ns=0.0) if op.stream.startswith(COMM_PREFIX) else op for op in self.ops]
        return self.step_ns - simulate_streams(free, self.timeline.slowdown, self.synchronous).total_ns


def c10d_packet(node: torch.fx.Node) -> Optional[str]:
    """The functional-collective op name of ``node`` (``all_reduce_``, ``wait_tensor``...), else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target.overloadpacket.__name__ if target.namespace == C10D_NAMESPACE else None


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: object) -> sympy.Expr:
    total = sympy.Integer(0)
    for t in _tensors(value):
        numel = sympy.Integer(1)
        for size in t.shape:
            numel = numel * to_sympy(size)
        total = total + numel * dtype_itemsize(t.dtype)
    return total


def _arg(node: torch.fx.Node, name: str) -> object:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            if i < len(node.args):
                return node.args[i]
            return a.default_value if a.has_default_value() else None
    return None


def _mutated_args(node: torch.fx.Node) -> list[object]:
    out = []
    for a in node.target._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(_arg(node, a.name))
    return out


def message_bytes_of(node: torch.fx.Node, ev) -> int:
    """Nccl-tests' size of one collective node: all-gather its output, the others their input."""
    packet = c10d_packet(node)
    op, by_output = COLLECTIVE_OPS[packet]
    if by_output:
        value = _arg(node, "out") if packet.endswith("_out") else node.meta.get("val")
        if isinstance(value, torch.fx.Node):
            value = value.meta.get("val")
    else:
        first = node.target._schema.arguments[0].name
        value = _arg(node, first)
        value = [v.meta.get("val") if isinstance(v, torch.fx.Node) else v
                 for v in (value if isinstance(value, (list, tuple)) else [value])]
    return int(ev(_nbytes(value)))


def _group_name(node: torch.fx.Node) -> str:
    name = _arg(node, "group_name")
    if not isinstance(name, str):
        raise CollectiveError(f"{node.name}: collective without a group name ({node.format_node()})")
    return name


class _Producers:
    """The nearest kernel (or collective) nodes behind each value, through views and bookkeeping nodes."""

    def __init__(self, kernels: set[str]) -> None:
        self.kernels = kernels
        self._memo: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] = {}

    def of(self, node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
        hit = self._memo.get(node)
        if hit is not None:
            return hit
        if node.name in self.kernels or c10d_packet(node) is not None:
            out: tuple[torch.fx.Node, ...] = (node,)
        else:
            found: list[torch.fx.Node] = []
            for inp in node.all_input_nodes:
                for p in self.of(inp):
                    if p not in found:
                        found.append(p)
            out = tuple(found)
        self._memo[node] = out
        return out

    def reaches_input(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` is (a view of) a graph input."""
        while node.op != "placeholder":
            if node.name in self.kernels or c10d_packet(node) is not None or not node.all_input_nodes:
                return False
            node = node.all_input_nodes[0]
        return True


def _wait_positions(program: Any, nodes: list[torch.fx.Node], position: Mapping[str, int],
                    kernels: set[str]) -> dict[str, int]:
    """Where the runtime makes the compute stream wait for each ``wait_tensor``'s collective (``WAITS_FIRST_USE``):
    the first kernel or collective reading its result (through views) or, for an in-place collective, reading
    the buffer after it; at the latest the first optimizer op (DDP's ``finalize_backward`` and FSDP2's
    root post-backward callback wait for every reduction before ``optimizer.step()``); never earlier than
    the node itself."""
    first_optimizer = next((i for i, n in enumerate(nodes) if n.name in kernels
                            and program.phase_of(n) == PHASE_OPTIMIZER), len(nodes))

    def readers(start: torch.fx.Node, after: int) -> list[int]:
        found, todo, seen = [], list(start.users), set()
        while todo:
            user = todo.pop()
            if user in seen or position[user.name] <= after:
                continue
            seen.add(user)
            if user.op == "output" or user.name in kernels or c10d_packet(user) is not None:
                found.append(position[user.name])
            else:
                todo.extend(user.users)
        return found

    out = {}
    for node in nodes:
        if c10d_packet(node) != WAIT:
            continue
        here = position[node.name]
        uses = readers(node, here)
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        if source is not None and c10d_packet(source) in COLLECTIVE_OPS:
            # an in-place collective's result and buffer alias: their readers after the wait read its data
            uses += readers(source, here)
            for buffer in _mutated_args(source):
                if isinstance(buffer, torch.fx.Node):
                    uses += readers(buffer, here)
        out[node.name] = max(here, min(uses + [first_optimizer]))
    return out


WAITS_FIRST_USE, WAITS_AS_PLACED = "first_use", "as_placed"


def rank_stream_ops(analysis: Analysis, point: PointResult, bindings: Mapping[sympy.Symbol, int],
                    groups: Mapping[str, CollectiveGroup], pricer: CollectivePriceSource,
                    waits: str = WAITS_FIRST_USE) -> tuple[list[StreamOp], list[ScheduledCollective]]:
    """The ops of one rank for ``simulate_streams`` (see the module docstring).

    ``waits``: ``"first_use"`` places each ``wait_tensor`` where the runtime waits (``_wait_positions``); the
    rank rewrites put waits right after their collectives, where buffer lifetimes need them.
    ``"as_placed"`` keeps the graph's positions.
    """
    if waits not in (WAITS_FIRST_USE, WAITS_AS_PLACED):
        raise CollectiveError(f"waits must be '{WAITS_FIRST_USE}' or '{WAITS_AS_PLACED}', got {waits!r}")
    program = analysis.program
    cpu = analysis.device.kind == "cpu"
    ev = analysis.evaluator(bindings)
    nodes = list(program.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    spans = {s.name: s for s in point.timeline.spans}
    kernel_names = {s.name for s in point.timeline.spans if s.name in position and c10d_packet(
        nodes[position[s.name]]) is None}
    producers = _Producers(kernel_names)
    wait_at = _wait_positions(program, nodes, position, kernel_names) if waits == WAITS_FIRST_USE else {}
    deferred: list[tuple[int, int, torch.fx.Node]] = []     # (where, graph position, wait node)
    ops: list[StreamOp] = []
    collectives: list[ScheduledCollective] = []
    last_compute: Optional[str] = None
    emitted: set[str] = set()

    def host_of(name: str) -> float:
        """The host cost of issuing ``name`` as the analysis priced it (a CPU runs ops on the host: none)."""
        span = spans.get(name)
        return 0.0 if cpu or span is None else span.issue_end_ns - span.issue_start_ns

    def compute(name: str) -> None:
        nonlocal last_compute
        span = spans[name]
        host = host_of(name)
        node = nodes[position[name]] if name in position else None
        sync = bool(node is not None and getattr(node.target, "overloadpacket", None) in _HOST_SYNC)
        ops.append(StreamOp(name, COMPUTE, span.end_ns - span.start_ns, host, host_sync=sync))
        last_compute = name

    def collective(node: torch.fx.Node) -> None:
        nonlocal last_compute
        packet = c10d_packet(node)
        if packet == WAIT:
            waited = [p.name for p in producers.of(node.all_input_nodes[0]) if p.name in emitted
                      and c10d_packet(p) not in (None, WAIT)]
            ops.append(StreamOp(node.name, COMPUTE, 0.0, host_of(node.name), deps=tuple(waited), host_sync=cpu))
            last_compute = node.name
            emitted.add(node.name)
            return
        if packet not in COLLECTIVE_OPS:
            raise CollectiveError(f"{node.name}: no time model for _c10d_functional.{packet}")
        op = COLLECTIVE_OPS[packet][0]
        group_name = _group_name(node)
        group = groups.get(group_name)
        if group is None:
            raise CollectiveError(f"{node.name}: process group '{group_name}' has no ranks "
                                  f"(known: {', '.join(sorted(groups)) or 'none'})")
        size = _arg(node, "group_size")
        if isinstance(size, int) and size != group.world:
            raise CollectiveError(f"{node.name}: group '{group_name}' has {group.world} ranks, the op says {size}")
        nbytes = message_bytes_of(node, ev)
        dtype = next((str(t.dtype).replace("torch.", "") for t in _tensors(node.meta.get("val"))), None)
        price = pricer.price(op, nbytes, group, dtype)
        deps = [p.name for inp in node.all_input_nodes for p in producers.of(inp) if p.name in emitted]
        if last_compute is not None and any(isinstance(m, torch.fx.Node) and producers.reaches_input(m)
                                            for m in _mutated_args(node)):
            deps.append(last_compute)
        ops.append(StreamOp(node.name, f"{COMM_PREFIX}:{group_name}", price.time_ns, host_of(node.name),
                            deps=tuple(dict.fromkeys(deps))))
        collectives.append(ScheduledCollective(node.name, op, group_name, nbytes, price, group.world))
        emitted.add(node.name)

    def waits_due(at: int) -> None:
        deferred.sort(key=lambda d: (d[0], d[1]))
        while deferred and deferred[0][0] <= at:
            collective(deferred.pop(0)[2])

    def comm_node(node: torch.fx.Node) -> None:
        here = position[node.name]
        waits_due(here)
        if node.name in wait_at and wait_at[node.name] > here:
            deferred.append((wait_at[node.name], here, node))
        else:
            collective(node)

    pending = [n for n in nodes if c10d_packet(n) is not None]
    for span in point.timeline.spans:
        here = position.get(span.name)
        while pending and here is not None and position[pending[0].name] < here:
            comm_node(pending.pop(0))
        if span.name in kernel_names or span.name not in position:
            if here is not None:
                waits_due(here)
            compute(span.name)
            emitted.add(span.name)
    for node in pending:
        comm_node(node)
    waits_due(len(nodes))
    return ops, collectives


_HOST_SYNC = {torch.ops.aten._local_scalar_dense, torch.ops.aten.item, torch.ops.aten.nonzero,
              torch.ops.aten.masked_select, torch.ops.aten._unique2}


def default_slowdown(analysis: Analysis, ranks_on_host: int = 1) -> OverlapSlowdown:
    """GPUs: compute slows while NCCL runs (``DEFAULT_GPU_SLOWDOWN``); CPUs: the host's ``ranks_on_host``
    ranks' compute and gloo threads share its cores (``cpu_core_sharing``, one compute thread a rank as
    torchrun starts them); other devices: none."""
    if analysis.device.kind == "cuda":
        return DEFAULT_GPU_SLOWDOWN
    if analysis.device.kind == "cpu":
        return cpu_core_sharing(ranks_on_host, host_cores())
    return NO_SLOWDOWN


def default_pricer(analysis: Analysis) -> CollectivePricer:
    """The collective rows of the analysis's ``--db`` (resolved as its kernel pricer resolves it, read once),
    else the model. A caller scheduling many points should keep one."""
    from boomfx.kernels_db.db_path import resolve_db_path
    from boomfx.kernels_db.store import Store
    path = resolve_db_path(analysis.options.db, analysis.device)
    return CollectivePricer(Store(path) if path is not None else None, analysis.device)


def schedule_rank(analysis: Analysis, bindings: Mapping[sympy.Symbol, int], groups: Mapping[str, CollectiveGroup],
                  pricer: Optional[CollectivePriceSource] = None, slowdown: Optional[OverlapSlowdown] = None,
                  point: Optional[PointResult] = None, waits: str = WAITS_FIRST_USE) -> RankStep:
    """Simulate one rank's step with its collectives on their own streams (see the module docstring).

    ``pricer`` defaults to a ``CollectivePricer`` over the analysis's ``--db`` (its collective rows, else the
    model); ``slowdown`` to ``default_slowdown`` for the GPUs (ranks) a node of the groups' cluster holds;
    ``point`` to ``analysis.evaluate(bindings)``.
    """
    pricer = pricer if pricer is not None else default_pricer(analysis)
    point = point if point is not None else analysis.evaluate(bindings)
    ops, collectives = rank_stream_ops(analysis, point, bindings, groups, pricer, waits)
    synchronous = analysis.device.kind == "cpu"
    if slowdown is None:
        ranks_on_host = max((g.topology.gpus_per_node for g in groups.values()), default=1)
        slowdown = default_slowdown(analysis, ranks_on_host)
    timeline = simulate_streams(ops, slowdown, synchronous=synchronous)
    return RankStep(timeline, tuple(collectives), point, tuple(ops), synchronous)
