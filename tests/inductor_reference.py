"""Inductor's own fusion decisions for a graph, read from its scheduler: the reference that
tests/test_fusion.py checks passes/fusion.py's rules against (test-only; nothing in boomfx uses it)."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from boomfx.passes.fusion import CLASS_EXTERN, node_class
from boomfx.passes.kernels import OP_CLASS_MEMORY, op_class


# ---------------------------------------------------------------------------------------------------------
# Inductor's own decisions (the reference the rules are tested against; CPU backend, no compilation)
# ---------------------------------------------------------------------------------------------------------

_ORIGIN = "boomfx_origin"


class _SchedulerCaptured(Exception):
    pass


def inductor_groups(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[frozenset[str]]:
    """Inductor's kernels for ``gm`` as sets of ``gm``'s node names, read from its scheduler.

    ``gm`` is decomposed with Inductor's decomposition table (each new node remembers the node it
    came from), lowered by ``compile_fx_inner`` and stopped right after the scheduler has fused its
    nodes (nothing is compiled or run). A kernel's nodes are the origins of the buffers it writes;
    an extern kernel counts only the node that called it. A node computed by several kernels (Inductor
    recomputes cheap pointwise values in each consumer) belongs to the first, so the result is a
    partition. ``example_inputs``
    may be fake tensors with static shapes.

    Example::

        groups = inductor_groups(program.gm, fake_inputs)   # [{'gelu', 'add'}, {'linear'}, ...]
    """
    from unittest import mock

    import torch._inductor.scheduler as scheduler
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = torch.fx.GraphModule(gm, gm.graph)  # a shallow copy; only meta["custom"] is added below
    for n in gm.graph.nodes:
        n.meta["custom"] = dict(n.meta.get("custom") or {}, **{_ORIGIN: n.name})

    def run(*args: Any) -> Any:
        return torch.fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta():
        decomposed = make_fx(run, decomposition_table=select_decomp_table(), tracing_mode="fake")(*example_inputs)
    origin = {n.name: (n.meta.get("custom") or {}).get(_ORIGIN) for n in decomposed.graph.nodes}
    # an extern node's decomposition may add pointwise kernels (SDPA converting a bool mask to an additive
    # one): the node itself belongs to its extern kernel, not to those
    extern = {n.name for n in gm.graph.nodes if n.op == "call_function" and node_class(n) == CLASS_EXTERN}
    kernels: list[set[str]] = []
    original_init = scheduler.Scheduler.__init__

    def capture(self: Any, nodes: Any) -> None:
        original_init(self, nodes)
        computed = _computed_origins(self, decomposed)
        for snode in self.nodes:
            names: set[str] = set()
            for sub in snode.get_nodes():
                ir_node = sub.node
                if ir_node is None or isinstance(sub, scheduler.NopKernelSchedulerNode):
                    continue
                if isinstance(sub, scheduler.ExternKernelSchedulerNode):
                    src = getattr(ir_node, "origin_node", None)
                    fx_nodes = [src] if src is not None else [f for f in ir_node.origins if _is_extern_fx(f)]
                    names |= {origin[f.name] for f in fx_nodes if origin.get(f.name)}
                else:
                    names |= {origin[f.name] for f in computed(sub)
                              if origin.get(f.name) is not None and origin[f.name] not in extern}
            if names:
                kernels.append(names)
        raise _SchedulerCaptured()

    with mock.patch.object(scheduler.Scheduler, "__init__", capture), config.patch(fx_graph_cache=False):
        try:
            compile_fx_inner(decomposed, list(example_inputs))
        except Exception:  # noqa: BLE001 - the capture stops lowering on purpose
            if not kernels:
                raise
    return _first_owner(kernels)


def _computed_origins(sched: Any, graph_module: torch.fx.GraphModule) -> Any:
    """``computed(sub)``: the fx nodes a scheduler node really computes, from its ``origins``.

    ``origins`` over-approximates: a buffer realised while lowering node ``n`` (an extern kernel's
    input copy, e.g. SDPA's) gets the origins of *all* of ``n``'s inputs. An origin is kept only if
    it can be computed from what the scheduler node reads, directly or transitively (walking up the
    fx graph to graph inputs and buffers; stored pointwise values may be recomputed on the way).
    """
    import torch._inductor.scheduler as scheduler
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    buf_of = {b.origin_node.name: b.get_name() for b in V.graph.buffers
              if getattr(b, "origin_node", None) is not None}
    reads_of: dict[str, set[str]] = {}
    fx_of_nop: dict[str, set[str]] = {}      # input buffer of a no-op kernel (ConcatKernel) -> its fx node
    nop_fx = {b: fx for fx, b in buf_of.items()}
    for snode in sched.nodes:
        for sub in snode.get_nodes():
            reads = {d.name for d in sub.read_writes.reads}
            for name in sub.get_buffer_names():
                reads_of[name] = reads
                if isinstance(sub, scheduler.NopKernelSchedulerNode) and name in nop_fx:
                    for r in reads:
                        fx_of_nop.setdefault(r, set()).add(nop_fx[name])

    pointwise_bufs = {b.get_name() for b in V.graph.buffers
                      if isinstance(b, ir.ComputedBuffer) and isinstance(b.data, ir.Pointwise)}

    def computable(fx_node: torch.fx.Node, avail: set[str]) -> bool:
        """Whether ``fx_node`` can be computed from ``avail``: walking up its inputs, every graph input
        or non-pointwise buffer met is available (a stored pointwise value may be recomputed inline)."""
        stack, seen = list(fx_node.all_input_nodes), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            buf = buf_of.get(n.name, n.name if n.op == "placeholder" else None)
            if buf is not None and buf in avail:
                continue
            if n.op == "placeholder" or (buf is not None and buf not in pointwise_bufs):
                return False
            stack.extend(n.all_input_nodes)
        return True

    def computed(sub: Any) -> list[torch.fx.Node]:
        avail, stack = set(sub.get_buffer_names()), [d.name for d in sub.read_writes.reads]
        while stack:
            name = stack.pop()
            if name not in avail:
                avail.add(name)
                stack.extend(reads_of.get(name, ()))
        # a kernel writing into a concat buffer computes the concat (the ConcatKernel is a no-op)
        into = set().union(*(fx_of_nop.get(b, set()) for b in sub.get_buffer_names()))
        own = getattr(sub.node, "origin_node", None)     # the node this buffer is the value of
        return [f for f in sub.node.origins if f is own or f.name in into or computable(f, avail)]

    return computed


def _is_extern_fx(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and op_class(node.target) != OP_CLASS_MEMORY


def _first_owner(kernels: list[set[str]]) -> list[frozenset[str]]:
    """Each node belongs to the first kernel that computes it (later kernels recompute it inline)."""
    seen: set[str] = set()
    out: list[frozenset[str]] = []
    for names in kernels:
        own = frozenset(names - seen)
        seen |= names
        if own:
            out.append(own)
    return out
