"""Run one repeated block for real: extract instance 0 of a block class as a standalone GraphModule,
build random inputs at the bound sizes, and time it on the local device.

Why: "use your desktop" block mode. A whole transformer layer measured at the target shapes captures
what per-kernel prices miss (launch gaps, caches warmed by the previous kernel, allocator traffic), and
every instance of the class is then priced by that one number (``blocks_db``).

Extraction (``extract_block``), for the nodes of one instance (``passes/blocks.py``), in graph order:

1. Every node of the instance is copied into a new ``fx.Graph``.
2. An input from outside the instance becomes a placeholder: a parameter of the block, the activation
   entering it, and in training graphs the gradient flowing into its backward part (saved activations
   are inside the instance, since its forward and backward nodes are one instance). Symbolic sizes
   (``sym_size``, SymInt arithmetic) become the ints they take at the bindings.
3. Values used after the instance (and graph outputs) are the subgraph's outputs.
4. ``torch.device`` constants (``arange(..., device=meta)`` in a meta export) become the run device.

Example::

    >>> block = extract_block(program, info.classes[0], analysis.evaluator(bindings), torch.device("cpu"))
    >>> inputs = make_block_inputs(block, torch.device("cpu"))
    >>> outs = block.gm(*inputs)                     # same values as those nodes inside the whole graph
    >>> m = time_block(block, inputs, torch.device("cpu"))
    >>> m.median_ns

Known limitations:
- Inputs are random: floats uniform in [0.25, 0.75), integers in [0, smallest dim of the tensors
  their consumers read), booleans all True (a mask that masks nothing). Data-dependent kernels
  (MoE routing, ``nonzero``) time the data they get.
- ``estimate_peak_bytes`` ignores aliasing inside ops and the allocator's rounding; it is a guard
  against starting a run that cannot fit, OOM errors are still caught.
- A CUDA block time is device time between two events: launch gaps inside a host-bound block are
  included (as in a real step), the first kernel's launch latency is not.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx
from torch.fx.node import map_aggregate

from boomfx.core.fx_copy import copy_node
from boomfx.kernels_db.measure import NS_PER_MS, NS_PER_S, Measurement, summarize
from boomfx.passes.blocks import BlockClass
from boomfx.passes.specs import to_sympy
from boomfx.core.program import PHASE_BACKWARD, Program

# What a block input stands for (informational; the key uses only shapes and dtypes).
INPUT_PARAM = "param"
INPUT_ACTIVATION = "activation"
INPUT_GRADIENT = "gradient"

MEMORY_HEADROOM = 0.9      # start a run only if the estimate fits in this share of the free memory


class BlockTooLargeError(RuntimeError):
    """The block would not fit in the local device's memory (estimated before, or OOM during the run)."""


@dataclass(frozen=True)
class TensorEntry:
    """A bound tensor: sizes, strides, storage offset, dtype (the ``keys.py`` tensor-entry fields)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @property
    def storage_numel(self) -> int:
        if any(s == 0 for s in self.shape):
            return self.offset
        return self.offset + sum((s - 1) * abs(st) for s, st in zip(self.shape, self.stride)) + 1

    @property
    def storage_bytes(self) -> int:
        return self.storage_numel * torch.empty((), dtype=self.dtype, device="meta").element_size()

    def as_json(self) -> dict:
        return {"shape": list(self.shape), "stride": list(self.stride), "offset": self.offset,
                "dtype": str(self.dtype).removeprefix("torch.")}


@dataclass(frozen=True)
class BlockInput:
    """One placeholder of an extracted block: the outside node it stands for and its bound value
    (a ``TensorEntry``, or a tuple of them/None for a tuple-valued node)."""

    node: str
    value: Any
    kind: str                     # INPUT_PARAM | INPUT_ACTIVATION | INPUT_GRADIENT | a placeholder role
    int_high: int = 2             # exclusive upper bound for integer tensors (valid as any index)


@dataclass(frozen=True)
class BlockGraph:
    """Instance ``instance`` of a block class as a standalone GraphModule (``gm is None`` when only the
    interface was asked for). ``outputs`` are the original names of the values ``gm`` returns."""

    class_name: str
    signature: str
    instance: str
    gm: Optional[torch.fx.GraphModule]
    inputs: tuple[BlockInput, ...]
    outputs: tuple[str, ...]
    nodes: tuple[str, ...]
    phases: tuple[str, ...]
    peak_bytes: int               # inputs + largest set of live intermediate values (estimate)


# ---------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------
def _bind_value(val: Any, ev: Callable[[Any], int]) -> Any:
    if isinstance(val, torch.Tensor):
        return TensorEntry(tuple(ev(to_sympy(s)) for s in val.shape), tuple(ev(to_sympy(s)) for s in val.stride()),
                           ev(to_sympy(val.storage_offset())), val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(_bind_value(v, ev) for v in val)
    return None


def _scalar(node: torch.fx.Node, ev: Any) -> Any:
    """The value a symbolic-scalar node (sym_size, SymInt arithmetic) takes at the bindings."""
    val = node.meta.get("val")
    if isinstance(val, (torch.SymBool, bool)):
        return bool(ev.number(to_sympy(val))) if isinstance(val, torch.SymBool) else val
    if isinstance(val, (torch.SymFloat, float)):
        return ev.number(to_sympy(val))
    if isinstance(val, (torch.SymInt, int)):
        return ev(to_sympy(val))
    raise TypeError(f"block input {node.name} is neither a tensor nor a symbolic scalar: {type(val).__name__}")


def _is_tensor_valued(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val)


def _entries(value: Any) -> list[TensorEntry]:
    if isinstance(value, TensorEntry):
        return [value]
    if isinstance(value, tuple):
        return [e for v in value for e in _entries(v)]
    return []


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in target._schema.returns)
    return not isinstance(target, torch._ops.OpOverload) and getattr(target, "__name__", "") == "getitem"


def _int_high(node: torch.fx.Node, members: set, ev: Any) -> int:
    """Smallest positive dim among the other tensors the consumers of ``node`` read: always a valid index."""
    dims: list[int] = []
    for user in node.users:
        if user.name not in members:
            continue
        for other in user.all_input_nodes:
            if other is node:
                continue
            for entry in _entries(_bind_value(other.meta.get("val"), ev)):
                dims.extend(s for s in entry.shape if s > 0)
    return max(min(dims), 1) if dims else 2


def extract_block(program: Program, cls: BlockClass, ev: Any, device: Optional[torch.device] = None,
                  instance: int = 0, build: bool = True) -> BlockGraph:
    """Instance ``instance`` of ``cls`` as a standalone GraphModule on bound sizes.

    Args:
        program: the captured program holding the block.
        cls: a class of ``block_pass``.
        ev: an ``Evaluator`` at the bindings (``Analysis.evaluator(bindings)``).
        device: where the module will run (``torch.device`` constants are rewritten to it).
        instance: which instance to extract (0: the representative the analysis prices).
        build: False to compute only the interface (inputs, outputs, phases): what a key needs.
    Returns:
        A ``BlockGraph``; ``gm(*inputs)`` returns the values of ``outputs``.
    """
    members = set(cls.nodes[instance])
    order = [n for n in program.graph.nodes if n.name in members]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    inputs: list[BlockInput] = []

    def outside(a: torch.fx.Node) -> Any:
        if a in env:
            return env[a]
        val = a.meta.get("val")
        if a.op == "get_attr":
            env[a] = graph.get_attr(a.target)
        elif a.op != "placeholder" and not _is_tensor_valued(val):
            env[a] = _scalar(a, ev)
        else:
            if a.op == "placeholder":
                kind = program.input_roles.get(a.name, INPUT_ACTIVATION)
            else:
                kind = INPUT_GRADIENT if program.phase_of(a) == PHASE_BACKWARD else INPUT_ACTIVATION
            value = _bind_value(val, ev)
            high = _int_high(a, members, ev) if any(not e.dtype.is_floating_point for e in _entries(value)) else 2
            inputs.append(BlockInput(a.name, value, kind, high))
            ph = graph.placeholder(a.name)
            ph.meta["val"] = val
            env[a] = ph
        return env[a]

    def swap_device(x: Any) -> Any:
        return device if device is not None and isinstance(x, torch.device) else x

    for node in order:
        copy = copy_node(graph, node, lambda a: env[a] if a.name in members else outside(a))
        if device is not None:
            copy.args = map_aggregate(copy.args, swap_device)
            copy.kwargs = map_aggregate(copy.kwargs, swap_device)
        env[node] = copy
    outputs = [n for n in order if any(u.name not in members for u in n.users)] or order[-1:]
    graph.output(tuple(env[n] for n in outputs))
    phases = tuple(sorted({program.phase_of(n) for n in order}))
    gm = torch.fx.GraphModule(program.gm, graph) if build else None
    return BlockGraph(cls.name, cls.signature, cls.instances[instance], gm, tuple(inputs),
                      tuple(n.name for n in outputs), tuple(n.name for n in order), phases,
                      _peak_bytes(order, set(outputs), inputs, ev))


def _peak_bytes(order: Sequence[torch.fx.Node], outputs: set, inputs: Sequence[BlockInput], ev: Any) -> int:
    """Inputs plus the largest sum of live non-view values (freed after their last use in the block)."""
    position = {n: i for i, n in enumerate(order)}
    free_at: dict[int, int] = {}
    live = peak = 0
    for i, node in enumerate(order):
        nbytes = 0 if _is_view(node) else sum(e.storage_bytes for e in _entries(_bind_value(node.meta.get("val"), ev)))
        last = max((position.get(u, -1) for u in node.users), default=i)
        if node in outputs:
            last = len(order)
        live += nbytes
        free_at[max(last, i)] = free_at.get(max(last, i), 0) + nbytes
        peak = max(peak, live)
        live -= free_at.pop(i, 0)
    return sum(e.storage_bytes for b in inputs for e in _entries(b.value)) + peak


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------
def _random_tensor(entry: TensorEntry, high: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    numel = max(entry.storage_numel, 1)
    where = gen.device
    if entry.dtype == torch.bool:
        base = torch.ones(numel, dtype=torch.bool, device=device)
    elif entry.dtype.is_floating_point or entry.dtype.is_complex:
        base = (torch.rand(numel, generator=gen, device=where) * 0.5 + 0.25).to(device=device, dtype=entry.dtype)
    else:
        base = torch.randint(0, max(high, 1), (numel,), generator=gen, device=where).to(device=device,
                                                                                        dtype=entry.dtype)
    return base.as_strided(entry.shape, entry.stride, entry.offset)


def make_block_inputs(block: BlockGraph, device: torch.device, seed: int = 0) -> list[Any]:
    """Random inputs for ``block.gm`` with the bound shapes, strides and dtypes (see Known limitations)."""
    gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)

    def make(value: Any, high: int) -> Any:
        if isinstance(value, TensorEntry):
            return _random_tensor(value, high, device, gen)
        if isinstance(value, tuple):
            return tuple(make(v, high) for v in value)
        return None

    return [make(b.value, b.int_high) for b in block.inputs]


# ---------------------------------------------------------------------------------------------------
# Memory guard and timing
# ---------------------------------------------------------------------------------------------------
def free_memory_bytes(device: torch.device) -> int:
    """Bytes a run may still use: CUDA free + cached-but-unused; CPU MemAvailable (sysconf fallback)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def time_block(block: BlockGraph, inputs: Sequence[Any], device: torch.device, *, warmup_s: float = 0.01,
               target_s: float = 0.2, min_runs: int = 5, max_runs: int = 50,
               free_bytes: Optional[int] = None) -> Measurement:
    """Median/p10/p90 of ``block.gm(*inputs)`` after warm-up: CUDA events on GPU, perf_counter on CPU.

    Raises ``BlockTooLargeError`` when the estimate exceeds the free memory or the run runs out of it.
    """
    assert block.gm is not None, "extract_block(..., build=True) first"
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    if block.peak_bytes > MEMORY_HEADROOM * free:
        raise BlockTooLargeError(f"needs about {block.peak_bytes / 2**30:.2f} GiB, "
                                 f"{free / 2**30:.2f} GiB free on {device}")
    try:
        with torch.no_grad():
            if device.type == "cuda":
                with torch.cuda.device(device):
                    return _time_cuda(block.gm, inputs, device, warmup_s, target_s, min_runs, max_runs)
            return _time_cpu(block.gm, inputs, warmup_s, target_s, min_runs, max_runs)
    except Exception as exc:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        if _is_oom(exc):
            raise BlockTooLargeError(f"out of memory while running: {str(exc).splitlines()[0]}") from exc
        raise


def _runs(single_ns: float, target_s: float, min_runs: int, max_runs: int) -> int:
    return int(min(max_runs, max(min_runs, (target_s * NS_PER_S) // max(single_ns, 1.0))))


def _time_cpu(gm: torch.fx.GraphModule, inputs: Sequence[Any], warmup_s: float, target_s: float,
              min_runs: int, max_runs: int) -> Measurement:
    clock = time.perf_counter_ns
    previous = torch.set_flush_denormal(True)   # repeated in-place updates must not drift into denormals
    try:
        start, calls = clock(), 0
        while calls < 2 or clock() - start < warmup_s * NS_PER_S:
            gm(*inputs)
            calls += 1
        samples = []
        t0 = clock()
        gm(*inputs)
        samples.append(float(clock() - t0))
        for _ in range(_runs(samples[0], target_s, min_runs, max_runs) - 1):
            t0 = clock()
            gm(*inputs)
            samples.append(float(clock() - t0))
    finally:
        torch.set_flush_denormal(previous)
    median, p10, p90 = summarize(samples)
    # NB: on CPU issue and execution share a thread; the wall time includes dispatch (host_in_time)
    return Measurement(median, p10, p90, len(samples), 0.0, 0, "measured:cpu")


def _time_cuda(gm: torch.fx.GraphModule, inputs: Sequence[Any], device: torch.device, warmup_s: float,
               target_s: float, min_runs: int, max_runs: int) -> Measurement:
    sync = torch.cuda.synchronize
    l2_bytes = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or 64 * 2**20
    input_bytes = sum(t.untyped_storage().nbytes() for t in _flat_tensors(inputs))
    # the previous layer's weights are not L2-resident in a real step: flush when ours would be
    flush = torch.empty(2 * l2_bytes, dtype=torch.int8, device=device) if input_bytes < 2 * l2_bytes else None
    start_ns, calls = time.perf_counter_ns(), 0
    while calls < 3 or time.perf_counter_ns() - start_ns < warmup_s * NS_PER_S:
        gm(*inputs)
        calls += 1
    sync(device)
    probe = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    probe[0].record()
    gm(*inputs)
    probe[1].record()
    sync(device)
    runs = _runs(probe[0].elapsed_time(probe[1]) * NS_PER_MS, target_s, min_runs, max_runs)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    host: list[float] = []
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        h0 = time.perf_counter_ns()
        gm(*inputs)
        host.append(float(time.perf_counter_ns() - h0))
        end.record()
        sync(device)   # one block per sample: the next flush must not overlap this block
    median, p10, p90 = summarize([s.elapsed_time(e) * NS_PER_MS for s, e in events])
    return Measurement(median, p10, p90, runs, summarize(host)[0], 0, "measured:cuda")


def _flat_tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_flat_tensors(v))
    return out


def run_graph_values(gm: torch.fx.GraphModule, args: Sequence[Any]) -> Mapping[str, Any]:
    """Every node's value when ``gm`` runs on ``args`` (name -> value): ground truth for extraction tests."""
    values: dict[str, Any] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            # a copy: later in-place ops (the optimizer step) must not change what this node computed
            values[n.name] = map_aggregate(out, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
            return out

    with torch.no_grad():
        _Recorder(gm).run(*args)
    return values


__all__ = ["BlockGraph", "BlockInput", "BlockTooLargeError", "TensorEntry", "extract_block", "free_memory_bytes",
           "make_block_inputs", "run_graph_values", "time_block"]
