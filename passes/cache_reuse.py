"""Cache reuse: price each kernel between its warm and cold time by how recently its inputs were touched.

A CPU database collected with a cache flush (``Measurer(cpu_flush_bytes=N)``) holds two times per
kernel: *cold* (each sample after an N-byte flush, the row's median) and *warm* (repeated calls, the
``warm_key`` row). In a real step an operand is somewhere in between: an activation re-read right after
the kernel that wrote it is still in cache, a parameter read once per step is not. Measured on a Llama
training step (one thread), small pointwise ops ran 1.5-6x their warm time in situ while AdamW's
foreach ops ran 0.45-0.96x their cold time; pricing all of them at one end mis-prices both.

Model (one pass over the step's kernels in execution order, O(kernels + inputs)):

- storages, not values: views and in-place results map to the storage they alias (the same walk as
  ``passes/liveness.py``, whose storage ids and sizes are reused);
- ``traffic`` is the running sum of the bytes each kernel moves (its cost's bytes read + written);
  a kernel touches its input and output storages in order, each at its share of the kernel's traffic;
- an input storage of ``S`` bytes last touched ``d`` bytes of traffic ago has
  ``hot = clamp(C - d, 0, S)`` bytes still in a cache of ``C`` bytes (LRU: the storage's own bytes
  push its first bytes out too, so a storage larger than the cache is never fully hot); storages never
  touched in the step (parameters, optimizer state, inputs) are cold;
- ``time = warm + (cold - warm) * cold_share``, the cold share being ``cold_bytes / input_bytes``;
  for matmul, convolution and attention kernels it is the largest cold fraction of any input instead:
  a blocked kernel re-reads its operand panels many times, so one cold operand (a weight, read once
  per step) makes it cold whatever the bytes say (Llama: ``mm`` ran at 1.05x its cold time in situ
  although its activation input was just written). Kernels without a warm row or moving no bytes
  (views) keep their price; kernels without tensor inputs (``arange``, ``full``) count as warm.

``C`` is the cache a warm operand must still be in: one core's private cache (L2) on the machine that
measured the database, recorded in each warm row's key (``measure.private_cache_bytes``: on the
2-vCPU development VM an operand past its 2 MiB L2 already took 60-80% of the way from the warm to the
flushed time, the shared L3 helping little); on a GPU it would be the L2.

Known limitations:
- traffic counts re-reads of one storage by several kernels twice (LRU counts distinct bytes), so
  distances are upper bounds: a little more cold than a true LRU stack distance;
- the output side (write-allocate of a fresh output) is not weighed: fresh outputs reuse the blocks
  the allocator freed last, which are usually hot.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx

from boomfx.passes.aliasing import output_aliases
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.kernels import OP_CLASS_MEMORY, op_class
from boomfx.passes.liveness import LivenessInfo, _storage_key
from boomfx.program import Program


@dataclass(frozen=True)
class ReusePlan:
    """Per kernel node: the storages it reads and writes; per storage: its size (symbolic)."""

    inputs: Mapping[str, tuple[int, ...]]
    outputs: Mapping[str, tuple[int, ...]]
    nbytes: tuple[sympy.Expr, ...]
    cache_bytes: int
    any_cold: frozenset[str] = frozenset()   # kernels that are as cold as their coldest input


def reuse_plan(program: Program, liveness: LivenessInfo, kernel_nodes: Sequence[str] | set[str],
               cache_bytes: int) -> ReusePlan:
    """Storage ids of every kernel's inputs and outputs (once per analysis; sizes stay symbolic)."""
    created: dict[str, list[int]] = {}
    for iv in liveness.intervals:
        created.setdefault(iv.node, []).append(iv.storage_id)
    out_sids = _output_storages(program, created)
    kernels = set(kernel_nodes)
    inputs: dict[str, tuple[int, ...]] = {}
    outputs: dict[str, tuple[int, ...]] = {}
    any_cold: set[str] = set()
    for node in program.graph.nodes:
        if node.name not in kernels:
            continue
        if isinstance(node.target, torch._ops.OpOverload) and op_class(node.target) != OP_CLASS_MEMORY:
            any_cold.add(node.name)
        ins: dict[int, None] = {}
        for inp in node.all_input_nodes:
            ins.update(dict.fromkeys(s for s in out_sids.get(inp, ()) if s is not None))
        inputs[node.name] = tuple(ins)
        outputs[node.name] = tuple(s for s in out_sids.get(node, ()) if s is not None)
    nbytes = [sympy.Integer(0)] * len(liveness.intervals)
    for iv in liveness.intervals:
        nbytes[iv.storage_id] = iv.nbytes
    return ReusePlan(inputs, outputs, tuple(nbytes), int(cache_bytes), frozenset(any_cold))


def _output_storages(program: Program, created: Mapping[str, list[int]]
                     ) -> dict[torch.fx.Node, list[Optional[int]]]:
    """Storage id of each output of each node, following aliases as the liveness pass does."""
    out: dict[torch.fx.Node, list[Optional[int]]] = {}
    resident: dict[Any, int] = {}
    for node in program.graph.nodes:
        own = iter(created.get(node.name, ()))
        if node.op in ("placeholder", "get_attr"):
            out[node] = [_resident_storage(node, own, resident)]
        elif node.op == "call_function":
            out[node] = _call_storages(node, own, out)
    return out


def _resident_storage(node: torch.fx.Node, own: Any, resident: dict[Any, int]) -> Optional[int]:
    """A graph input's storage; tied inputs (one fake storage) share the first one's id."""
    val = node.meta.get("val")
    key = node.meta.get("boomfx.storage_key")
    if key is None and isinstance(val, torch.Tensor):
        key = _storage_key(val)
    if key is not None and key in resident:
        return resident[key]
    sid = next(own, None)
    if key is not None and sid is not None:
        resident[key] = sid
    return sid


def _call_storages(node: torch.fx.Node, own: Any, out: Mapping[torch.fx.Node, list[Optional[int]]]
                   ) -> list[Optional[int]]:
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    aliases = output_aliases(node)
    sids: list[Optional[int]] = []
    for k, v in enumerate(vals):
        alias = aliases[k] if k < len(aliases) else None
        if alias is not None:
            src = out.get(alias[0], [])
            idx = node.args[1] if node.target is operator.getitem else 0
            sids.append(src[idx] if isinstance(idx, int) and idx < len(src) else None)
        elif isinstance(v, torch.Tensor):
            sids.append(next(own, None))
        else:
            sids.append(None)
    return sids


def blended_ns(warm_ns: float, cold_ns: float, cold_share: float) -> float:
    """The time of a kernel whose inputs are ``cold_share`` (by bytes) out of cache."""
    return warm_ns + (cold_ns - warm_ns) * min(max(cold_share, 0.0), 1.0)


def hot_bytes(size: int, distance: Optional[float], cache_bytes: int) -> int:
    """Bytes of a ``size``-byte storage still cached after ``distance`` bytes of traffic (None: never
    touched in this step, so cold)."""
    if distance is None:
        return 0
    return int(min(max(cache_bytes - distance, 0), size))


class ReuseWalk:
    """Walks kernels in execution order, tracking the traffic since each storage was last touched."""

    def __init__(self, plan: ReusePlan, size_of: Callable[[int], int]) -> None:
        self.plan = plan
        self.size_of = size_of
        self.traffic = 0.0
        self.last: dict[int, float] = {}

    def cold_share(self, node: str) -> float:
        """Share of ``node``'s input bytes out of cache when it starts (the coldest input's share for
        ``plan.any_cold`` kernels). A kernel without tensor inputs (``arange``, ``full``) counts as warm:
        its output lands in a block the allocator freed recently."""
        total = cold = 0
        worst = 0.0
        for sid in self.plan.inputs.get(node, ()):
            size = self.size_of(sid)
            last = self.last.get(sid)
            distance = None if last is None else self.traffic - last
            missing = size - hot_bytes(size, distance, self.plan.cache_bytes)
            cold += missing
            total += size
            worst = max(worst, missing / size) if size > 0 else worst
        if total <= 0:
            return 0.0
        return worst if node in self.plan.any_cold else cold / total

    def touch(self, node: str, moved: float) -> None:
        """``node`` ran and moved ``moved`` bytes. Its storages are streamed in order (inputs, then
        outputs), so each is last touched at its share of the kernel's traffic: a foreach kernel over
        14 MiB of optimizer state leaves only its last storages in cache, not all of them."""
        sids = self.plan.inputs.get(node, ()) + self.plan.outputs.get(node, ())
        sizes = [self.size_of(sid) for sid in sids]
        total = sum(sizes)
        start, done = self.traffic, 0
        for sid, size in zip(sids, sizes):
            done += size
            self.last[sid] = start + moved * done / total if total > 0 else start + moved
        self.traffic = start + moved


def apply_cache_reuse(plan: ReusePlan, kernels: list[Any], scheduled: list[Any],
                      price_of: Callable[[str], Any], ev: Evaluator) -> None:
    """Set each kernel's time (``KernelReport.time_ns``, and ``ScheduledKernel.device_ns`` by replacing
    the entry of ``scheduled``; aligned lists in execution order) to its blend of warm and cold;
    kernels whose price has no warm time keep it."""
    sizes: dict[int, int] = {}

    def size_of(sid: int) -> int:
        hit = sizes.get(sid)
        if hit is None:
            hit = sizes[sid] = int(ev(plan.nbytes[sid]))
        return hit

    walk = ReuseWalk(plan, size_of)
    for i, k in enumerate(kernels):
        if k.bytes_moved <= 0:
            continue            # a view or metadata op: touches no data
        warm = getattr(price_of(k.node), "warm_ns", None)
        if warm is not None:
            new = blended_ns(warm, k.time_ns, walk.cold_share(k.node))
            sk = scheduled[i]       # frozen ScheduledKernel: replaced in the list
            scheduled[i] = dataclasses.replace(sk, device_ns=sk.device_ns + new - k.time_ns)
            k.time_ns = new
        walk.touch(k.node, k.bytes_moved)
