"""Tied weights in a loaded program: find which parameter/buffer names are one tensor, and make them one.

Why: in eager PyTorch a tied weight (GPT-2's ``lm_head.weight`` = ``transformer.wte.weight``, T5's
``shared`` embedding read by the encoder, the decoder and the LM head) is one storage. ``torch.export``
keeps one placeholder per name, routes every use to one of them and leaves the others unused; in memory
their fake values share one storage, which is how ``passes/liveness.py`` counts the weight once. A
``.pt2`` file does not record that sharing for the graph's fake values, so a loaded program would count
the weight once per name (T5's embedding 4x).

Evidence, strongest first (:func:`find_ties`):

1. **Storage.** State-dict tensors that share one storage: ``torch.export.save`` writes a tied weight
   with real data once and points every name at that record (``boomfx.pt2_archive`` keeps the
   sharing).
2. **Module structure.** Meta-device exports write no data, so every name points at one empty record
   and the sharing is lost. But the graph still shows it: a node run inside module ``M`` reads the
   placeholder of a weight owned by another module while ``M``'s own weight of the same shape,
   strides and dtype is an unused placeholder (GPT-2's ``transformer.wte`` embedding reads
   ``lm_head.weight``; ``transformer.wte.weight`` is read by nothing). That unused name is tied to the
   weight read.
3. **Unused twins of a proven tie.** An unused placeholder of the same kind, shape, strides and dtype
   as a weight already proven tied by 2, whose module never runs in the graph (T5's ``shared``: an
   embedding module the forward never calls; the encoder and decoder read its weight through their
   ``embed_tokens``), joins that tie.

Known limitations:
    - Rule 3 ties an unused weight of a module that never runs to a proven tie of equal shape; an
      untied, never-used parameter of exactly that shape in a model with such a tie would be dropped
      (eager would still hold it). Rule 2 alone never does this.
    - Ties between tensors of different shapes (one a view of the other) are found by storage only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

__all__ = ["find_ties", "apply_ties"]

_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER)


def _weight_placeholders(ep: ExportedProgram) -> dict[str, tuple[torch.fx.Node, InputKind]]:
    """FQN -> (placeholder node, kind) for every parameter and buffer input."""
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out: dict[str, tuple[torch.fx.Node, InputKind]] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in _WEIGHT_KINDS and spec.target is not None and spec.arg.name in nodes:
            out[spec.target] = (nodes[spec.arg.name], spec.kind)
    return out


def _layout(node: torch.fx.Node) -> Any:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return (tuple(val.shape), tuple(val.stride()), val.dtype)


def _module_of(fqn: str) -> tuple[str, str]:
    module, _, leaf = fqn.rpartition(".")
    return module, leaf


def _modules_run(node: torch.fx.Node) -> list[str]:
    """Module paths of ``nn_module_stack``, outermost first (the root module's path is "")."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


class _Groups:
    """Union-find over FQNs; the representative of a group is the name the graph reads."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        root = name
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        return root

    def union(self, kept: str, other: str) -> None:
        a, b = self.find(kept), self.find(other)
        if a != b:
            self.parent[b] = a
            self.parent.setdefault(a, a)

    def groups(self, order: list[str]) -> list[list[str]]:
        by_root: dict[str, list[str]] = {}
        for name in order:
            if name in self.parent:
                by_root.setdefault(self.find(name), []).append(name)
        return [[root, *sorted(n for n in names if n != root)] for root, names in by_root.items() if len(names) > 1]


def _by_storage(ep: ExportedProgram, weights: dict[str, Any], groups: _Groups) -> None:
    """Rule 1 of the module docstring: one storage, offset, shape and strides is one tensor."""
    same: dict[Any, list[str]] = {}
    for fqn in weights:
        tensor = ep.state_dict.get(fqn)
        if isinstance(tensor, torch.Tensor):
            key = (tensor.untyped_storage()._cdata, tensor.storage_offset(), tuple(tensor.shape),
                   tuple(tensor.stride()))
            same.setdefault(key, []).append(fqn)
    for names in same.values():
        read = [n for n in names if weights[n][0].users]
        kept = read[0] if read else names[0]
        for other in names:
            groups.union(kept, other)


def _by_module_structure(weights: dict[str, Any], groups: _Groups) -> set[str]:
    """Rule 2 of the module docstring; returns the FQNs it tied."""
    unused = {fqn for fqn, (node, _) in weights.items() if not node.users}
    unused_by_module: dict[str, list[str]] = {}
    for fqn in unused:
        unused_by_module.setdefault(_module_of(fqn)[0], []).append(fqn)
    tied: set[str] = set()
    for fqn, (node, kind) in weights.items():
        owner = _module_of(fqn)[0]
        for user in node.users:
            modules = _modules_run(user)
            reader = modules[-1] if modules else None
            if reader is None or reader == owner:
                continue
            twins = [u for u in unused_by_module.get(reader, [])
                     if weights[u][1] == kind and _layout(weights[u][0]) == _layout(node)]
            if len(twins) == 1:   # one candidate only: never guess between two weights of the module
                groups.union(fqn, twins[0])
                tied |= {fqn, twins[0]}
    return tied


def _unused_twins(ep: ExportedProgram, weights: dict[str, Any], groups: _Groups, proven: set[str]) -> None:
    """Rule 3 of the module docstring."""
    if not proven:
        return
    modules_run = {path for n in ep.graph.nodes for path in _modules_run(n)}
    proven_layouts = {(_layout(weights[f][0]), weights[f][1]): groups.find(f) for f in proven}
    for fqn, (node, kind) in weights.items():
        if node.users or fqn in groups.parent or _module_of(fqn)[0] in modules_run:
            continue
        root = proven_layouts.get((_layout(node), kind))
        if root is not None:
            groups.union(root, fqn)


def find_ties(ep: ExportedProgram) -> list[list[str]]:
    """Groups of parameter/buffer FQNs that are one tensor in eager, each led by the name the graph reads.

    Example::

        >>> find_ties(load_program("gpt2.pt2"))
        [['lm_head.weight', 'transformer.wte.weight']]
    """
    weights = _weight_placeholders(ep)
    groups = _Groups()
    _by_storage(ep, weights, groups)
    proven = _by_module_structure(weights, groups)
    _unused_twins(ep, weights, groups, proven)
    return groups.groups(list(weights))


def apply_ties(ep: ExportedProgram) -> list[list[str]]:
    """Make every tie of :func:`find_ties` one tensor, as in eager: the state dict holds one tensor object
    under all its names and the placeholders share one fake value (so one storage). Returns the groups."""
    weights = _weight_placeholders(ep)
    ties = find_ties(ep)
    for kept, *others in ties:
        node = weights[kept][0]
        tensor = ep.state_dict.get(kept)
        for other in others:
            weights[other][0].meta["val"] = node.meta["val"]
            if tensor is not None and other in ep.state_dict:
                ep.state_dict[other] = tensor
    return ties
