"""A pipeline stage's step for M micro-batches, replayed from a stage program that holds three.

A stage program (``pipeline_stages.py``) copies its forward and backward once per micro-batch, so
building and analysing it grows with M: 40 layers x 32 micro-batches is ~270k nodes and ~100 s on an
80-layer model, and ``--search`` visits plans of up to hundreds of micro-batches. Yet every micro-batch
runs the same nodes; only three kinds differ: the first (its gradients become ``.grad``; FSDP gathers
before it), the last (DDP's buckets, the reduce-scatters after it) and the ones between (each gradient
added into ``.grad`` and freed). So the stage program is built once with three micro-batches (the
*template*, ``TEMPLATE_MICROBATCHES``) and its liveness intervals are replayed for M:

- the M schedule's actions in order (``stage_orders``), each running the template action of its kind
  (first, middle or last micro-batch): tagged nodes (``META_ACTION``) once per action, nodes the
  rewrites added once a step, at the position they hold in the first or last micro-batch's action
  (one inside a middle action refuses the replay);
- each storage created by an action lives to the copy of its last use in the same micro-batch; one
  created once a step to its last use in the first / last micro-batch's action, or after the actions;
- the receive buffers, one per micro-batch, and the last stage's ``_merge_outputs`` grow to M;
- a sent tensor lives to its send, its backward (``fwd_cache``) and where the schedule drops its
  ``P2POp`` list (``send_releases`` for the M schedule, not the template's).

The replayed intervals go through the same memory events and caching-allocator replay as a built
program's (``memory_report``), and each template node's kernel counts as many times as it runs
(``node_weights``) in the stage's per-micro-batch costs. ``tests/test_pipeline_compose.py`` checks
both against the programs built with M micro-batches: same peaks, same allocator replay, same step.

Known limitations: interleaved 1F1B (its micro-batches run in rounds of ``pp``) is not replayed
(``composable``); the caller builds those programs whole.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional

import sympy

from boomfx.distributed.pipeline_stages import END, META_ACTION, META_LAYOUT, StageLayout, send_releases
from boomfx.passes.liveness import LivenessInfo, StorageInterval
from boomfx.simulate.pipeline import BACKWARD, FORWARD, stage_orders

TEMPLATE_MICROBATCHES = 3          # first, middle, last


class ComposeError(Exception):
    """The template holds something the replay does not know how to repeat (the caller builds it whole)."""


def composable(cfg: object) -> bool:
    """A pipeline config whose stage programs can be replayed from the template. Not FSDP resharding
    after forward: whether an action all-gathers depends on its place in the schedule (after a
    forward or a backward), not on which of the three kinds of micro-batch it runs."""
    resharding = getattr(cfg, "dp_shard", 1) > 1 and getattr(cfg, "reshards_after_forward", False)
    return (getattr(cfg, "pp", 1) > 1 and getattr(cfg, "stages_per_rank", 1) == 1
            and getattr(cfg, "num_microbatches", 1) > TEMPLATE_MICROBATCHES and not resharding)


def _kind_of(i: int, m: int) -> int:
    """The template micro-batch that micro-batch ``i`` of ``m`` runs like: 0 first, 2 last, 1 between."""
    return 0 if i == 0 else (2 if i == m - 1 else 1)


@dataclass(frozen=True)
class StageReplay:
    liveness: LivenessInfo           # the M-micro-batch step's intervals, in its execution order
    template_step: tuple[int, ...]   # per replayed step, the template step it runs
    node_weights: Mapping[str, float]  # template node -> how many times its kernel runs in the step

    def workspace_at(self, template_workspace: Mapping[int, int]) -> dict[int, int]:
        return {k: template_workspace[t] for k, t in enumerate(self.template_step) if t in template_workspace}


def replay_stage(program: object, liveness: LivenessInfo, schedule: str, m: int) -> StageReplay:
    """The liveness of ``program`` (a template stage program, its ``liveness``) replayed for ``m``
    micro-batches of ``schedule`` (module docstring)."""
    layout: StageLayout = program.gm.meta.get(META_LAYOUT)
    if layout is None or layout.microbatches != TEMPLATE_MICROBATCHES:
        raise ComposeError("not a template stage program")
    nodes = list(program.graph.nodes)
    if tuple(n.name for n in nodes) != liveness.order:
        raise ComposeError("the liveness is not the program's")
    step_of = {n.name: i for i, n in enumerate(nodes)}
    tags = [n.meta.get(META_ACTION) for n in nodes]

    # the template's steps by action: tagged nodes, and once-a-step nodes after a tagged one of the action
    prologue: list[int] = []
    runs: dict[tuple[str, int, int], list[int]] = {}
    owner: list[Optional[tuple[str, int, int]]] = [None] * len(nodes)   # the action whose run holds a step
    last_tagged = max((i for i, t in enumerate(tags) if t is not None), default=-1)
    current: Optional[tuple[str, int, int]] = None
    epilogue: list[int] = []
    for i, tag in enumerate(tags):
        if tag is not None:
            current = tag
        if i > last_tagged:
            epilogue.append(i)
        elif current is None:
            prologue.append(i)
        else:
            runs.setdefault(current, []).append(i)
            owner[i] = current

    order = [(p.kind, p.microbatch, p.virtual_stage) for p in
             stage_orders(schedule, layout.pp, m)[layout.stage]]
    # a tagged step's replayed position is its action's start plus its index in the template run, so
    # only the once-a-step nodes keep a position of their own (``once_pos``)
    run_index = [0] * len(nodes)
    for run in runs.values():
        for j, t in enumerate(run):
            run_index[t] = j
    steps: list[int] = list(prologue)
    instance_at: list[Optional[int]] = [None] * len(prologue)
    once_pos: dict[int, int] = {t: j for j, t in enumerate(prologue)}
    action_start: dict[tuple[str, int, int], int] = {}
    for kind, i, k in order:
        like = _kind_of(i, m)
        run = runs.get((kind, like, k))
        if run is None:
            raise ComposeError(f"the template has no action {kind}{like}")
        start = len(steps)
        action_start[(kind, i, k)] = start
        steps.extend(run)
        instance_at.extend(i if tags[t] is not None else None for t in run)
        for j, t in enumerate(run):
            if tags[t] is None:
                if like == 1:
                    raise ComposeError(f"{nodes[t].name} runs once a step inside a middle micro-batch")
                once_pos[t] = start + j
    for t in epilogue:
        once_pos[t] = len(steps)
        steps.append(t)
        instance_at.append(None)

    def at(t: int, instance: int) -> int:
        """The replayed step of tagged template step ``t`` run by micro-batch ``instance``."""
        tag = tags[t]
        return action_start[(tag[0], instance, tag[2])] + run_index[t]

    def once(t: int) -> int:
        """The replayed step of template step ``t`` where a storage made once a step meets it."""
        if t in once_pos:
            return once_pos[t]
        like = tags[t][1]                   # the template micro-batch: 0 first, 1 between, 2 last
        if like == 1:
            raise ComposeError(f"a once-a-step storage is last used in a middle micro-batch ({nodes[t].name})")
        return at(t, 0 if like == 0 else m - 1)

    releases = _releases(layout, order, m)
    sent_ends = _sent_ends(layout, step_of, tags, at, releases, order, once, m)
    merge_scale = sympy.Rational(m, TEMPLATE_MICROBATCHES)

    sent = {iv.node for iv in liveness.intervals if iv.node in layout.sent}
    if len(sent) != len(layout.sent):
        raise ComposeError("a sent tensor is a view of another storage")
    intervals: list[StorageInterval] = []
    last = len(steps) - 1                    # residents live through the replayed step
    buffer_groups = {name: g for g in layout.buffers for name in g}
    by_start: dict[int, list[StorageInterval]] = {}
    for iv in liveness.intervals:
        if not iv.resident:
            by_start.setdefault(iv.start_step, []).append(iv)
            continue
        group = buffer_groups.get(iv.node)
        if group is None:
            intervals.append(StorageInterval(len(intervals), iv.node, -1, last, iv.nbytes, iv.category))
        elif iv.node == group[0]:          # one receive buffer per micro-batch, as PipelineStage keeps
            for i in range(m):
                intervals.append(StorageInterval(len(intervals), f"{iv.node}.{i}", -1, last, iv.nbytes, iv.category))
    for start, t in enumerate(steps):        # in execution order, as a built program numbers its storages
        created = by_start.get(t)
        if not created:
            continue
        i = instance_at[start]
        for iv in created:
            e = iv.end_step
            if i is None:
                end = once(e)
            elif iv.node in sent:
                end = sent_ends[(iv.node, i)]
            elif tags[e] is not None:
                if tags[e][1] != tags[t][1]:
                    raise ComposeError(f"{iv.node} of one micro-batch is last used by another's {nodes[e].name}")
                end = at(e, i)
            elif e in once_pos and (owner[e] is None or owner[e][1] == tags[t][1]):
                end = once_pos[e]
            else:
                raise ComposeError(f"{iv.node} of one micro-batch is last used by another's {nodes[e].name}")
            nbytes = iv.nbytes * merge_scale if iv.node == layout.merge else iv.nbytes
            intervals.append(StorageInterval(len(intervals), iv.node, start, max(end, start), nbytes, iv.category))
    weights = {nodes[t].name: float(n) for t, n in Counter(steps).items()}
    if layout.merge is not None and layout.merge in weights:
        weights[layout.merge] *= m / TEMPLATE_MICROBATCHES
    replayed = LivenessInfo(tuple(intervals), tuple(nodes[t].name for t in steps))
    return StageReplay(replayed, tuple(steps), weights)


def _releases(layout: StageLayout, order: list, m: int) -> dict[tuple[str, int], int]:
    """Per sent tensor of the M schedule, the action after which its last reference is dropped (or END)."""
    if layout.releases == "runtime":
        return {(kind, i): END for kind, i, _ in order}
    return send_releases(layout.releases, [(kind, i) for kind, i, _ in order], layout.stage, layout.pp, m)


def _sent_ends(layout: StageLayout, step_of: Mapping[str, int], tags: list, position: Callable[[int, int], int],
               releases: Mapping, order: list, once: Callable[[int], int], m: int) -> dict[tuple[str, int], int]:
    """(sent node, micro-batch) -> the replayed step its storage lives to (module docstring)."""
    out: dict[tuple[str, int], int] = {}
    end_node = layout.action_ends
    for name, (kind, t_kind, k) in layout.sent.items():
        if name not in step_of or tags[step_of[name]] is None:
            raise ComposeError(f"sent tensor {name} is not an action's")
        own = step_of.get(end_node.get((kind, t_kind, k), ""))
        if own is None:
            raise ComposeError(f"the send of {name} is not in the program")
        for i in (i for i in range(m) if _kind_of(i, m) == t_kind):   # the micro-batches that run like it
            ends = [position(own, i)]
            if kind == FORWARD and (BACKWARD, t_kind, k) in layout.backward_ends:   # fwd_cache until its backward
                ends.append(position(step_of[layout.backward_ends[(BACKWARD, t_kind, k)]], i))
            at = releases.get((kind, i), END)
            if at == END:
                ends.append(_end_step(layout, step_of, once))
            else:
                a_kind, a_i, a_k = order[at]
                anchor = step_of[end_node[(a_kind, _kind_of(a_i, m), a_k)]]
                ends.append(position(anchor, a_i))
            out[(name, i)] = max(ends)
    return out


def _end_step(layout: StageLayout, step_of: Mapping[str, int], once: Callable[[int], int]) -> int:
    """The replayed step of the schedule's end (where END-held sends are dropped)."""
    t = step_of.get(layout.pipeline_end)
    if t is None:          # a rewrite replaced it (FSDP moves scale_grads' divides): the last action's end
        t = step_of[layout.action_ends[layout.order[-1]]]
    return once(t)


# -- a template's point as the M-micro-batch step's ----------------------------------------------------
def replayed_point(analysis: object, replay: StageReplay, bindings: Mapping[sympy.Symbol, int],
                   record_trace: bool = False, memory_only: bool = False, replay_allocator: bool = True,
                   exact_total: Optional[bool] = None) -> object:
    """The template's point (its kernels priced once; ``node_weights`` count them) with the memory of
    the replayed step: the same events and allocator replay a built program's memory goes through."""
    from boomfx.analysis.analysis import PointResult
    from boomfx.analysis.memory_events import memory_report

    point = analysis.evaluate(bindings, replay_allocator=False)   # kernels (their workspaces) are needed
    step_of = {name: i for i, name in enumerate(analysis.liveness.order)}
    workspace = {step_of[k.node]: int(k.workspace_bytes) for k in point.report.kernels if k.workspace_bytes}
    memory, rep, events = memory_report(
        replay.liveness, analysis.evaluator(bindings), replay.workspace_at(workspace), analysis.device,
        analysis.outside, analysis.alloc_config, analysis.options.alloc_conf, analysis._node_module,
        analysis._cudagraphs, record_trace, exact_total=not memory_only if exact_total is None else exact_total,
        replay_allocator=replay_allocator)
    return PointResult(replace(point.report, memory=memory), point.timeline, rep, events)


def replayed_comm(step: object, weights: Mapping[str, float]) -> dict[str, float]:
    """A replayed stage's communication for its time row: each collective as often as it runs, in line
    with the stage's passes as ``pipeline_time.stage_compute`` counts it (none hidden)."""
    total = sum(c.price.time_ns * weights.get(c.node, 1.0) for c in step.step.collectives)
    return {"exposed_comm_ns": total, "hidden_comm_ns": 0.0, "comm_cost_ns": total,
            "template_microbatches": TEMPLATE_MICROBATCHES}
