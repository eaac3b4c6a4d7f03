"""Inductor's buffer reuse: a dead buffer held for the next allocation of its size and dtype.

Inductor's wrapper does not free a buffer at its last use; it keeps it in a pool keyed by device, dtype
and storage size (``FreeIfNotReusedLine``, ``buffer_reuse_key`` in torch/_inductor/codegen/wrapper.py,
torch 2.13) and hands it to the next kernel output with the same key (``AllocateLine.plan``:
``buf7 = buf2; del buf2  # reuse`` in its output code). The most recently freed one is offered
(a stack per key); it is taken when it was freed by the kernel just before, or when holding it from its
free to this allocation keeps Inductor's own peak estimate of the graph (``EfficientPeakEstimate``:
``estimate_peak_memory`` of torch/_inductor/memory.py, the same estimate its peak-memory reordering uses)
at or under that estimate's overall peak (``should_reuse_buffer``); each reuse raises the estimate over
the range it held the buffer. Otherwise the buffer stays in the pool and the output is allocated fresh.

Why it matters: the held buffer is real memory. A graph's estimated peak is its own; the step's peak is
the program's (parameters, the other graph's outputs, eager gradients), so a buffer Inductor holds through
a region its estimate calls quiet can sit on the step's peak: OPT's compiled backward holds a 2 MiB MLP
gradient buffer for the next layer's (its step 6.8% over our prediction without this).

``plan_buffer_reuse(program)`` replays that walk on each compiled graph of a compiled program (the
forward, the backward with its recomputation; ``peak_memory_order.graph_model`` is the estimate's view of
it) and marks each output that takes a pooled buffer (``META_BUFFER_REUSE`` on the kernel node: per output,
the node and output index whose storage it takes); ``passes/liveness.py`` then gives that output the held
storage, which stays live from its first writer to the reusing output's last reader.

Our buffers are a reconstruction of Inductor's (our fusion, our in-place writes): the large ones match,
the small per-row ones (norm statistics, masks: a few KiB each) do not always, and a transformer's
repeated layers make the estimate tie exactly. An encoder's inference would hold its next MLP buffer only
if the held 2 MiB plus the range's peak stays at or under a peak that is the same 2 MiB plus that range's
peak: RoBERTa and DistilBERT tie to within 128 bytes in our reconstruction, Inductor refuses, and taking
them made their inference peaks +50%. So a held buffer is taken only when the estimate allows it by more
than ``REUSE_RESOLUTION`` of its peak, or when it was freed by the kernel just before. The holds Inductor
takes in the decoders' backwards have 2.5% (an OPT with a 1000-token vocabulary) to 30% to spare.

Buffers that enter the pool are those a kernel of the graph wrote, that die inside it and are not written
over in place (``FusedKernel.inplace``: Inductor marks those freed without pooling them); graph inputs
(saved activations handed to the backward) are freed, never pooled. Keys compare exact byte sizes at the
sizes the compiled graph specialises on.
"""
from __future__ import annotations

from collections import defaultdict
import torch
import torch.fx

from boomfx.core.program import META_BUFFER_REUSE, Program
from boomfx.passes.aliasing import output_aliases
from boomfx.passes.fusion import CLASS_EXTERN, node_class
from boomfx.passes.liveness import liveness_pass
from boomfx.passes.peak_memory_order import compiled_graph_runs, graph_model, memory_at_steps, storage_sizes


# How far under its peak Inductor's estimate must stay for a held buffer to be taken (module docstring): above
# the small buffers our reconstruction does not match (128 B in RoBERTa's tie), below the closest hold
# Inductor takes in our cases (2.5%)
REUSE_RESOLUTION = 0.01


def plan_buffer_reuse(program: Program) -> Program:
    """``program`` (compiled, in its final kernel order) with ``META_BUFFER_REUSE`` set where Inductor's
    wrapper reuses a pooled buffer (module docstring). Returns the same program object."""
    runs = compiled_graph_runs(program)
    if not any(len(run) > 1 for run in runs.values()):
        return program
    info = liveness_pass(program, buffer_reuse=False)
    sizes = storage_sizes(info, program)
    creator = {iv.storage_id: iv.node for iv in info.intervals}
    made_by_kernel = {n.name for n in program.graph.nodes if n.op == "call_function"}
    owner: dict[int, tuple[str, int]] = {}          # storage id -> (node, output index) that names it first
    dtype: dict[int, torch.dtype] = {}
    for name, sids in info.node_storages.items():
        for i, sid in enumerate(sids):
            owner.setdefault(sid, (name, i))
    by_name = {n.name: n for n in program.graph.nodes}
    for sid, (name, i) in owner.items():
        val = by_name[name].meta.get("val") if name in by_name else None
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        if i < len(vals) and isinstance(vals[i], torch.Tensor):
            dtype[sid] = vals[i].dtype
    for node in program.graph.nodes:
        node.meta.pop(META_BUFFER_REUSE, None)
    inputs_unaligned = getattr(program.options, "target_kind", "cpu") == "cpu"
    for run in runs.values():
        if len(run) > 1:
            _plan_run(run, info.node_storages, sizes, creator, made_by_kernel, dtype, owner, inputs_unaligned)
    return program


def _plan_run(run: list[torch.fx.Node], node_sids: dict, sizes: dict[int, int], creator: dict[int, str],
              made_by_kernel: set[str], dtype: dict[int, torch.dtype], owner: dict[int, tuple[str, int]],
              inputs_unaligned: bool) -> None:
    model = graph_model(run, node_sids, sizes, creator, made_by_kernel)
    kernels, buffers = model.kernels, model.buffers
    unaligned = _unaligned(model, inputs_unaligned)
    estimate = memory_at_steps(kernels, buffers)
    overall = max(estimate, default=0)
    step = {k: i for i, k in enumerate(kernels)}
    # the storage liveness gives each buffer (an in-place output: the storage it is written over)
    real_sid = {sid: model.inplace_of.get(sid, sid) for sid in buffers}
    overwritten = set(model.inplace_of.values()) | _written_over(model)
    frees: dict[int, list[int]] = defaultdict(list)      # step -> buffers freed after it, pooled
    for sid, buf in buffers.items():
        if buf.writer is None or buf.graph_output or sid in overwritten or real_sid[sid] not in dtype \
                or sid in unaligned:
            continue
        last = max((step[r] for r in buf.readers), default=step[buf.writer])
        frees[last].append(sid)
    pool: dict[tuple, list[tuple[int, int]]] = defaultdict(list)   # key -> [(buffer, step freed)]
    for i, k in enumerate(kernels):
        reuses: dict[int, tuple[str, int]] = {}
        allocates = _wrapper_allocates(k.node)
        for out_index, sid in enumerate(model.storages(k.node)):
            buf = buffers.get(sid)
            if not allocates or buf is None or buf.writer is not k or sid in model.inplace_of \
                    or real_sid[sid] not in dtype:
                continue
            key = (dtype[real_sid[sid]], buf.size)
            if not pool[key]:
                continue
            held, freed_at = pool[key].pop()
            between = estimate[freed_at + 1:i]
            if freed_at + 1 == i or buf.size + max(between, default=0) <= overall * (1 - REUSE_RESOLUTION):
                for s in range(freed_at + 1, i):
                    estimate[s] += buf.size
                reuses[out_index] = owner[real_sid[held]]
            else:
                pool[key].append((held, freed_at))
        if reuses:
            outputs = len(model.storages(k.node))
            k.node.meta[META_BUFFER_REUSE] = tuple(reuses.get(j) for j in range(outputs))
        for sid in frees.get(i, ()):
            pool[(dtype[real_sid[sid]], buffers[sid].size)].append((sid, i))


# extern kernels Inductor calls with ``out=`` a buffer its wrapper allocated (``ExternKernelOut``: the matmuls,
# ``linear`` and ``matmul`` decomposed into them); other extern (fallback) kernels allocate their outputs
# themselves and never take a pooled buffer
OUT_EXTERNS = frozenset(p for p in (getattr(torch.ops.aten, n, None)
                                     for n in ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul")) if p is not None)


def _wrapper_allocates(node: torch.fx.Node) -> bool:
    """Whether Inductor's wrapper allocates ``node``'s outputs (``AllocateLine``): kernels it generates and
    ``out=`` extern kernels."""
    if getattr(node.target, "boomfx_fused", False):
        return True
    if node_class(node) != CLASS_EXTERN:
        return True
    return getattr(node.target, "overloadpacket", None) in OUT_EXTERNS


def _written_over(model) -> set[int]:
    """The buffers a later kernel writes its output over in place: the storage lives on under the new name
    (``buf13 = buf12; del buf12  # reuse``), so their deaths free nothing. A chain of in-place kernels over one
    storage (a residual stream: add + norm, add + norm, ...) names its root storage in ``inplace_of`` for
    every link; the links in between are values of their own here, and pooling one of them would hand the
    storage to an allocation while the chain's last link still holds it."""
    out: set[int] = set()
    for k in model.kernels:
        for alias in output_aliases(k.node):
            if alias is not None and alias[1]:
                out.update(model.storages(alias[0]))
    return out


def _unaligned(model, inputs_unaligned: bool) -> set[int]:
    """Buffers Inductor keys as unaligned (``V.graph.unaligned_buffers``), so no wrapper allocation matches
    them: on a CPU every graph input (``should_assume_input_aligned``), an output written in place over an
    unaligned buffer (codegen/common.py), and the outputs of a fallback kernel reading one (``FallbackKernel``'s
    ``has_unaligned_input``)."""
    out: set[int] = set()
    if inputs_unaligned:
        out.update(sid for sid, buf in model.buffers.items() if buf.writer is None)
    for k in model.kernels:
        own = model.storages(k.node)
        for sid in own:
            target = model.inplace_of.get(sid)
            if target is not None and (target in out or (inputs_unaligned and target not in model.buffers)):
                out.add(sid)
        if not _wrapper_allocates(k.node):
            reads = {s for n in k.node.all_input_nodes for s in model.storages(n)}
            if any(s in out or (inputs_unaligned and s not in model.buffers) for s in reads):
                out.update(s for s in own if model.buffers.get(s) is not None and model.buffers[s].writer is k)
    return out
