"""Compiled execution: rewrite a Program so each Inductor kernel is ONE fx node.

``compile_program(program) -> Program`` takes the groups of ``fusion.fusion_pass`` and replaces each
generated ("fused") group by one ``call_function`` node whose target is a ``FusedKernel``. The
unchanged passes then see what Inductor runs: ``kernels`` one launch per group, ``liveness`` and the
allocator replay only the buffers Inductor materialises (a group's intermediates take no memory),
``shapes`` a Cost of the members' FLOPs plus external inputs read once and outputs written once.
Extern groups (matmul/conv/attention, fallbacks) and separate kernels (scatters, in-place ops)
stay the original aten nodes.

Each fused kernel also has an ``OpCall`` of the custom op ``boomfx::fused(Tensor[] inputs,
SymInt[] scalars, str desc) -> Tensor[]``, where ``desc`` is a canonical JSON description of the
member ops and their wiring. The kernel database keys it like any aten call, so a compiled group
measured on a device (``kernels_db/collect_fused.py``) prices it exactly ("measured"); without a
measurement it falls back to the roofline of its Cost. Running the op for real compiles the group
with Inductor (``run_fused``), which is what the collector times.

Example::

    program = capture(ep, options=ProgramOptions(compile=True))   # applies compile_program
    fused = [n for n in program.graph.nodes if isinstance(n.target, FusedKernel)]

Training programs are first rewritten by ``recompute_for_backward`` (a model of AOTAutograd's min-cut
partitioner: cheap pointwise values whose inputs are saved anyway are recomputed in backward, not
saved). Then inlined values (``fusion`` rule 3: cheap pointwise values Inductor recomputes in every
kernel that reads them) are copied into each reading kernel by ``recompute_inlined``, so they are
neither stored nor re-read. A view of a member read outside its group is re-applied to the member's
output (Inductor's ``reinterpret_tensor``), never materialised.

Known limitations:
- In-place members are never fused (optimizer ``_foreach_*_`` ops stay one kernel each, as in an
  eager optimizer step); ``torch.compile`` of the optimizer step is not modelled.
- A view whose size arguments are computed inside the group is still materialised as a fresh tensor.
- Host time: a fused kernel is measured as the compiled callable of its group
  (``kernels_db/collect_fused.py``: ~3.8 us for a one-element group on the 2-vCPU dev VM, more than the
  ~1 us Inductor's wrapper pays per kernel inside a graph: small groups come out a little high). The
  cost of entering the compiled graphs (dynamo guards, AOTAutograd's wrappers and Function, the backward
  call) is added by ``boomfx/analysis/host_time.py`` (measured by ``kernels_db/host_overheads.py``).
"""
from __future__ import annotations

import heapq
import json
from fractions import Fraction
import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx

from boomfx.core.fx_copy import copy_node
from boomfx.passes.costs.registry import Cost, price_call
from boomfx.passes.aliasing import is_view_node
from boomfx.passes.cpu_sdpa import decompose_cpu_attention
from boomfx.passes.cse import eliminate_common_subexpressions
from boomfx.passes.empty_cat import drop_empty_cat_inputs
from boomfx.passes.functional_inplace import functional_inplace
from boomfx.passes.fusion import CLASS_NONE, CLASS_POINTWISE, _is_assert, backend_for, fusion_groups, node_class
from boomfx.passes.layout import backward_convolution_operands, channels_last_convolutions
from boomfx.passes.locality_order import reorder_for_locality
from boomfx.passes.low_memory_max_pool import low_memory_max_pool
from boomfx.passes.buffer_reuse import plan_buffer_reuse
from boomfx.passes.concat_into import realize_concat_inputs
from boomfx.passes.peak_memory_order import reorder_for_peak_memory
from boomfx.passes.pool_decompositions import decompose_pools
from boomfx.passes.post_grad import fuse_addmm
from boomfx.passes.fused_op import FusedKernel, encode, fused_op
from boomfx.passes.op_names import op_name
from boomfx.passes.opcall import opcall_from_node
from boomfx.passes.partitioner import _NORMALISERS, _is_tensor, recompute_for_backward, view_base
from boomfx.passes.sizes import sizes_from_inputs
from boomfx.passes.specs import TensorSpec, to_sympy
from boomfx.core.program import META_RUNTIME_USES, PHASE_BACKWARD, Program

META_FUSED_MEMBERS = "boomfx.fused_members"

# --cudagraphs (torch.compile mode="reduce-overhead"). Host side: the step's kernels are issued by one
# graph replay, so per-kernel issue cost is ~0 and the replay costs once: cudaGraphLaunch plus the
# cudagraph-trees bookkeeping of torch (input checks, pool state), a few to tens of us; we use
# 20 us (NB: an estimate, not measured on a device). Memory: the graph's tensors live in a *private*
# memory pool (cudagraph trees): its blocks are never returned to the general pool and stay reserved
# between replays. The step's (non-resident) allocations go to a separate allocator pool, modelled as
# its own stream id, so the general pool can never reuse them.
CUDAGRAPH_REPLAY_HOST_NS = 20_000.0
CUDAGRAPH_POOL_STREAM = 1

# ---------------------------------------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------------------------------------


def _nbytes(spec: TensorSpec) -> sympy.Expr:
    return spec.nbytes


def _absorbed_views(members: list[torch.fx.Node], program: Program) -> list[torch.fx.Node]:
    """Views/getitems hanging off the group in its phase: Inductor folds them into the kernel."""
    inside = set(members)
    phase = program.phase_of(members[0])
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    first = min(order[m] for m in members)
    added: list[torch.fx.Node] = []
    frontier = list(members)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in inside or user.op != "call_function" or node_class(user) != CLASS_NONE:
                continue
            if not (_is_tensor(user) or _is_tensor_list(user)) or program.phase_of(user) != phase:
                continue   # (a multi-output view, chunk/split, is absorbed with its getitems)
            if any(inp not in inside for inp in user.all_input_nodes if _is_tensor(inp)):
                continue
            if any(inp not in inside and order[inp] > first and _reaches(inside, inp, order, first)
                   for inp in user.all_input_nodes):
                continue  # a size computed from the group's own values: absorbing it would form a cycle
            inside.add(user)
            added.append(user)
            frontier.append(user)
    return added


def _is_tensor_list(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (list, tuple)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val)


def _reaches(group: set[torch.fx.Node], node: torch.fx.Node, order: dict[torch.fx.Node, int], first: int) -> bool:
    """Whether ``node`` depends on a member of ``group`` (whose earliest member is at ``first``)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in group:
            return True
        if n in seen or order[n] < first:
            continue          # nothing before the group's first member can read it
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _describe(nodes: list[torch.fx.Node]) -> tuple[dict, list[torch.fx.Node], list[torch.fx.Node], list]:
    """(desc without outputs, external tensor inputs, external scalar nodes, scalar exprs)."""
    index = {n: i for i, n in enumerate(nodes)}
    tensor_inputs: list[torch.fx.Node] = []
    scalar_nodes: list[torch.fx.Node] = []
    scalars: list = []

    def ref(node: torch.fx.Node) -> Any:
        if node in index:
            return {"$v": index[node]}
        if _is_tensor(node):
            if node not in tensor_inputs:
                tensor_inputs.append(node)
            return {"$in": tensor_inputs.index(node)}
        val = node.meta.get("val")
        if node not in scalar_nodes:
            scalar_nodes.append(node)
            scalars.append(to_sympy(val))
        return {"$s": scalar_nodes.index(node)}

    ops = []
    for node in nodes:
        name = "getitem" if node.target is operator.getitem else op_name(node.target)
        ops.append([name, encode(list(node.args), ref, scalars), {k: encode(v, ref, scalars) for k, v in node.kwargs.items()}])
    return {"ops": ops}, tensor_inputs, scalar_nodes, scalars


def _inplace_reuse(inputs: list[torch.fx.Node], outputs: list[torch.fx.Node], inside: set,
                   order: dict[torch.fx.Node, int], held: frozenset = frozenset(), backward: bool = False) -> tuple:
    """Inductor writes a pointwise kernel's output into an input buffer that dies there (``buf1 = buf0;
    del buf0  # reuse`` in its output code) when size and dtype match. An input qualifies when it is a
    kernel's output (not a graph input or getitem; a reshape of one is read at the same index) whose
    storage no later node reads: within one
    phase that is a buffer of the same graph; in the backward it may be an activation the forward saved,
    which AOTAutograd hands the backward graph as a *donated* buffer (``buf1 = mm; del mm  # reuse``:
    the logits' gradient written over the saved logits). An output of a multi-output op Inductor lowers
    (a LayerNorm backward's input gradient) is a buffer like any other: the next LayerNorm backward adds
    the residual gradient into it in place (``buf13 = buf3; del buf3  # reuse``). ``held``: names a
    runtime keeps alive."""
    first = min(order[n] for n in inside)
    taken: set[int] = set()
    result = []
    for out in outputs:
        val = out.meta["val"]
        pick = None
        # Inductor takes the first qualifying read of the output's computation (``decide_inplace_update``
        # walks its reads in load order): ``threshold_backward`` is ``where(relu <= 0, 0, grad)``, so OPT's
        # compiled backward writes over the donated ReLU output (``buf11 = relu_1; del relu_1  # reuse``),
        # ``gelu_backward`` loads the gradient first and writes over the gradient's matmul output
        loads = _load_order(out, inside)
        for i, inp in sorted(enumerate(inputs), key=lambda item: loads.get(item[1], len(loads) + item[0])):
            v, base = inp.meta.get("val"), view_base(inp)   # a reshape of a buffer reads it at the same index
            b = base.meta.get("val")
            if i in taken or not _is_buffer(base) or base.name in held:
                continue
            if not isinstance(v, torch.Tensor) or not isinstance(b, torch.Tensor) or b.numel() != v.numel() \
                    or not _dense(b) or not _dies_in(base, inside, first, order) \
                    or not _read_pointwise(inp, out, inside, backward):
                continue
            # the same element at the same offset: same shape and strides (a channels-last convolution's
            # output takes its BatchNorm + ReLU in place as a contiguous one does)
            if v.dtype == val.dtype and v.shape == val.shape and _dense(v) and v.stride() == val.stride():
                pick = i
                break
        if pick is not None:
            taken.add(pick)
        result.append(pick)
    return tuple(result)


def _is_buffer(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a buffer some kernel wrote: a computing op's output, or one output of a
    multi-output op (``getitem``; Inductor's ``MultiOutput`` or a lowered op's own buffer)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and source.op == "call_function" \
            and node_class(source) != CLASS_NONE
    return node_class(node) != CLASS_NONE


# ops whose Inductor decomposition loads another argument before the first: ``where(self <= t, 0, grad)``;
# ``_softmax_backward_data`` is ``fma(-output, sum(grad * output), grad * output)`` (Inductor's own
# decomposition), so the saved softmax output is loaded first and written over
_LOADS_FIRST = {"threshold_backward": (1, 0), "hardtanh_backward": (1, 0), "_softmax_backward_data": (1, 0)}


def _load_order(out: torch.fx.Node, inside: set) -> dict[torch.fx.Node, int]:
    """The nodes outside the kernel that computing ``out`` loads, in the order its expression loads them: its
    members' arguments left to right, depth first (``_LOADS_FIRST`` where a decomposition reorders them)."""
    order: dict[torch.fx.Node, int] = {}
    seen: set[torch.fx.Node] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in inside:
            order.setdefault(node, len(order))
            continue
        args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        first = _LOADS_FIRST.get(getattr(getattr(node.target, "overloadpacket", None), "__name__", ""))
        if first is not None and len(node.args) > max(first):
            args = [node.args[i] for i in first if isinstance(node.args[i], torch.fx.Node)] + \
                   [a for a in args if all(a is not node.args[i] for i in first)]
        stack.extend(reversed(args))
    return order


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its storage exactly once in a layout Inductor writes (contiguous or channels-last)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _read_pointwise(node: torch.fx.Node, out: torch.fx.Node, inside: set, backward: bool) -> bool:
    """Whether the kernel's members read ``node`` (directly or through views of the kernel) only on the way
    to ``out``, and ``out``'s own computation reads it element for element. Inductor writes over an input
    when its one remaining reader is the node storing the output at the same index (scheduler.py
    ``can_inplace``, ``single_index_in_fused_node``); a reduction the output depends on ran before and does
    not count (``decide_inplace_update`` skips the node's ancestors: a softmax backward writes over the
    saved softmax output it also sums), a reader on the way to another output does (a LayerNorm backward's
    incoming gradient, also summed into the weight gradient, gets a new buffer). A ``_log_softmax`` in the
    backward is a recomputation from saved per-row statistics (``partitioner.recompute_for_backward``):
    pointwise."""
    root = out
    while root.target is operator.getitem or (node_class(root) == CLASS_NONE and is_view_node(root)):
        if not root.args or root.args[0] not in inside:
            break
        root = root.args[0]
    feeding = _feeders(root, inside)
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in inside:
                continue
            if node_class(user) == CLASS_NONE and is_view_node(user):
                stack.append(user)
                continue
            if user not in feeding:
                return False
            if node_class(user) == CLASS_POINTWISE or (backward and user.target in _NORMALISERS):
                continue
            if user is root:
                if getattr(user.target, "overloadpacket", None) not in _POINTWISE_AFTER_ROWS:
                    return False
            elif not feeding[user]:
                return False    # read on the way to ``out`` by a member that neither reduces nor is pointwise
            if any(u.target is operator.getitem and u not in feeding and u.users for u in user.users):
                return False    # the member also computes another output from it (a weight gradient)
    return True


# single-output ops whose output Inductor computes element for element from the input and per-row
# reductions of it (separate nodes, ancestors of the output's): softmax and its backward
# (``fma(-output, sum(grad * output), grad * output)``), log-softmax and its backward
_POINTWISE_AFTER_ROWS = frozenset((torch.ops.aten._softmax, torch.ops.aten._log_softmax,
                                   torch.ops.aten._softmax_backward_data,
                                   torch.ops.aten._log_softmax_backward_data))


def _feeders(root: torch.fx.Node, inside: set) -> dict[torch.fx.Node, bool]:
    """The members ``root`` is computed from (``root`` included), each mapped to whether it is a reduction
    or lies behind one on the way to ``root``: those ran as nodes of their own before ``root``'s."""
    feeding: dict[torch.fx.Node, bool] = {}
    stack = [(root, False)]
    while stack:
        node, behind = stack.pop()
        if node in feeding and (feeding[node] or not behind):
            continue
        reduction = node is not root and node_class(node) not in (CLASS_NONE, CLASS_POINTWISE)
        feeding[node] = behind or reduction
        stack.extend((a, feeding[node]) for a in node.all_input_nodes if a in inside)
    return feeding


def _dies_in(node: torch.fx.Node, inside: set, first: int, order: dict[torch.fx.Node, int]) -> bool:
    """Whether ``node``'s storage is read by no node after the group starting at ``first`` (views of it
    followed to their readers; a graph output or an alias kept by a view is a read)."""
    stack, seen = [node], {node}
    while stack:
        n = stack.pop()
        for user in n.users:
            if user in inside or user in seen:
                continue
            if user.op == "output":
                return False
            if is_view_node(user) and user.args and user.args[0] is n:
                seen.add(user)
                stack.append(user)
                continue
            if order.get(user, first + 1) > first:
                return False
    return True


def _view_chain(node: torch.fx.Node, inside: set) -> Optional[list[torch.fx.Node]]:
    """``[v1, ..., node]`` when ``node`` is a chain of views (each reading only its predecessor as a tensor)
    of a group member ``v1.args[0]`` that is not itself a view; None when ``node`` is no such view."""
    chain: list[torch.fx.Node] = []
    cur = node
    while (cur in inside and isinstance(cur.target, torch._ops.OpOverload) and node_class(cur) == CLASS_NONE
           and is_view_node(cur) and cur.args and isinstance(cur.args[0], torch.fx.Node)
           and [i for i in cur.all_input_nodes if _is_tensor(i)] == [cur.args[0]]):
        chain.append(cur)
        cur = cur.args[0]
    if not chain or cur not in inside or not _is_tensor(cur):
        return None
    if any(i in inside and not _is_tensor(i) for v in chain for i in v.all_input_nodes):
        return None   # a size computed inside the group: keep the simple path (materialised)
    return chain[::-1]


def _member_flops(node: torch.fx.Node) -> sympy.Expr:
    call = opcall_from_node(node)
    if call is None:
        return sympy.Integer(0)
    return price_call(call).cost.flops


def recompute_inlined(program: Program) -> Program:
    """Give every kernel its own copy of the inlined values it reads (fusion rule 3).

    Inductor does not store a cheap pointwise value read by several kernels: each kernel recomputes it
    from its inputs (``arange``/``cos`` tables, GPT's embedding sum feeding ``ln_1`` and the residual
    add). ``fusion_groups`` puts such a value in its first consumer's group; here each other consumer
    kernel reading it directly gets a copy (with the inlined values it needs), placed before it, so the
    copy fuses there and the value is neither stored nor re-read. A view of an inlined value read by
    several kernels is copied the same way (each kernel recomputes the value and views it): otherwise
    the kernel reading through the view would depend on the owner's kernel, which Inductor does not do
    (and with the C++ backend's groups that false dependency closed a cycle on Llama's rotary tables).
    """
    fusion = fusion_groups(program)
    if not fusion.inlined:
        return program
    graph, val_map = program.copied_graph()
    phases = dict(program.phases)
    group = {val_map[n]: fusion.group_of[n.name] for n in program.graph.nodes if n.name in fusion.group_of}
    inlined = {val_map[n] for n in program.graph.nodes if n.name in fusion.inlined}
    order = {n: Fraction(i) for i, n in enumerate(graph.nodes)}   # graph position, exact when copies go between
    for n in list(graph.nodes):         # views of inlined values (and views of those): split per kernel too
        if (n.op == "call_function" and node_class(n) == CLASS_NONE and is_view_node(n)
                and n.args and n.args[0] in inlined):
            inlined.add(n)
    for node in sorted(inlined, key=order.__getitem__, reverse=True):
        if node not in group:            # a view: it belongs to the kernel of its first reader
            grouped_users = sorted((u for u in node.users if group.get(u) is not None), key=order.__getitem__)
            if not grouped_users:
                continue
            group[node] = group[grouped_users[0]]
            base = node.args[0]
            while base not in group and base.op == "call_function" and is_view_node(base):
                base = base.args[0]
            if fusion.groups[group[node]].kind != "fused" and base in group \
                    and fusion.groups[group[base]].into_concat == grouped_users[0].name:
                group[node] = group[base]    # read by a ConcatKernel: its copy kernel computes the value
        readers: dict[int, list[torch.fx.Node]] = {}
        for user in list(node.users):
            g = group.get(user)
            if g is not None and g != group[node] and fusion.groups[group[node]].into_concat != user.name:
                readers.setdefault(g, []).append(user)
        for g, users in readers.items():
            first = min(users, key=order.__getitem__)
            with graph.inserting_before(first):
                copy = copy_node(graph, node)
            if node.name in phases:
                phases[copy.name] = phases[node.name]
            group[copy] = g
            # exact position between its graph neighbours: a copy placed before another copy must order
            # before it and after the node preceding both (``first - 0.5`` tied such pairs with an
            # original node, and the next value copied in front of the wrong one: used before defined)
            order[copy] = (order[copy.prev] + order[first]) / 2
            inlined.add(copy)
            for u in users:
                u.replace_input_with(node, copy)
    return program.rewritten(graph, phases=phases)


def compile_program(program: Program) -> Program:
    """The Program ``torch.compile`` would run: one ``FusedKernel`` node per generated kernel."""
    fused_op()
    backend = backend_for(program)
    # what AOTAutograd hands Inductor (the dispatcher's decompositions) and Inductor's post-grad rewrites
    program = functional_inplace(decompose_pools(sizes_from_inputs(program)))
    program = reorder_for_locality(decompose_cpu_attention(drop_empty_cat_inputs(program)))
    program = low_memory_max_pool(fuse_addmm(channels_last_convolutions(program, backend), backend))
    program = recompute_for_backward(eliminate_common_subexpressions(program))
    program = backward_convolution_operands(recompute_inlined(program), backend)
    fusion = fusion_groups(program)
    graph = program.graph
    nodes = list(graph.nodes)
    by_name = {n.name: n for n in nodes}
    order = {n: i for i, n in enumerate(nodes)}
    unit_of: dict[torch.fx.Node, int] = {}
    units: list[list[torch.fx.Node]] = []
    rewritten: set[int] = set()
    copy_into: dict[int, str] = {}       # unit -> the cat whose slice it copies a view input into
    for group in fusion.groups:
        if group.kind != "fused":
            continue
        members = [by_name[m] for m in group.members]
        body = sorted(members + _absorbed_views(members, program), key=order.__getitem__)
        for n in body:
            unit_of[n] = len(units)
        rewritten.add(len(units))
        if group.into_concat is not None:
            copy_into[len(units)] = group.into_concat
        units.append(body)
    for n in nodes:
        if n not in unit_of:
            unit_of[n] = len(units)
            units.append([n])
    # topological order of units, stable by first original position
    deps: list[set[int]] = [set() for _ in units]
    for u, body in enumerate(units):
        for n in body:
            for inp in n.all_input_nodes:
                if unit_of[inp] != u:
                    deps[u].add(unit_of[inp])
    users: list[list[int]] = [[] for _ in units]
    for u, ds in enumerate(deps):
        for d in ds:
            users[d].append(u)
    missing = [len(ds) for ds in deps]
    heap = [(order[units[u][0]], u) for u in range(len(units)) if missing[u] == 0]
    heapq.heapify(heap)
    emitted: list[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        emitted.append(u)
        for v in users[u]:
            missing[v] -= 1
            if missing[v] == 0:
                heapq.heappush(heap, (order[units[v][0]], v))
    if len(emitted) != len(units):
        raise RuntimeError("compile_program: fusion groups form a cycle (a fusion-rule bug)")

    new_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    phases = dict(program.phases)
    held = frozenset(k for kept in (program.gm.meta.get(META_RUNTIME_USES) or {}).values() for k in kept)
    renamed: dict[str, str] = {}
    k = 0
    for u in emitted:
        body = units[u]
        if u not in rewritten:
            node = body[0]
            if _is_assert(node) and any(a not in env for a in node.all_input_nodes):
                continue        # it checked a value the kernels no longer store
            if node.target is operator.getitem and not node.users and node.args[0] not in env:
                continue        # an unused output of a fused member (a LayerNorm backward's input gradient
                                # that nothing needs): no buffer, nothing reads it
            env[node] = copy_node(new_graph, node, lambda n: env[n])
            continue
        inside = set(body)
        # a metadata assert reads no data (Inductor drops it): it does not make a member a buffer
        outputs = [n for n in body if any(user not in inside and not _is_assert(user) for user in n.users)
                   and _is_tensor(n)]
        # An absorbed view read outside the group is not a buffer of its own: Inductor returns its base
        # and the view is a free ``reinterpret_tensor``. Output the base member once and re-apply the
        # view chain after the fused node (before: each view was materialised as a fresh copy, e.g. the
        # RMSNorm output was stored three times for the q/k/v weight gradients; Llama train +26% memory).
        views_after: list[torch.fx.Node] = []
        bases: list[torch.fx.Node] = []
        for n in outputs:
            chain = _view_chain(n, inside)
            if chain is None:
                bases.append(n)
                continue
            bases.append(chain[0].args[0])
            views_after.extend(v for v in chain if v not in views_after)
        outputs = [n for i, n in enumerate(bases) if n not in bases[:i]]
        desc, tensor_inputs, scalar_nodes, scalars = _describe(body)
        desc["outputs"] = [body.index(n) for n in outputs]
        desc_text = json.dumps(desc, sort_keys=True, separators=(",", ":"))
        in_specs = tuple(TensorSpec.from_tensor(n.meta["val"]) for n in tensor_inputs)
        out_specs = tuple(TensorSpec.from_tensor(n.meta["val"]) for n in outputs)
        flops = sum((_member_flops(n) for n in body if node_class(n) != CLASS_NONE), sympy.Integer(0))
        cost = Cost(flops, sum((_nbytes(s) for s in in_specs), sympy.Integer(0)),
                    sum((_nbytes(s) for s in out_specs), sympy.Integer(0)))
        phase = program.phase_of(body[0])
        name = f"fused_{k}"
        k += 1
        ops = tuple(str(n.target).split(".")[-2] if n.target is not operator.getitem else "getitem"
                    for n in body if node_class(n) != CLASS_NONE)
        kernel = FusedKernel(name, tuple(n.name for n in body), ops, desc_text, len(tensor_inputs),
                             tuple(scalars), in_specs, out_specs, cost, phase)
        kernel.inplace = _inplace_reuse(tensor_inputs, outputs, inside, order, held, phase == PHASE_BACKWARD)
        kernel.into_concat = copy_into.get(u)
        first = body[0]
        fused = new_graph.call_function(kernel, tuple(env[n] for n in tensor_inputs + scalar_nodes))
        fused.name = name
        vals = [n.meta["val"] for n in outputs]
        fused.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
        for key in ("nn_module_stack", "stack_trace", "seq_nr"):
            if key in first.meta:
                fused.meta[key] = first.meta[key]
        fused.meta[META_FUSED_MEMBERS] = kernel.members
        phases[fused.name] = phase
        if len(outputs) == 1:
            env[outputs[0]] = fused
            renamed[outputs[0].name] = fused.name
        else:
            for i, out in enumerate(outputs):
                item = new_graph.call_function(operator.getitem, (fused, i))
                item.meta = dict(fused.meta, val=out.meta["val"])
                item.meta.pop(META_FUSED_MEMBERS, None)
                phases[item.name] = phase
                env[out] = item
                renamed[out.name] = item.name
        for view in sorted(views_after, key=order.__getitem__):
            env[view] = copy_node(new_graph, view, lambda n: env[n])
            phases[env[view].name] = phase
    grad_nodes = {renamed.get(name, name): fqn for name, fqn in program.grad_nodes.items()}
    compiled = program.rewritten(new_graph, phases=phases, grad_nodes=grad_nodes)
    compiled = reorder_for_peak_memory(realize_concat_inputs(compiled))
    compiled = plan_buffer_reuse(compiled)
    runtime = program.gm.meta.get(META_RUNTIME_USES)
    if runtime:
        compiled.gm.meta[META_RUNTIME_USES] = _runtime_uses_after_fusion(runtime, env, unit_of, units, rewritten)
    return compiled


def _runtime_uses_after_fusion(runtime: dict[str, tuple[str, ...]], env: dict[torch.fx.Node, torch.fx.Node],
                               unit_of: dict[torch.fx.Node, int], units: list[list[torch.fx.Node]],
                               rewritten: set[int]) -> dict[str, tuple[str, ...]]:
    """A per-rank runtime's frees (``META_RUNTIME_USES``: FSDP's reshard, a pipeline's held tensors) on the
    compiled graph: a node fused into a kernel frees there (the kernel is its step), and a kept tensor that is
    no longer a buffer (computed inside a kernel) has nothing to keep."""
    by_name = {n.name: n for n in unit_of}
    fused_name: dict[int, str] = {}
    for node, new in env.items():
        u = unit_of.get(node)
        if u in rewritten:
            fused_name.setdefault(u, new.args[0].name if new.target is operator.getitem else new.name)

    def step_of(name: str) -> Optional[str]:
        node = by_name.get(name)
        if node is None:
            return None
        if node in env:
            return env[node].name
        u = unit_of[node]
        return fused_name.get(u) if u in rewritten else None

    out: dict[str, tuple[str, ...]] = {}
    for name, kept in runtime.items():
        step = step_of(name)
        buffers = tuple(env[by_name[k]].name for k in kept if k in by_name and by_name[k] in env)
        if step is not None and buffers:
            out[step] = tuple(dict.fromkeys(out.get(step, ()) + buffers))
    return out


def fused_nodes(program: Program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if isinstance(n.target, FusedKernel)]
