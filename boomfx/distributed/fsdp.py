"""FSDP2 (``fully_shard``) and DDP as rewrites of the training program into one rank's program.

FSDP2, per unit (each layer of the main layer list, then the root: embeddings, final norm, head;
torchtitan's wrapping), as ``torch/distributed/fsdp/_fully_shard`` runs it (torch 2.13):

- resident: each parameter's dim-0 shard, padded to ``ceil(d0 / N)`` rows (``_sharded_param_data``);
  AdamW's state and the sharded gradients have the rank's unpadded local shape (``torch.chunk``:
  the last ranks may hold fewer rows, so ranks can differ: rank classes);
- pre-forward: a flat ``[N x T]`` all-gather buffer (T: the unit's padded shard elements;
  ``foreach_all_gather``), ``all_gather_into_tensor`` into it, then ``split_with_sizes_copy`` into
  one ``[N x padded]`` buffer per parameter (``foreach_all_gather_copy_out``). In forward the flat
  buffer is kept until the next unit's copy-out (``all_gather_state``, implicit prefetch) and the
  last one until the root's post-forward;
- post-forward: ``reshard_after_forward`` frees the unsharded parameters (never the root's);
- backward: the unit's pre-backward copies out the all-gather that the unit before it in backward
  order prefetched, and prefetches the next one (``_backward_prefetch``); its flat buffer lives from
  the prefetch to that copy-out;
- post-backward (after the unit's last backward op): reshard, free the previous unit's
  reduce-scatter input (``reduce_scatter_states``, one kept), then ``_chunk_cat`` of the full
  gradients into a ``[N, T]`` reduce-scatter input (the gradients are freed), ``reduce_scatter_tensor``
  into a ``[T]`` output whose views are the sharded gradients (held until ``zero_grad``); HSDP adds an
  in-place ``all_reduce`` of that output over the replicate group. The root's input is freed at the
  final callback.

DDP (``DistributedDataParallel``): the gradient buckets are resident flat buffers (``bucket_cap_mb``,
filled in the order gradients are produced); when a bucket's last gradient is produced it is
``all_reduce``d in place. With ``gradient_as_bucket_view=False`` (the default) nothing else changes:
autograd's gradients are copied into the buckets and back, both held. With ``True`` each gradient is
copied into its bucket view when ready (a ``mul.Scalar_out`` node after the autograd node producing
it) and ``.grad`` is that view from then on: the produced gradient is freed at the copy and the
optimizer reads the bucket (``ddp_bucket_view.py``).

Mixed precision (``MixedPrecisionPolicy``, ``ShardSpec.master_dtype`` / ``reduce_dtype``; the program
traced with bf16 parameters by mixed_precision.py): the resident shards and the optimizer keep the
master dtype, each unit's shards are cast into a flat ``[T]`` input held until the all-gather is
issued, the all-gather and copy-out run in the compute dtype, the reduce-scatter input and output
in ``reduce_dtype``, then cast to the master dtype for the sharded gradients.

Known limitations:
- NCCL's internal buffers are not in the program (see rank analysis); gloo's all-gather temporary is,
  with ``all_gather_scratch`` (the ground truth's backend).
- Tied parameters in different units are not modelled.
- DDP: buckets are not split by dtype (DDP keeps one bucket list per dtype) and the first bucket is not
  capped at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (DDP's default configuration; the buckets' total, the
  gradients' bytes, is the same, only where the all-reduces start moves); without the bucket view
  the copy of each gradient into its bucket (and back) is not a node, so its time is not priced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.fx

from boomfx.core.layers import module_path
from boomfx.training.checkpointing import find_layer_list, layer_names
from boomfx.distributed.ddp_bucket_view import copy_into_bucket, read_bucket_views
from boomfx.distributed.graph_edit import GraphEditor, contiguous_strides, meta_tensor, numel, owning_layer
from boomfx.core.errors import OptionError
from boomfx.core.program import (
    META_FSDP_UNIT,
    META_RUNTIME_USES,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_OPTIMIZER,
    ROLE_OPT_STATE,
    ROLE_PARAM,
    Program,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ROLE_COMM_BUFFER = "comm_buffer"
ROOT = ""  # the root unit's name


# -- shard shapes -------------------------------------------------------------------------------
def padded_shard_shape(shape: Sequence[int], world: int) -> list[int]:
    """FSDP2's padded dim-0 shard: ``ceil(d0 / N)`` rows (``_get_dim0_padded_size`` / N)."""
    shape = [int(s) for s in shape]
    if not shape:
        return shape
    return [math.ceil(shape[0] / world)] + shape[1:]


def local_shard_shape(shape: Sequence[int], world: int, rank: int) -> list[int]:
    """Rank ``rank``'s unpadded shard: ``torch.chunk(param, N, dim=0)[rank]`` (empty past the end)."""
    shape = [int(s) for s in shape]
    if not shape:
        return shape
    chunk = math.ceil(shape[0] / world)
    return [max(0, min(chunk, shape[0] - rank * chunk))] + shape[1:]


@dataclass(frozen=True)
class ShardSpec:
    world: int
    group: str = "dp_shard"
    reshard_after_forward: bool = True
    replicate_world: int = 1  # HSDP: the all-reduce group over replicas
    replicate_group: str = "dp_replicate"
    # gloo's allgather copies through a temporary of the output's size, held during the collective
    # (measured on the gloo ground truth: an ``aten::empty`` of [N x T] inside ``c10d::_allgather_base_``,
    # freed when it returns); NCCL writes into the output directly
    all_gather_scratch: bool = False
    # MixedPrecisionPolicy, clamped as FSDPParam does: the program was traced with the parameters in
    # ``param_dtype`` (ProgramOptions.param_dtype), the resident shards and the optimizer keep
    # ``master_dtype``; gradients are reduce-scattered in ``reduce_dtype`` (None: the gradients' dtype)
    # and cast to ``master_dtype`` when that differs
    wrap: str = "layers"   # the units: each layer then the root, or ("root") the whole model as one
    master_dtype: Optional[torch.dtype] = None   # None: no mixed precision (shards as traced)
    reduce_dtype: Optional[torch.dtype] = None


@dataclass
class _Unit:
    name: str
    params: list[torch.fx.Node]  # placeholders, in registration order
    fwd: list[torch.fx.Node]
    bwd: list[torch.fx.Node]
    bwd_end: Optional[torch.fx.Node] = None


# -- units and where they run -------------------------------------------------------------------
def _units(program: Program, graph: torch.fx.Graph, wrap: str = "layers") -> list[_Unit]:
    """The FSDP units: the root and (``wrap="layers"``) each layer of the main layer list."""
    prefix = find_layer_list(program.graph) if wrap == "layers" else None
    layers = layer_names(program.graph, prefix) if prefix else []
    units = {name: _Unit(name, [], [], []) for name in [ROOT] + layers}
    for node in graph.nodes:
        if node.op == "placeholder" and program.input_roles.get(node.name) == ROLE_PARAM:
            fqn = program.param_names.get(node.name, node.name)
            owner = next((l for l in layers if fqn.startswith(l + ".")), ROOT)
            units[owner].params.append(node)
    calls = [n for n in graph.nodes if n.op == "call_function"]
    first_bwd = next(i for i, n in enumerate(calls) if program.phase_of(n) == PHASE_BACKWARD)
    # forward-phase nodes after the backward (the loss's detach for the output) are not the model's
    calls = [n for i, n in enumerate(calls) if i < first_bwd or program.phase_of(n) != PHASE_FORWARD]
    layer_set = set(layers)
    for node in calls:
        phase = program.phase_of(node)
        if phase not in (PHASE_FORWARD, PHASE_BACKWARD) or _is_size_query(node):
            continue      # a size query runs no kernel and may sit anywhere before its readers
        owner = _owning_layer(module_path(node), layer_set)
        (units[owner].fwd if phase == PHASE_FORWARD else units[owner].bwd).append(node)
    fwd_all = [n for n in calls if program.phase_of(n) == PHASE_FORWARD]
    bwd_all = [n for n in calls if program.phase_of(n) == PHASE_BACKWARD]
    units[ROOT].fwd, units[ROOT].bwd = fwd_all, bwd_all
    position = {n: i for i, n in enumerate(bwd_all)}
    for name in layers:
        unit = units[name]
        if not unit.fwd or not unit.bwd:
            raise OptionError(f"FSDP: layer {name} has no forward or backward ops in the training graph")
        unit.bwd_end = bwd_all[post_backward_index(bwd_all, position[unit.bwd[-1]])]
    units[ROOT].bwd_end = bwd_all[-1]
    return [units[ROOT]] + [units[l] for l in layers]


def _is_size_query(node: torch.fx.Node) -> bool:
    """A node that computes a symbolic size (``sym_size``, arithmetic on sizes), not a tensor: the synthesised
    stack (``training/expand.py``) leaves the template layer's size queries where they were traced, ahead
    of the copies' backward, so they mark no unit's start."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def post_backward_index(nodes: Sequence[torch.fx.Node], last_own: int) -> int:
    """Where a layer unit's post-backward hook fires in backward ``nodes``, given its last own op: once
    the gradient of the unit's input is complete, so the ops after it that belong to no module (the
    residual's gradient sum) come first."""
    end = last_own
    while end + 1 < len(nodes) and not module_path(nodes[end + 1]):   # ops of no module: empty path
        end += 1
    return end


def _post_forward(unit: _Unit) -> torch.fx.Node:
    """The last forward op before ``unit``'s post-forward hook: the root's forward returns before the
    loss is computed on its output (the loss's ops, traced outside the model, carry no module stack;
    a loss kernel's scratch, bf16 ``mean``'s fp32 copy, must not see the last unit's buffers)."""
    if unit.name != ROOT:
        return unit.fwd[-1]
    return next((n for n in reversed(unit.fwd) if "nn_module_stack" in n.meta), unit.fwd[-1])


def _owning_layer(path: str, layers: set[str]) -> str:
    """The layer whose module ``path`` is or is inside, else the root."""
    return owning_layer(path, layers) or ROOT


# -- the FSDP rewrite ---------------------------------------------------------------------------
def fsdp_rank_program(program: Program, spec: ShardSpec, rank: int) -> Program:
    """The program rank ``rank`` of a ``spec.world``-way FSDP2 group runs (see the module docstring)."""
    if not program.options.train:
        raise OptionError("--parallel dp_shard needs --train (FSDP shards a training step)")
    graph, _ = program.copied_graph()
    phases = dict(program.phases)
    edit = GraphEditor(graph, phases)
    units = _units(program, graph, spec.wrap)
    n = spec.world
    grad_of = _grad_nodes_by_param(program, graph)
    full_shapes = {p.name: list(p.meta["val"].shape) for u in units for p in u.params}
    # the dtype each unit computes in (param_dtype under mixed precision), before the shards take theirs
    compute_dtype = {u.name: u.params[0].meta["val"].dtype for u in units if u.params}
    layers = units[1:]
    root = units[0]

    # resident shards (in the master dtype under mixed precision: fp32 shards, bf16 all-gathers)
    for unit in units:
        for p in unit.params:
            val = p.meta["val"]
            p.meta["val"] = meta_tensor(padded_shard_shape(val.shape, n), _master(val.dtype, spec))
    _shard_optimizer(program, graph, full_shapes, n, rank, spec)

    def all_gather(unit: _Unit, anchor: torch.fx.Node, phase: str) -> tuple[torch.fx.Node, torch.fx.Node]:
        return _all_gather(edit, spec, rank, unit, anchor, phase, compute_dtype[unit.name])

    def copy_out(unit: _Unit, waited: torch.fx.Node, anchor: torch.fx.Node, phase: str) -> list[torch.fx.Node]:
        return _copy_out(edit, n, full_shapes, unit, waited, anchor, phase, compute_dtype[unit.name])

    def use(unit: _Unit, fulls: list[torch.fx.Node], nodes: Sequence[torch.fx.Node]) -> None:
        members = set(nodes)
        for p, full in zip(unit.params, fulls):
            p.replace_all_uses_with(full, delete_user_cb=lambda user: user in members)

    # forward: root first, then each layer; a flat buffer lives until the next unit's all-gather
    fwd_full: dict[str, list[torch.fx.Node]] = {}
    previous_flat: Optional[torch.fx.Node] = None
    for unit in units:
        if not unit.params:
            continue
        anchor = unit.fwd[0]
        flat, waited = all_gather(unit, anchor, PHASE_FORWARD)
        if previous_flat is not None:
            edit.keep_alive(waited, [previous_flat])
        fulls = copy_out(unit, waited, anchor, PHASE_FORWARD)
        use(unit, fulls, unit.fwd if unit is not root else [n for n in unit.fwd])
        fwd_full[unit.name] = fulls
        previous_flat = flat
        if spec.reshard_after_forward:
            edit.keep_alive(_post_forward(unit), fulls)
    if previous_flat is not None:
        edit.keep_alive(_post_forward(root), [previous_flat])

    # backward: resharded units are all-gathered again, each (but the root, first in backward)
    # prefetched at the pre-backward of the unit that runs before it in backward
    order = [root] + list(reversed([u for u in layers if u.params]))
    prefetched: dict[str, torch.fx.Node] = {}
    for i, unit in enumerate(order):
        if not unit.params:
            continue
        if spec.reshard_after_forward:
            waited = prefetched.pop(unit.name, None)
            if waited is None:
                _, waited = all_gather(unit, unit.bwd[0], PHASE_BACKWARD)
            fulls = copy_out(unit, waited, unit.bwd[0], PHASE_BACKWARD)
            use(unit, fulls, unit.bwd)
            _rebase_saved_views(edit, fwd_full[unit.name], fulls, unit.bwd[0], phases)
        else:
            fulls = fwd_full[unit.name]
            use(unit, fulls, unit.bwd)
        edit.keep_alive(unit.bwd_end, fulls)  # post-backward reshard
        if spec.reshard_after_forward and i + 1 < len(order):
            nxt = order[i + 1]
            _, waited = all_gather(nxt, unit.bwd[0], PHASE_BACKWARD)
            prefetched[nxt.name] = waited

    # post-backward reduce-scatters, in backward order (layers from the last, the root at the end)
    new_grad_nodes: dict[str, str] = {}
    previous_input: Optional[torch.fx.Node] = None
    for unit in [u for u in reversed(layers) if u.params] + ([root] if root.params else []):
        grads = [grad_of[p.name] for p in unit.params]
        if previous_input is not None:
            edit.keep_alive(unit.bwd_end, [previous_input])
        rs_in, sharded = _reduce_scatter(edit, unit, grads, full_shapes, spec, rank)
        previous_input = rs_in
        for p, g, s in zip(unit.params, grads, sharded):
            g.replace_all_uses_with(s, delete_user_cb=lambda user: phases.get(user.name) == PHASE_OPTIMIZER)
            new_grad_nodes[s.name] = program.param_names.get(p.name, p.name)
    graph.lint()
    uses = dict(program.gm.meta.get(META_RUNTIME_USES, {}))  # the TP rewrite's, if any
    uses.update({k: tuple(v) for k, v in edit.extra_uses.items()})
    gm_meta = {META_RUNTIME_USES: uses}
    out = program.rewritten(graph, phases=phases, grad_nodes=new_grad_nodes)
    out.gm.meta.update(gm_meta)
    return out


def _all_gather(
    edit: GraphEditor, spec: ShardSpec, rank: int, unit: _Unit, anchor: torch.fx.Node, phase: str,
    dtype: torch.dtype, wait_at: Optional[torch.fx.Node] = None,
) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(flat buffer, waited all-gather) of ``unit``'s shards in ``dtype`` (the traced parameters'),
    inserted before ``anchor``; ``wait_at``: waited there instead (an ``unshard(async_op=True)``
    whose handle is waited later: the flat buffer lives from the issue to the wait)."""
    n = spec.world
    total = sum(numel(p.meta["val"].shape) for p in unit.params)
    def sized(elems: int) -> torch.fx.Node:
        return edit.call(anchor, aten.empty.memory_format, ([elems],), meta_tensor([elems], dtype), phase,
                         kwargs={"dtype": dtype, "device": torch.device("cpu")})

    # mixed precision: the shards are first cast into one flat [T] input (``_get_param_all_gather_inputs``'
    # foreach copy), held until the all-gather is issued
    cast_input = sized(total) if dtype != unit.params[0].meta["val"].dtype else None
    flat = sized(n * total)
    own = edit.call(
        anchor, aten.narrow.default, (flat, 0, rank * total, total), meta_tensor([total], dtype), phase
    )
    scratch = None
    if spec.all_gather_scratch:
        scratch = sized(n * total)   # gloo's output-sized temporary
    gathered = edit.call(
        anchor,
        c10d.all_gather_into_tensor_out.default,
        (own, n, spec.group),
        meta_tensor([n * total], dtype),
        phase,
        kwargs={"out": flat},
    )
    waited = edit.wait(wait_at if wait_at is not None else anchor, gathered, phase)
    if scratch is not None:
        edit.keep_alive(gathered, [scratch])
    if cast_input is not None:
        edit.keep_alive(gathered, [cast_input])
    return flat, waited


def _master(traced: torch.dtype, spec: ShardSpec) -> torch.dtype:
    """A parameter's resident (sharded) dtype: the master dtype for floating parameters under mixed
    precision, else as traced."""
    return spec.master_dtype if spec.master_dtype is not None and traced.is_floating_point else traced


def _copy_out(
    edit: GraphEditor,
    n: int,
    full_shapes: Mapping[str, list[int]],
    unit: _Unit,
    waited: torch.fx.Node,
    anchor: torch.fx.Node,
    phase: str,
    dtype: torch.dtype,
) -> list[torch.fx.Node]:
    """Per-parameter unsharded tensors (views of their ``[N x padded]`` buffers, in ``dtype``) before
    ``anchor``."""
    sizes = [numel(p.meta["val"].shape) for p in unit.params]
    total = sum(sizes)
    outs, views = [], []
    for p, size in zip(unit.params, sizes):
        out = edit.call(
            anchor,
            aten.empty.memory_format,
            ([n * size],),
            meta_tensor([n * size], dtype),
            phase,
            kwargs={"dtype": dtype, "device": torch.device("cpu")},
        )
        outs.append(out)
        views.append(
            edit.call(anchor, aten.view.default, (out, [n, size]), meta_tensor([n, size], dtype), phase)
        )
    grid = edit.call(
        anchor, aten.view.default, (waited, [n, total]), meta_tensor([n, total], dtype), phase
    )
    edit.call(
        anchor, aten.split_with_sizes_copy.out, (grid, sizes, 1), None, phase, kwargs={"out": views}
    )
    fulls = []
    for p, out in zip(unit.params, outs):
        shape = full_shapes[p.name]
        rows = edit.call(
            anchor,
            aten.slice.Tensor,
            (out, 0, 0, numel(shape)),
            meta_tensor([numel(shape)], dtype),
            phase,
        )
        fulls.append(
            edit.call(anchor, aten.view.default, (rows, shape), meta_tensor(shape, dtype), phase)
        )
    return fulls


def _rebase_saved_views(
    edit: GraphEditor,
    fwd: list[torch.fx.Node],
    bwd: list[torch.fx.Node],
    anchor: torch.fx.Node,
    phases: dict[str, str],
) -> None:
    """Backward ops that read a forward VIEW of an unsharded parameter (``t(weight)`` saved for
    ``mm``'s backward) read the same view of the re-gathered parameter: FSDP2 frees the storage at
    reshard and all-gathers into it again, so the saved view sees the new data, never the old buffer."""
    from boomfx.passes.aliasing import output_aliases

    base = dict(zip(fwd, bwd))
    rebuilt: dict[torch.fx.Node, torch.fx.Node] = {}

    def chain(node: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
        path = []
        while node not in base:
            if node.op != "call_function" or phases.get(node.name) != PHASE_FORWARD:
                return None
            aliases = output_aliases(node)
            if len(aliases) != 1 or aliases[0] is None or aliases[0][1]:
                return None
            path.append(node)
            node = aliases[0][0]
        return [node] + list(reversed(path))

    def rebuild(path: list[torch.fx.Node]) -> torch.fx.Node:
        current = base[path[0]]
        for view in path[1:]:
            hit = rebuilt.get(view)
            if hit is None:
                src = view.args[0]
                args = (current,) + tuple(view.args[1:]) if src is not None else view.args
                hit = edit.call(
                    anchor,
                    view.target,
                    args,
                    view.meta.get("val"),
                    PHASE_BACKWARD,
                    kwargs=dict(view.kwargs),
                    like=view,
                )
                rebuilt[view] = hit
            current = hit
        return current

    # only backward readers of forward views of the unit's parameters can need it: found from the
    # parameters forward (their view chains), not by scanning the whole graph once per unit
    views: list[torch.fx.Node] = []
    todo = list(fwd)
    while todo:
        for user in todo.pop().users:
            if user not in base and user not in views and chain(user) is not None:
                views.append(user)
                todo.append(user)
    readers = {u for v in views for u in v.users}
    for node in sorted(readers):      # graph order, as the rewrite always ran
        if node.op != "call_function" or phases.get(node.name) != PHASE_BACKWARD or node in rebuilt.values():
            continue
        for inp in list(node.all_input_nodes):
            if inp in base or phases.get(inp.name) != PHASE_FORWARD:
                continue
            path = chain(inp)
            if path is not None and len(path) > 1:
                node.replace_input_with(inp, rebuild(path))


def _reduce_scatter(
    edit: GraphEditor,
    unit: _Unit,
    grads: list[torch.fx.Node],
    full_shapes: Mapping[str, list[int]],
    spec: ShardSpec,
    rank: int,
) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """``_chunk_cat`` + ``reduce_scatter_tensor`` after ``unit``'s post-backward; the sharded grads."""
    n = spec.world
    anchor = unit.bwd_end
    # foreach_reduce: the reduce-scatter runs in reduce_dtype (else the gradients'); _chunk_cat casts
    dtype = spec.reduce_dtype or grads[0].meta["val"].dtype
    master = _master(grads[0].meta["val"].dtype, spec)
    padded = [numel(padded_shard_shape(full_shapes[p.name], n)) for p in unit.params]
    total = sum(padded)
    # inserted after ``anchor`` in reverse, so they run in program order
    rs_in = edit.call(
        anchor,
        aten._chunk_cat.default,
        (grads, 0, n),
        meta_tensor([n, total], dtype),
        PHASE_BACKWARD,
        after=True,
    )
    rs_in.meta[META_FSDP_UNIT] = len(unit.params)   # the unit's hooks, once a step (host work on a CPU)
    flat = edit.call(
        rs_in,
        aten.view.default,
        (rs_in, [n * total]),
        meta_tensor([n * total], dtype),
        PHASE_BACKWARD,
        after=True,
    )
    scattered = edit.call(
        flat,
        c10d.reduce_scatter_tensor.default,
        (flat, "sum", n, spec.group),
        meta_tensor([total], dtype),
        PHASE_BACKWARD,
        after=True,
        like=anchor,
    )
    waited = edit.wait(scattered, scattered, PHASE_BACKWARD, like=anchor, after=True)
    last = waited
    if spec.replicate_world > 1:  # HSDP: the shard's gradient summed over the replicas, in place
        reduced = edit.call(
            last,
            c10d.all_reduce_.default,
            (waited, "sum", spec.replicate_group),
            meta_tensor([total], dtype),
            PHASE_BACKWARD,
            after=True,
            like=anchor,
        )
        last = edit.wait(reduced, reduced, PHASE_BACKWARD, like=anchor, after=True)
    if master != dtype:  # _to_dtype_if_needed(reduce_output, orig_dtype): the sharded grads' own buffer
        last = edit.call(
            last,
            aten._to_copy.default,
            (last,),
            meta_tensor([total], master),
            PHASE_BACKWARD,
            after=True,
            like=anchor,
            kwargs={"dtype": master},
        )
    dtype = master
    views, offset = [], 0
    for p, size in zip(unit.params, padded):
        local = local_shard_shape(full_shapes[p.name], n, rank)
        view = edit.call(
            last,
            aten.as_strided.default,
            (last, local, contiguous_strides(local), offset),
            meta_tensor(local, dtype),
            PHASE_BACKWARD,
            after=True,
            like=anchor,
        )
        last = view
        views.append(view)
        offset += size
    return rs_in, views


def _grad_nodes_by_param(program: Program, graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """Placeholder name of each parameter -> the node producing its gradient (in the copied graph)."""
    by_name = {node.name: node for node in graph.nodes}
    placeholder_of = {fqn: name for name, fqn in program.param_names.items()}
    out = {}
    for node_name, fqn in program.grad_nodes.items():
        if fqn in placeholder_of and node_name in by_name:
            out[placeholder_of[fqn]] = by_name[node_name]
    missing = [
        fqn
        for name, fqn in program.param_names.items()
        if program.input_roles.get(name) == ROLE_PARAM and name not in out
    ]
    if missing:
        raise OptionError(f"FSDP: no gradient node for {', '.join(missing[:3])} (tied or frozen parameters)")
    return out


def _concrete(shape: Sequence[object]) -> Optional[tuple[int, ...]]:
    """The shape as ints, or None when a size is symbolic (never a parameter's: compiled optimizer groups
    can carry an activation-shaped output)."""
    return tuple(shape) if all(isinstance(d, int) for d in shape) else None


def _shard_optimizer(
    program: Program, graph: torch.fx.Graph, full_shapes: Mapping[str, list[int]], n: int, rank: int,
    spec: ShardSpec,
) -> None:
    """Optimizer state and every optimizer tensor of a parameter's full shape take the rank's local
    shape (and the master dtype under mixed precision: the optimizer steps the fp32 shards)."""
    local = {tuple(s): local_shard_shape(s, n, rank) for s in full_shapes.values()}

    def shard(val: object) -> object:
        if isinstance(val, torch.Tensor) and val.dim() > 0 and _concrete(val.shape) in local:
            return meta_tensor(local[tuple(val.shape)], _master(val.dtype, spec))
        if isinstance(val, (list, tuple)):
            return type(val)(shard(v) for v in val)
        return val

    for node in graph.nodes:
        if node.op == "placeholder" and program.input_roles.get(node.name) == ROLE_OPT_STATE:
            node.meta["val"] = shard(node.meta["val"])
        elif node.op == "call_function" and program.phase_of(node) == PHASE_OPTIMIZER:
            node.meta["val"] = shard(node.meta.get("val"))


# -- DDP ----------------------------------------------------------------------------------------
def ddp_rank_program(
    program: Program, world: int, bucket_cap_mb: float, group: str = "dp_replicate",
    ready: Optional[Mapping[str, str]] = None, gradient_as_bucket_view: bool = False,
) -> Program:
    """The program of one DDP rank: resident gradient buckets, each all-reduced in place when full.
    ``ready``: the nodes after which each gradient is final (default ``program.grad_nodes``; a
    pipeline stage's are its last micro-batch's accumulations, the only backward DDP syncs).
    ``gradient_as_bucket_view``: each gradient is copied into its bucket when ready and ``.grad`` is
    the bucket's view from then on (``ddp_bucket_view.py``)."""
    if not program.options.train:
        raise OptionError("--parallel dp_replicate needs --train (DDP replicates a training step)")
    graph, _ = program.copied_graph()
    phases = dict(program.phases)
    roles = dict(program.input_roles)
    edit = GraphEditor(graph, phases)
    by_name = {node.name: node for node in graph.nodes}
    ready = program.grad_nodes if ready is None else ready
    grads = [by_name[name] for name in ready if name in by_name]
    order = {node: i for i, node in enumerate(graph.nodes)}
    grads.sort(key=order.__getitem__)
    cap_bytes = bucket_cap_mb * 1024 * 1024
    buckets: list[list[torch.fx.Node]] = [[]]
    size = 0
    for g in grads:
        nbytes = numel(g.meta["val"].shape) * g.meta["val"].element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    first_input = next(n for n in graph.nodes if n.op != "placeholder")
    copies: dict[torch.fx.Node, torch.fx.Node] = {}   # ready gradient -> its copy into the bucket
    for i, bucket in enumerate(b for b in buckets if b):
        dtype = bucket[0].meta["val"].dtype
        elems = sum(numel(g.meta["val"].shape) for g in bucket)
        with graph.inserting_before(first_input):
            buf = graph.placeholder(f"ddp_bucket_{i}")
        buf.meta["val"] = meta_tensor([elems], dtype)
        roles[buf.name] = ROLE_COMM_BUFFER
        last = bucket[-1]
        if gradient_as_bucket_view:
            copied = copy_into_bucket(edit, buf, bucket, world)
            copies.update(zip(bucket, copied))
            last = copied[-1]
        reduced = edit.call(
            last,
            c10d.all_reduce_.default,
            (buf, "sum", group),
            meta_tensor([elems], dtype),
            PHASE_BACKWARD,
            after=True,
            like=bucket[-1],
        )
        edit.wait(reduced, reduced, PHASE_BACKWARD, like=bucket[-1], after=True)
    grad_nodes = dict(program.grad_nodes)
    if gradient_as_bucket_view:
        # each ready node's ``.grad``: itself, or in a pipeline stage the gradient it accumulates into
        dot_grad = {fqn: by_name[name] for name, fqn in grad_nodes.items()}
        read_bucket_views(graph, {g: dot_grad.get(ready[g.name], g) for g in copies}, copies)
        # ``.grad`` is the bucket's view: the gradient category moves to it (the old one is a temporary)
        grad_nodes = {copies[g].name: ready[g.name] for g in copies}
    graph.lint()
    return program.rewritten(graph, phases=phases, input_roles=roles, grad_nodes=grad_nodes)
