"""FSDP2 inside a pipeline stage: a stage program (``pipeline_stages.py``) rewritten for one shard.

As torch 2.13 runs a ``fully_shard``ed stage module under ``torch.distributed.pipelining``
(``PipelineStage`` sets ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``
before every backward; torchtitan uses ``reshard_after_forward=False`` with pp), per FSDP unit (each
of the stage's layers, then the stage module as the root):

- resident: each parameter's padded dim-0 shard, AdamW state of the local shard (``fsdp.py``);
- the unit's parameters are all-gathered once, before the first micro-batch's first use (the root
  at the stage's first forward op, its pre-forward), and stay unsharded through every micro-batch;
  a flat all-gather buffer lives until the next unit's all-gather, the last until the first
  forward action ends (the root's post-forward);
- the gradients accumulate unsharded over the micro-batches (the stage program's ``.grad`` and
  in-place adds); after the stage's last backward action (``perform_reduce_grad``), per unit, root
  first, its reshard, then one ``_chunk_cat`` + reduce-scatter (the previous unit's input freed at
  this unit's post-backward); ``scale_grads``' in-place
  divides by the micro-batch count follow, on the sharded gradients;
- AdamW steps the shards.

Interleaved 1F1B (``_PipelineScheduleRuntime``): each chunk module is a root of its own, and the
lowered schedule's UNSHARD / REDUCE_GRAD actions replace the hooks' timing (``_interleaved_units``):
every unit's all-gather issued before the first action, each chunk's waited at its first forward,
each chunk's reduce-scatters after its last backward.

Mixed precision (``MixedPrecisionPolicy``, torchtitan's default with pp: bf16 parameters, fp32
reduction): the stages are cut from the step traced with bf16 parameters (``mixed_precision.py``), the
resident shards and AdamW state keep the master dtype and the all-gathers run in bf16 as in
``fsdp.py``. A ``reduce_dtype`` the gradients lack changes the accumulation (``_accumulate_in``): at each
unit's post-backward of the first micro-batch its ``.grad`` is copied into a reduce-dtype accumulator
(``FSDPParam.to_accumulated_grad_if_needed``) and freed; each later micro-batch's ``.grad`` lives to
that micro-batch's post-backward, is added into the accumulator and freed. The reduce-scatters then
read the accumulators.

The gloo truth (``pp_fsdp`` rows of ``benchmarks/results/distributed_gloo.json``) runs the same
collectives in that order (its reduce-scatter as an all_reduce of the ``[N x T]`` input).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx

from boomfx.core.layers import module_path
from boomfx.core.program import (
    META_RUNTIME_USES,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_OPTIMIZER,
    ROLE_PARAM,
    Program,
)
from boomfx.distributed.fsdp import (
    ROOT,
    ShardSpec,
    _all_gather,
    _copy_out,
    _grad_nodes_by_param,
    _master,
    _reduce_scatter,
    _shard_optimizer,
    _Unit,
    padded_shard_shape,
    post_backward_index,
)
from boomfx.distributed.graph_edit import GraphEditor, meta_tensor, owning_layer
from boomfx.distributed.p2p import is_p2p
from boomfx.distributed.pipeline_stages import (
    BACKWARD,
    META_ACTION,
    META_CHUNK,
    META_GRAD_READY,
    META_LAYOUT,
    StageProgram,
)

aten = torch.ops.aten


def fsdp_stage_program(stage: StageProgram, spec: ShardSpec, rank: int) -> Program:
    """The program shard ``rank`` of a ``spec.world``-way FSDP group of pipeline stage ``stage`` runs."""
    program = stage.program
    graph, _ = program.copied_graph()
    phases = dict(program.phases)
    edit = GraphEditor(graph, phases)
    n = spec.world
    params = [p for p in graph.nodes if p.op == "placeholder" and program.input_roles.get(p.name) == ROLE_PARAM]
    interleaved = len(stage.chunk_layers) > 1
    chunk_ids = sorted({x.meta[META_CHUNK] for x in graph.nodes if META_CHUNK in x.meta}) if interleaved else []
    roots = tuple(_chunk_root(k) for k in chunk_ids) if interleaved else (ROOT,)
    units = {name: _Unit(name, [], [], []) for name in roots + tuple(stage.layers)}
    for p in params:
        fqn = program.param_names.get(p.name, p.name)
        owner = next((l for l in stage.layers if fqn.startswith(l + ".")), None)
        if owner is None:   # a root parameter: the chunk module whose forward reads it
            owner = _chunk_root(next(u.meta[META_CHUNK] for u in p.users if META_CHUNK in u.meta)) \
                if interleaved else ROOT
        units[owner].params.append(p)
    full_shapes = {p.name: list(p.meta["val"].shape) for p in params}
    compute_dtype = {u.name: u.params[0].meta["val"].dtype for u in units.values() if u.params}
    grad_of = _grad_nodes_by_param(program, graph)
    for p in params:  # resident shards: the master dtype under mixed precision (fp32 shards, bf16 compute)
        val = p.meta["val"]
        p.meta["val"] = meta_tensor(padded_shard_shape(val.shape, n), _master(val.dtype, spec))
    _shard_optimizer(program, graph, full_shapes, n, rank, spec)
    moved: dict[str, str] = {}
    if spec.reduce_dtype is not None:
        moved = _accumulate_in(spec.reduce_dtype, edit, list(units.values()), grad_of)

    calls = [x for x in graph.nodes if x.op == "call_function"]
    # scale_grads' divides run after FSDP's post-backward, on the sharded gradients: moved there
    grads = set(grad_of.values())
    erased, divisors = set(), []
    for x in [x for x in calls if x.target is aten.div_.Scalar and x.args[0] in grads and not x.users]:
        erased.add(x.name)
        divisors.append(x.args[1])
        graph.erase_node(x)
    calls = [x for x in graph.nodes if x.op == "call_function"]
    last_backward = [x for x in calls if phases.get(x.name) != PHASE_OPTIMIZER
                     and x.target is not aten.cat.default][-1]  # the last action's end (before _merge_outputs)

    if interleaved:
        chunk_units = [[units[_chunk_root(k)]] + [units[l] for l in layers]
                       for k, layers in zip(chunk_ids, stage.chunk_layers)]
        chunk_units = [[u for u in group if u.params] for group in chunk_units]
        sharded_grads = _interleaved_units(edit, spec, rank, stage, chunk_ids, chunk_units, full_shapes,
                                           compute_dtype, grad_of, divisors, moved)
        return _finish(program, graph, phases, edit, moved, erased, last_backward, sharded_grads)
    first_fwd = next(x for x in calls if not is_p2p(x))  # after the first receive: the root's pre-forward
    first_action_end = _first_action_end(calls, phases)
    order = [units[ROOT]] + [units[l] for l in stage.layers]
    order = [u for u in order if u.params]
    fulls_of: dict[str, list[torch.fx.Node]] = {}
    previous_flat: Optional[torch.fx.Node] = None
    for unit in order:
        members = set(unit.params)
        anchor = first_fwd if unit.name == ROOT else next(
            x for x in graph.nodes if x.op == "call_function" and any(a in members for a in x.all_input_nodes)
            and phases.get(x.name) != PHASE_OPTIMIZER)
        dtype = compute_dtype[unit.name]
        flat, waited = _all_gather(edit, spec, rank, unit, anchor, PHASE_FORWARD, dtype)
        if previous_flat is not None:
            edit.keep_alive(waited, [previous_flat])
        fulls = _copy_out(edit, n, full_shapes, unit, waited, anchor, PHASE_FORWARD, dtype)
        created = set(fulls)
        for p, full in zip(unit.params, fulls):
            p.replace_all_uses_with(full, delete_user_cb=lambda user: phases.get(user.name) != PHASE_OPTIMIZER
                                    and user not in created)
        fulls_of[unit.name] = fulls
        previous_flat = flat
    if previous_flat is not None:
        edit.keep_alive(first_action_end, [previous_flat])

    sharded_grads = _reduce_units(edit, spec, rank, order, last_backward, full_shapes, grad_of, fulls_of, divisors)
    return _finish(program, graph, phases, edit, moved, erased, last_backward, sharded_grads)


def _chunk_root(k: int) -> str:
    """The unit of chunk ``k``'s module (interleaved 1F1B: one ``fully_shard`` root per chunk)."""
    return f"@{k}"


def _is_root(name: str) -> bool:
    return name == ROOT or name.startswith("@")


def _reduce_units(edit: GraphEditor, spec: ShardSpec, rank: int, order: list[_Unit], anchor: torch.fx.Node,
                  full_shapes: dict, grad_of: dict[str, torch.fx.Node], fulls_of: dict[str, list[torch.fx.Node]],
                  divisors: list) -> dict[torch.fx.Node, str]:
    """``perform_reduce_grad`` of ``order``'s units after ``anchor``: per unit the reshard, then a
    reduce-scatter (its input alive until the next unit's post-backward), then ``scale_grads``' divides
    on the sharded gradients.
    Returned: sharded gradient -> its parameter's placeholder name."""
    phases = edit.phases
    sharded_grads: dict[torch.fx.Node, str] = {}
    previous_input: Optional[torch.fx.Node] = None
    for unit in order:
        unit.bwd_end = anchor
        # FSDPParamGroup.post_backward reshards (frees the unsharded parameters) before it reduces, and
        # waits on the previous group's reduce-scatter (its input freed) before this one's copy-in
        # (seen on gloo: post_backward_reshard, then post_backward_rs_wait, then chunk_cat)
        edit.keep_alive(anchor, fulls_of[unit.name])
        if previous_input is not None:
            edit.keep_alive(anchor, [previous_input])
        unit_grads = [grad_of[p.name] for p in unit.params]
        rs_in, sharded = _reduce_scatter(edit, unit, unit_grads, full_shapes, spec, rank)
        previous_input = rs_in
        anchor = sharded[-1]
        for p, g, s in zip(unit.params, unit_grads, sharded):
            g.replace_all_uses_with(s, delete_user_cb=lambda user: phases.get(user.name) == PHASE_OPTIMIZER)
            sharded_grads[s] = p.name
    if divisors:
        for view in sharded_grads:
            anchor = edit.call(anchor, aten.div_.Scalar, (view, divisors[0]), view.meta["val"], PHASE_BACKWARD,
                               after=True, like=view)
    return sharded_grads


def _interleaved_units(edit: GraphEditor, spec: ShardSpec, rank: int, stage: StageProgram, chunk_ids: list[int],
                       chunk_units: list[list[_Unit]], full_shapes: dict, compute_dtype: dict,
                       grad_of: dict[str, torch.fx.Node], divisors: list,
                       moved: dict[str, str]) -> dict[torch.fx.Node, str]:
    """FSDP under ``ScheduleInterleaved1F1B`` (``_PipelineScheduleRuntime``, torch 2.13): the lowered
    schedule's ``UNSHARD`` actions (``_add_unshard_reshard``, up to 3 active chunks: all of a rank's 2
    or 3) issue every unit's all-gather before the first action, chunk by chunk, the chunk module
    first; a chunk's handles are waited (copied out, the flat buffer freed) at its first forward; its
    ``REDUCE_GRAD`` follows its last backward action (after that action's send)."""
    graph, phases = edit.graph, edit.phases
    n = spec.world
    layout = stage.program.gm.meta[META_LAYOUT].renamed(moved)
    by_name = {x.name: x for x in graph.nodes}
    calls = [x for x in graph.nodes if x.op == "call_function"]
    issue_at = calls[0]
    first_forward = {}
    for x in calls:
        action = x.meta.get(META_ACTION)
        if action is not None and action[0] != BACKWARD:
            first_forward.setdefault(action[2], x)
    fulls_of: dict[str, list[torch.fx.Node]] = {}
    for k, group in zip(chunk_ids, chunk_units):
        for unit in group:
            _, waited = _all_gather(edit, spec, rank, unit, issue_at, PHASE_FORWARD, compute_dtype[unit.name],
                                    wait_at=first_forward[k])
            fulls = _copy_out(edit, n, full_shapes, unit, waited, first_forward[k], PHASE_FORWARD,
                              compute_dtype[unit.name])
            created = set(fulls)
            for p, full in zip(unit.params, fulls):
                p.replace_all_uses_with(full, delete_user_cb=lambda user: phases.get(user.name) != PHASE_OPTIMIZER
                                        and user not in created)
            fulls_of[unit.name] = fulls
    sharded: dict[torch.fx.Node, str] = {}
    m = layout.microbatches
    for k, group in zip(chunk_ids, chunk_units):
        end = by_name[layout.action_ends[(BACKWARD, m - 1, k)]]
        sharded.update(_reduce_units(edit, spec, rank, group, end, full_shapes, grad_of, fulls_of, divisors))
    return sharded


def _finish(program: Program, graph: torch.fx.Graph, phases: dict[str, str], edit: GraphEditor,
            moved: dict[str, str], erased: set, last_backward: torch.fx.Node,
            sharded_grads: dict[torch.fx.Node, str]) -> Program:
    """The rewritten stage program: gradients named by their sharded views, the runtime uses merged."""
    graph.lint()
    new_grad_nodes = {s.name: program.param_names.get(p, p) for s, p in sharded_grads.items()}
    uses: dict[str, tuple[str, ...]] = {}
    for k, v in program.gm.meta.get(META_RUNTIME_USES, {}).items():  # the erased divides' moved to the end
        while k in moved:   # an erased accumulation's runtime uses stay where it was
            k = moved[k]
        key = last_backward.name if k in erased else k
        uses[key] = tuple(dict.fromkeys(uses.get(key, ()) + tuple(a for a in v if a not in erased)))
    for k, v in edit.extra_uses.items():
        uses[k] = tuple(dict.fromkeys(tuple(uses.get(k, ())) + tuple(v)))
    out = program.rewritten(graph, phases=phases, grad_nodes=new_grad_nodes)
    out.gm.meta[META_RUNTIME_USES] = uses
    if moved and META_LAYOUT in out.gm.meta:
        out.gm.meta[META_LAYOUT] = out.gm.meta[META_LAYOUT].renamed(moved)
    out.gm.meta.pop(META_GRAD_READY, None)  # the reduce-scatters, not the accumulations, end the gradients
    return out


def _first_action_end(calls: list[torch.fx.Node], phases: dict[str, str]) -> torch.fx.Node:
    """The last node of the first micro-batch's forward: before its send, or (last stage) before the
    next receive or the first backward op."""
    seen_recv = False
    previous = calls[0]
    for x in calls:
        if is_p2p(x):
            if x.target.__name__.startswith("send"):
                return x
            if seen_recv:
                return previous
            seen_recv = True
        elif phases.get(x.name) == PHASE_BACKWARD:
            return previous
        previous = x
    return previous


def _accumulate_in(dtype: torch.dtype, edit: GraphEditor, units: list[_Unit],
                   grad_of: dict[str, torch.fx.Node]) -> dict[str, str]:
    """Gradients accumulated over the micro-batches in the reduce dtype, as ``FSDPParam`` does when
    ``set_requires_gradient_sync(False)`` meets a ``reduce_dtype`` the gradients lack: at each unit's
    post-backward the first micro-batch's ``.grad`` is copied into ``unsharded_accumulated_grad``
    (``to_accumulated_grad_if_needed``) and freed; each later micro-batch's ``.grad`` (``AccumulateGrad``
    finds none: it is assigned) is added into it at that micro-batch's post-backward
    (``accumulate_unsharded_grad_if_needed``) and freed. ``grad_of`` then names the accumulators;
    returned: erased node -> the node before it (where runtime uses keyed on it now sit)."""
    graph = edit.graph
    accumulators = set(grad_of.values())
    ends = _post_backwards(graph, units, skip=lambda x: x.target is aten.add_.Tensor and x.args[0] in accumulators)
    owner = {p.name: ROOT if _is_root(u.name) else u.name for u in units for p in u.params}
    moved: dict[str, str] = {}
    # a unit's parameters are accumulated in their order (each cast's temporary and .grad freed before
    # the next): each node goes after the one added before it at the same post-backward
    tail: dict[torch.fx.Node, torch.fx.Node] = {}

    def at(key: tuple) -> torch.fx.Node:
        return tail.get(ends[key], ends[key])

    for param, first in list(grad_of.items()):
        if first.meta["val"].dtype == dtype:
            continue
        adds = [u for u in first.users if u.target is aten.add_.Tensor and u.args[0] is first]
        key = (owner[param], first.meta[META_ACTION])
        acc = _tagged(edit.call(at(key), aten._to_copy.default, (first,),
                                meta_tensor(first.meta["val"].shape, dtype), PHASE_BACKWARD,
                                kwargs={"dtype": dtype}, like=first, after=True), first)
        tail[ends[key]] = acc
        for old in adds:
            key = (owner[param], old.meta[META_ACTION])
            new = _tagged(edit.call(at(key), aten.add_.Tensor,
                                    (acc, old.args[1]), acc.meta["val"], PHASE_BACKWARD, like=old, after=True), old)
            tail[ends[key]] = new
            old.replace_all_uses_with(new)
            moved[old.name] = old.prev.name
            graph.erase_node(old)
        first.replace_all_uses_with(acc, delete_user_cb=lambda user: user is not acc)
        grad_of[param] = acc
    return moved


def _tagged(node: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """``node`` in ``like``'s schedule action and virtual stage (the replay repeats it with them)."""
    for key in (META_ACTION, META_CHUNK):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _post_backwards(graph: torch.fx.Graph, units: list[_Unit],
                    skip: Callable[[torch.fx.Node], bool]) -> dict[tuple, torch.fx.Node]:
    """(unit, backward action) -> the node after which the unit's post-backward hook runs: a layer's once
    the gradient of its input is complete (its last op and the unowned gradient sums after it, as
    ``fsdp._units``), the root's at the backward's final callback (before the action's send). ``skip``:
    nodes that are no anchor (the accumulations, which the caller replaces)."""
    layers = {u.name for u in units if not _is_root(u.name)}
    by_action: dict[tuple, list[torch.fx.Node]] = {}
    for x in graph.nodes:
        action = x.meta.get(META_ACTION)
        if x.op == "call_function" and action is not None and action[0] == BACKWARD and not is_p2p(x) and not skip(x):
            by_action.setdefault(action, []).append(x)
    ends: dict[tuple, torch.fx.Node] = {}
    for action, nodes in by_action.items():
        ends[(ROOT, action)] = nodes[-1]
        last_own: dict[str, int] = {}
        for i, x in enumerate(nodes):
            layer = owning_layer(module_path(x), layers)
            if layer is not None:
                last_own[layer] = i
        for layer, i in last_own.items():
            ends[(layer, action)] = nodes[post_backward_index(nodes, i)]
    return ends
