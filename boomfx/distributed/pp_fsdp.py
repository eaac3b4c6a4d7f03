"""FSDP2 inside a pipeline stage: a stage program (``pipeline_stages.py``) rewritten for one shard.

As torch 2.13 runs a ``fully_shard``ed stage module under ``torch.distributed.pipelining``
(``PipelineStage`` sets ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``
before every backward; torchtitan uses ``reshard_after_forward=False`` with pp), per FSDP unit (each
of the stage's layers, then the stage module as the root; with ``--fsdp-wrap root`` the stage module
alone, all its parameters one unit):

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

With ``reshard_after_forward=True`` on the layers (``fully_shard(layer)``'s default) each layer is
gathered per action instead (``_resharding_layers``, ``_Gathers``): whenever a forward or backward finds
it sharded; a forward's post-forward reshards it, a backward leaves it gathered. The stage module, the
root, keeps ``fully_shard``'s root default (never resharded after forward) and is gathered once.

Interleaved 1F1B (``_PipelineScheduleRuntime``): each chunk module is a root of its own, and the
lowered schedule's RESHARD / UNSHARD / REDUCE_GRAD actions set the timing (``_interleaved_units``): the
next 3 chunks the rank computes on are kept gathered (``simulate.pipeline.unshard_reshard``; with up to
3 chunks every unit's all-gather is issued before the first action), each chunk's handles waited at
its next action, its reduce-scatters after its last backward; resharding layers also follow their
hooks there.

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

from dataclasses import astuple
from typing import Callable, Optional

import torch
import torch.fx

from boomfx.core.errors import OptionError
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
    _is_size_query,
    _master,
    _rebase_saved_views,
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
from boomfx.distributed.pp_tied_weights import resize_tied_reductions
from boomfx.simulate.pipeline import PipelinePass, unshard_reshard

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
        owner = next((l for l in stage.layers if fqn.startswith(l + ".")), None) if spec.wrap == "layers" else None
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
    # with reshard_after_forward the layers are gathered per action (_resharding_layers), the root once
    for unit in [u for u in order if u.name == ROOT] if spec.reshard_after_forward else order:
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
    if spec.reshard_after_forward:
        layers = [u for u in order if u.name != ROOT]
        fulls_of.update(_resharding_layers(edit, spec, rank, layers, full_shapes, compute_dtype, previous_flat))
    elif previous_flat is not None:
        edit.keep_alive(first_action_end, [previous_flat])

    sharded_grads = _reduce_units(edit, spec, rank, order, last_backward, full_shapes, grad_of, fulls_of, divisors)
    return _finish(program, graph, phases, edit, moved, erased, last_backward, sharded_grads)


def _resharding_layers(edit: GraphEditor, spec: ShardSpec, rank: int, layers: list[_Unit], full_shapes: dict,
                       compute_dtype: dict, root_flat: Optional[torch.fx.Node]) -> dict[str, list[torch.fx.Node]]:
    """The layer units under ``reshard_after_forward=True`` inside a pipeline stage (torch 2.13,
    ``PipelineScheduleSingle``; seen on gloo, GPipe and 1F1B): a unit is all-gathered at a forward or
    backward action only when it is sharded (``_Gathers``). ``root_flat``: the root's flat buffer, alive
    to the first layer's wait. Returned: unit -> its parameters' unsharded tensors at the end (the last
    backward's gather)."""
    before = set(edit.graph.nodes)
    state = _Gathers(edit, spec, rank, layers, full_shapes, compute_dtype, {u.name for u in layers})
    for action, nodes in _action_nodes(edit).items():
        state.run(action, nodes, root_flat)
        root_flat = None
    _tag_by_position(edit.graph, before)   # the gathers run in their action (a replay repeats them with it)
    _check_all_read_in_actions(edit, [layers])
    return dict(state.current)


def _check_all_read_in_actions(edit: GraphEditor, groups: list[list[_Unit]]) -> None:
    """Every parameter read outside the optimizer happens in a schedule action (each read its gather's
    tensors): one left would read a shard as if it were the whole parameter."""
    for unit in (u for group in groups for u in group):
        left = [u for p in unit.params for u in p.users if edit.phases.get(u.name) != PHASE_OPTIMIZER]
        if left:
            raise OptionError(f"FSDP in a pipeline stage: {left[0].name} reads unit {unit.name or 'root'}'s "
                              f"parameters outside every schedule action")


def _action_nodes(edit: GraphEditor) -> dict[tuple, list[torch.fx.Node]]:
    """Each schedule action's nodes (call_function, not the optimizer's), actions in program order."""
    nodes_of: dict[tuple, list[torch.fx.Node]] = {}
    for x in edit.graph.nodes:
        action = x.meta.get(META_ACTION)
        if x.op == "call_function" and action is not None and edit.phases.get(x.name) != PHASE_OPTIMIZER:
            nodes_of.setdefault(action, []).append(x)
    return nodes_of


class _Gathers:
    """Which FSDP units are gathered and the unsharded tensors each action reads. The ``resharding`` units
    (``reshard_after_forward=True``: the layers) follow FSDP2's hooks inside a stage: all-gathered at a
    forward or backward only when sharded; each forward's post-forward reshards them; a backward leaves
    them gathered (``PipelineStage`` turns ``reshard_after_backward`` off), so the forward after a
    backward (1F1B's steady state) reuses that gather and the backward after it gathers again. In a
    backward that gathers, the stage root's pre-backward prefetches the last layer (when the gradient
    reaches the stage's output: before its first op inside the model) and each layer's pre-backward
    prefetches the one before it; a forward's flat buffers live to the next layer's wait, the last to
    the action's end. Other units are gathered by whoever owns them (``gathered``) and only read here."""

    def __init__(self, edit: GraphEditor, spec: ShardSpec, rank: int, units: list[_Unit], full_shapes: dict,
                 compute_dtype: dict, resharding: set[str]) -> None:
        self.edit, self.spec, self.rank, self.units = edit, spec, rank, units
        self.full_shapes, self.compute_dtype, self.resharding = full_shapes, compute_dtype, resharding
        self.names = {u.name for u in units if not _is_root(u.name)}
        self.sharded = {u.name: True for u in units}
        self.current: dict[str, list[torch.fx.Node]] = {}
        self.forward_fulls: dict[tuple[str, int], list[torch.fx.Node]] = {}

    def gather(self, unit: _Unit, anchor: torch.fx.Node, phase: str,
               wait_at: Optional[torch.fx.Node] = None) -> tuple[torch.fx.Node, torch.fx.Node]:
        return _all_gather(self.edit, self.spec, self.rank, unit, anchor, phase, self.compute_dtype[unit.name],
                           wait_at=wait_at)

    def gathered(self, unit: _Unit, waited: torch.fx.Node, anchor: torch.fx.Node, phase: str) -> None:
        """``unit``'s all-gather ``waited`` is copied out before ``anchor``: its parameters are unsharded."""
        self.current[unit.name] = _copy_out(self.edit, self.spec.world, self.full_shapes, unit, waited, anchor,
                                            phase, self.compute_dtype[unit.name])
        self.sharded[unit.name] = False

    def resharded(self, unit: _Unit, at: torch.fx.Node) -> None:
        """``unit``'s unsharded parameters are freed after ``at``."""
        if not self.sharded[unit.name]:
            self.edit.keep_alive(at, self.current[unit.name])
            self.sharded[unit.name] = True

    def run(self, action: tuple, nodes: list[torch.fx.Node], previous_flat: Optional[torch.fx.Node] = None) -> None:
        """One forward or backward action: gathers where the hooks gather, then every gathered unit's
        parameter reads in the action read its unsharded tensors."""
        kernels = [x for x in nodes if not is_p2p(x) and not _is_size_query(x)]
        own = {u.name: [x for x in kernels if owning_layer(module_path(x), self.names) == u.name] for u in self.units}
        hooked = [u for u in self.units if u.name in self.resharding and own[u.name]]
        members = set(nodes)
        if action[0] == BACKWARD:
            self._backward_gathers(list(reversed(hooked)), kernels, own)
        else:
            previous_flat = self._forward_gathers(hooked, own, previous_flat)
            if previous_flat is not None and kernels:
                self.edit.keep_alive(kernels[-1], [previous_flat])
        for unit in self.units:
            if self.sharded[unit.name]:
                continue
            for p, full in zip(unit.params, self.current[unit.name]):
                p.replace_all_uses_with(full, delete_user_cb=lambda user: user in members)
            key = (unit.name, action[1])
            if action[0] != BACKWARD:
                self.forward_fulls[key] = self.current[unit.name]
            elif self.forward_fulls.get(key, self.current[unit.name]) is not self.current[unit.name] and kernels:
                # the forward's saved views of the parameters read the re-gathered storage
                anchor = (own[unit.name] or kernels)[0]
                _rebase_saved_views(self.edit, self.forward_fulls[key], self.current[unit.name], anchor,
                                    self.edit.phases)
        for unit in hooked:
            if action[0] != BACKWARD:
                self.resharded(unit, own[unit.name][-1])      # post-forward

    def _forward_gathers(self, hooked: list[_Unit], own: dict,
                         previous_flat: Optional[torch.fx.Node]) -> Optional[torch.fx.Node]:
        for unit in hooked:
            if self.sharded[unit.name]:
                ops = own[unit.name]
                flat, waited = self.gather(unit, ops[0], PHASE_FORWARD)
                if previous_flat is not None:
                    self.edit.keep_alive(waited, [previous_flat])
                previous_flat = flat
                self.gathered(unit, waited, ops[0], PHASE_FORWARD)
        return previous_flat

    def _backward_gathers(self, order: list[_Unit], kernels: list, own: dict) -> None:
        prefetched: dict[str, torch.fx.Node] = {}
        in_model = next((x for x in kernels if module_path(x)), None)   # the loss's backward is outside
        if order and self.sharded[order[0].name] and in_model is not None:
            prefetched[order[0].name] = self.gather(order[0], in_model, PHASE_BACKWARD)[1]
        for i, unit in enumerate(order):
            if self.sharded[unit.name]:
                ops = own[unit.name]
                waited = prefetched.pop(unit.name, None)
                if waited is None:
                    waited = self.gather(unit, ops[0], PHASE_BACKWARD)[1]
                self.gathered(unit, waited, ops[0], PHASE_BACKWARD)
                if i + 1 < len(order) and self.sharded[order[i + 1].name]:
                    prefetched[order[i + 1].name] = self.gather(order[i + 1], ops[0], PHASE_BACKWARD)[1]


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
    """FSDP under ``ScheduleInterleaved1F1B`` (``_PipelineScheduleRuntime``, torch 2.13): before each action
    the lowered schedule's ``RESHARD`` and ``UNSHARD`` actions (``simulate.pipeline.unshard_reshard``: the
    next 3 chunks the rank computes on kept gathered) free a chunk's unsharded parameters (after the
    previous action) and issue all-gathers of the chunk's units, chunk module first (up to 3 chunks: all of
    them before the first action, once a step); a chunk's handles are waited (copied out, the flat buffers
    freed) at its next action. With ``reshard_after_forward`` the layers' own hooks also reshard after
    each forward and gather again when needed (``_Gathers``). A chunk's ``REDUCE_GRAD`` follows its last
    backward action (after that action's send)."""
    graph = edit.graph
    layout = stage.program.gm.meta[META_LAYOUT].renamed(moved)
    by_name = {x.name: x for x in graph.nodes}
    nodes_of = _action_nodes(edit)
    order = [PipelinePass(*a) for a in nodes_of]
    units_of = dict(zip(chunk_ids, chunk_units))
    resharding = {u.name for group in chunk_units for u in group if not _is_root(u.name)} \
        if spec.reshard_after_forward else set()
    states = {k: _Gathers(edit, spec, rank, group, full_shapes, compute_dtype, resharding)
              for k, group in units_of.items()}
    issue_first = next(x for x in graph.nodes if x.op == "call_function")
    m = layout.microbatches
    sharded: dict[torch.fx.Node, str] = {}
    before = set(graph.nodes)
    for i, ((evict, fetch), action) in enumerate(zip(unshard_reshard(order), order)):
        nodes = nodes_of[(action.kind, action.microbatch, action.virtual_stage)]
        for k in evict:
            for unit in units_of[k]:
                states[k].resharded(unit, by_name[layout.action_ends[astuple(order[i - 1])]])
        for k in fetch:
            j = next(j for j in range(i, len(order)) if order[j].virtual_stage == k)
            wait_at = nodes_of[astuple(order[j])][0]
            phase = PHASE_BACKWARD if order[j].kind == BACKWARD else PHASE_FORWARD
            for unit in units_of[k]:
                if states[k].sharded[unit.name]:
                    waited = states[k].gather(unit, issue_first if i == 0 else nodes[0], phase, wait_at=wait_at)[1]
                    states[k].gathered(unit, waited, wait_at, phase)
        k = action.virtual_stage
        states[k].run(astuple(action), nodes)
        if action.kind == BACKWARD and action.microbatch == m - 1:   # REDUCE_GRAD
            end = by_name[layout.action_ends[astuple(action)]]
            sharded.update(_reduce_units(edit, spec, rank, units_of[k], end, full_shapes, grad_of,
                                         states[k].current, divisors))
            states[k].sharded.update((unit.name, True) for unit in units_of[k])   # reduce_grad reshards
    _tag_by_position(graph, before)
    _check_all_read_in_actions(edit, chunk_units)
    return sharded


def _tag_by_position(graph: torch.fx.Graph, before: set) -> None:
    """Nodes added since ``before`` run in the action of the first older node after them (none after the
    last action: once a step)."""
    pending: list[torch.fx.Node] = []
    for x in graph.nodes:
        if x not in before:
            pending.append(x)
        elif META_ACTION in x.meta and x.meta[META_ACTION] is not None:
            for y in pending:
                _tagged(y, x)
            pending = []
        elif x.op == "call_function":
            pending = []


def _finish(program: Program, graph: torch.fx.Graph, phases: dict[str, str], edit: GraphEditor,
            moved: dict[str, str], erased: set, last_backward: torch.fx.Node,
            sharded_grads: dict[torch.fx.Node, str]) -> Program:
    """The rewritten stage program: gradients named by their sharded views, the runtime uses merged."""
    resize_tied_reductions(graph)
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
