"""Depth-free training graphs: trace a *truncated* model, then replicate one layer to full depth.

Why: ``boomfx.training.trace`` re-traces forward + backward + optimizer step with ``make_fx``, which costs
about a second per transformer layer (an 80-layer Llama would take minutes). Layers of a stack are
traced into identical code, so we trace only four instances and synthesise the rest:

1. ``truncate``: cut the export graph to prefix + layers ``0, 1, 2, N-1`` + suffix. Layer ``N-1``
   read layer ``N-2``'s outputs; it now reads layer 2's (same positions: checked op by op). The
   parameters of the dropped layers leave the graph signature.
2. ``training._trace`` traces that small program exactly as it would trace the full one.
3. ``boomfx.training.expand.expand`` copies layer 2's forward, backward (and recompute) nodes and its
   optimizer work ``N-4`` times as layers ``3 .. N-2``, with new parameter, gradient and optimizer
   state placeholders, wiring each copy to its neighbours, and extends the optimizer's foreach lists.

Every assumption (contiguous layers, identical op sequences, references that follow the layer
pattern) is checked on the truncated trace; when one fails, ``None`` is returned and the caller
traces the whole model (slow, always right). ``tests/test_fast_training.py`` checks that the
synthesised graph prices and replays exactly like the fully traced one.

Example::

    traced = build_training_program_fast(ep, optimizer="adamw")   # None: use the full trace
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch.fx as fx
from torch.export import ExportedProgram

from boomfx.core.fx_copy import copy_node
from boomfx.core.layers import find_layer_list, layer_index
from boomfx.training.expand import Unsupported

_log = logging.getLogger(__name__)

# Below this depth the full trace is cheap and the truncated one saves nothing.
MIN_LAYERS = 7
KEPT = (0, 1, 2)          # the first three instances, then the last one; 2 is the template


@dataclass(frozen=True)
class Truncated:
    ep: Any                   # duck-typed ExportedProgram (what training._trace reads)
    prefix: str               # "model.layers"
    num_layers: int           # N of the full model


def export_layers(graph: fx.Graph, prefix: str) -> dict[fx.Node, int]:
    """Layer index of each call/get_attr node; unlabelled nodes between two nodes of one layer join it."""
    keyed = [(n, layer_index(n, prefix)) for n in graph.nodes if n.op in ("call_function", "get_attr")]
    out: dict[fx.Node, int] = {}
    last: Optional[int] = None
    pending: list[fx.Node] = []
    for node, idx in keyed:
        if idx is None:
            pending.append(node)
            continue
        if pending and idx == last:
            for p in pending:
                out[p] = idx
        pending = []
        out[node] = idx
        last = idx
    return out


def truncate(ep: ExportedProgram) -> Optional[Truncated]:
    """The export cut to layers 0, 1, 2 and N-1 (see module doc), or None when there is no stack."""
    prefix = find_layer_list(ep.graph)
    if prefix is None:
        return None
    layer = export_layers(ep.graph, prefix)
    members: dict[int, list[fx.Node]] = {}
    for node, idx in layer.items():
        members.setdefault(idx, []).append(node)
    n_layers = max(members) + 1 if members else 0
    if n_layers < MIN_LAYERS or sorted(members) != list(range(n_layers)):
        return None
    last = n_layers - 1
    keep_layers = set(KEPT) | {last}
    template, before_last = members[KEPT[-1]], members[last - 1]
    if [n.target for n in template] != [n.target for n in before_last]:
        raise Unsupported(f"layers {KEPT[-1]} and {last - 1} of the export differ")
    stand_in = dict(zip(before_last, template))      # layer N-1 reads layer 2 in place of layer N-2

    # parameters of dropped layers, by FQN
    specs = list(ep.graph_signature.input_specs)
    dropped_inputs = set()
    for spec in specs:
        target = spec.target or ""
        if target.startswith(prefix + "."):
            rest = target[len(prefix) + 1:].split(".", 1)[0]
            if rest.isdigit() and int(rest) not in keep_layers:
                dropped_inputs.add(spec.arg.name)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def remap(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a in stand_in:
            return env[stand_in[a]]
        raise Unsupported(f"a kept node reads {a.name} of a dropped layer")

    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in dropped_inputs:
            continue
        idx = layer.get(node)
        if idx is not None and idx not in keep_layers:
            continue
        env[node] = copy_node(new, node, remap)
    for node in ep.graph.nodes:      # dropped placeholders must have had only dropped users
        if node.op == "placeholder" and node.name in dropped_inputs:
            if any(u in env for u in node.users):
                raise Unsupported(f"{node.name} is read outside its layer")
    gm = fx.GraphModule(ep.graph_module, new)
    signature = SimpleNamespace(input_specs=[s for s in specs if getattr(s.arg, "name", None) not in dropped_inputs],
                                output_specs=list(ep.graph_signature.output_specs))
    stand = SimpleNamespace(graph=new, graph_module=gm, graph_signature=signature,
                            range_constraints=ep.range_constraints, state_dict=ep.state_dict)
    return Truncated(stand, prefix, n_layers)


# per export (its graph module, held weakly: the traces go with it) and trace options, the truncated trace:
# a search synthesises several depths of one export under one set of options from one trace
_TRACED: "weakref.WeakKeyDictionary[fx.GraphModule, dict[tuple, tuple[Truncated, Any]]]" = weakref.WeakKeyDictionary()


def build_training_program_fast(ep: ExportedProgram, optimizer: str = "adamw", amp: Optional[str] = None,
                                checkpoint: bool = False, *, fused_attention: bool = True,
                                checkpoint_layers: tuple[str, ...] = (), resident_grads: bool = False,
                                param_dtype: Optional[str] = None, loss: str = "auto",
                                depth: Optional[int] = None) -> Any:
    """``training.build_training_program`` for deep stacks in time independent of depth, or None
    (too shallow, no layer list, or a structure the synthesis does not reproduce). ``depth``: synthesise
    that many layers instead of the export's (``ProgramOptions.stack_depth``)."""
    from boomfx.training import trace as training
    from boomfx.training.expand import expand

    try:
        if checkpoint_layers:  # selective checkpointing: exact when layers 1..N-1 agree, else full trace
            from boomfx.training.checkpointing import selection_for_truncation
            checkpoint_layers = selection_for_truncation(ep.graph, checkpoint_layers, KEPT)
            if checkpoint_layers is None:
                return None
        kept = _TRACED.setdefault(ep.graph_module, {})
        key = (optimizer, amp, checkpoint, fused_attention, checkpoint_layers, resident_grads, param_dtype, loss)
        if key in kept:
            cut, traced = kept[key]
        else:
            cut = truncate(ep)
            if cut is None:
                return None
            traced = training.build_training_program(cut.ep, optimizer=optimizer, amp=amp, checkpoint=checkpoint,
                                                     fused_attention=fused_attention,
                                                     checkpoint_layers=checkpoint_layers,
                                                     resident_grads=resident_grads, param_dtype=param_dtype,
                                                     loss=loss)
            kept[key] = (cut, traced)
        layers = cut.num_layers if depth is None else min(depth, cut.num_layers)
        return expand(traced, cut.prefix, KEPT[-1], layers, last=cut.num_layers - 1)
    except Unsupported as exc:
        _log.info("fast training graph not used: %s", exc)
        return None
