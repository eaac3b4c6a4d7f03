"""Block pass: repeated blocks (transformer layers, repeated bottlenecks, encoder/decoder stacks) as
classes of isomorphic subgraphs, so each unique block can be priced once and reported per class.

Two ways to find the instances, then one exact check that groups them:

1. **Module metadata** (``nn_module_stack``, also copied onto backward/recompute nodes by
   ``boomfx.training.trace``): a node belongs to the list entry of its module path (``h.3``,
   ``model.layers.7``, ``encoder.layer.2``; see ``boomfx.core.layers.layer_of``). In a training graph the
   forward, recompute and backward nodes of one layer therefore form one instance.
2. **Structure** (no metadata, or metadata without list entries): the graph's value nodes, in their
   topological order, are labelled by (phase, op, output dtype/shape/stride). A layer stack shows up
   as a *tandem repeat* ``u u u ... u`` of that label sequence. For every period ``p`` we compare the
   sequence with itself shifted by ``p`` (vectorised) and keep the longest periodic run; the period
   covering the most nodes wins (ties: the shorter period, i.e. the most instances). The run's phase
   (where the instances start) is chosen at *cut points*: the rotation whose instance boundaries are
   crossed by the fewest live values (one residual stream, not two). The search then recurses on what
   is left on either side, so the forward and backward stacks of a training graph are found separately.

Grouping is exact: each instance gets a *canonical key*, the ordered tuple of its nodes'
(phase, op, constant arguments, output spec, edges), where an edge to a node of the same instance is
its canonical index, and an edge to an outside node is the order of first use plus that node's spec.
Instances with equal keys are one class, and node ``i`` of instance ``k`` corresponds to node ``i`` of
instance 0. Instances of one module list whose keys differ only by node order are merged when their
refined colours (1-dimensional Weisfeiler-Lehman with individualisation) give an isomorphism; the
instance is then re-ordered to instance 0's canonical order and its key re-checked.

Nodes counted in a block are *value nodes*: ``call_function`` nodes producing tensors. Symbolic-size
arithmetic (``sym_size``, ``operator.mul`` on SymInts) launches nothing and appears only as the
sympy value it carries. Unassigned value nodes lying inside one instance's span (e.g. the backward
sums of residual gradients, which autograd creates with no module) are absorbed into that instance
when every instance of the class absorbs an isomorphic set.

Example::

    >>> info = am.get(block_pass)
    >>> [(c.name, len(c.instances)) for c in info.classes]
    [('model.layers.*', 80)]
    >>> reps = representatives(info)      # node of layer k>0 -> its counterpart in layer 0
    >>> reps["linear_7"]
    'linear'

Known limitations:
- Structural detection finds a repeated *sequence*: a stack whose every other layer differs is found
  as one class of two-layer instances (the metadata path separates the two layer kinds).
- Without metadata, the forward and backward stacks of a training graph are separate classes.
- Only one level of blocks: a list inside a list entry (experts inside a layer) is part of its layer.
- Single instances (a stage's first bottleneck with a downsample) are not blocks: nothing repeats.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.fx

from boomfx.core.layers import layer_of, layer_pattern, module_stack
from boomfx.passes.errors import node_error
from boomfx.passes.opcall import spec_of
from boomfx.passes.specs import TensorSpec
from boomfx.core.program import Program

METHOD_MODULES = "modules"
METHOD_STRUCTURE = "structure"
METHOD_NONE = "none"

MIN_INSTANCES = 2          # a class of one instance repeats nothing
MIN_PERIOD_NODES = 4       # structural blocks shorter than this are op runs, not layers

Nodes = list[torch.fx.Node]
Candidate = tuple[str, Nodes]              # (instance name, its nodes in graph or canonical order)


@dataclass(frozen=True)
class BlockClass:
    """Instances of one repeated block. ``nodes[k][i]`` corresponds to ``nodes[0][i]``."""

    name: str                              # "h.*", or "layers.* (MLPBlock)" when a list holds several kinds
    module_type: str                       # class name of the instances' module ("" when structural)
    instances: tuple[str, ...]             # "h.0", "h.1", ... in graph order
    nodes: tuple[tuple[str, ...], ...]     # per instance, node names in canonical order
    signature: str                         # short digest of the canonical key

    @property
    def nodes_per_instance(self) -> int:
        return len(self.nodes[0]) if self.nodes else 0


@dataclass(frozen=True)
class BlockRef:
    class_index: int
    instance: int
    position: int                          # index in the canonical order


@dataclass(frozen=True)
class BlockInfo:
    classes: tuple[BlockClass, ...]
    node_to_block: Mapping[str, BlockRef]
    method: str                            # METHOD_MODULES | METHOD_STRUCTURE | METHOD_NONE

    def block_of(self, node_name: str) -> Optional[str]:
        """The class name of the block holding ``node_name`` (KernelReport.block), else None."""
        ref = self.node_to_block.get(node_name)
        return self.classes[ref.class_index].name if ref else None

    def instance_of(self, node_name: str) -> Optional[str]:
        ref = self.node_to_block.get(node_name)
        return self.classes[ref.class_index].instances[ref.instance] if ref else None


# ---------------------------------------------------------------------------------------------------
# Canonical descriptions of nodes and instances
# ---------------------------------------------------------------------------------------------------
def is_value_node(node: torch.fx.Node) -> bool:
    """A ``call_function`` node producing a tensor (or tensors); symbolic-size nodes are not."""
    if node.op != "call_function":
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return False


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _constant(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_constant(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _constant(v)) for k, v in value.items())))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", value.node.expr)
    if isinstance(value, TensorSpec):   # compared by its fields; printed only for the digest (_digest)
        return value
    return repr(value)  # dtype, device, layout, memory_format, slice


class _Describer:
    """Per-node descriptions, cached: a node's spec is computed once however many instances read it."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self._val: dict[torch.fx.Node, Any] = {}
        self._label: dict[torch.fx.Node, Any] = {}
        self._by_obj: dict[int, Any] = {}       # id(meta["val"]) -> description (values outlive this)

    def val(self, node: torch.fx.Node) -> Any:
        hit = self._val.get(node)
        if hit is None:
            # many nodes share one fake value (the loader's and training_expand's copies): describe
            # each value object once; printing symbolic sizes is the slow part of a key
            obj = node.meta.get("val")
            hit = self._by_obj.get(id(obj)) if obj is not None else None
            if hit is None:
                hit = _constant(spec_of(obj))
                if obj is not None:
                    self._by_obj[id(obj)] = hit
            self._val[node] = hit
        return hit

    def label(self, node: torch.fx.Node) -> Any:
        """What a node is, without its edges: phase, op, output spec."""
        hit = self._label.get(node)
        if hit is None:
            hit = (self.program.phase_of(node), _target_name(node.target), self.val(node))
            self._label[node] = hit
        return hit

    def key(self, nodes: Sequence[torch.fx.Node]) -> tuple:
        """The canonical key of an instance whose nodes are given in canonical order."""
        index = {n: i for i, n in enumerate(nodes)}
        external: dict[torch.fx.Node, int] = {}

        def arg(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                if a in index:
                    return ("n", index[a])
                if not is_value_node(a) and a.op == "call_function":
                    return ("s", self.val(a))            # a symbolic size: its expression
                slot = external.setdefault(a, len(external))
                return ("x", slot, self.val(a))
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, tuple(arg(v) for v in a))
            if isinstance(a, dict):
                return ("dict", tuple(sorted((str(k), arg(v)) for k, v in a.items())))
            return ("c", _constant(a))

        out = []
        for n in nodes:
            try:
                out.append((self.label(n), arg(tuple(n.args)), arg(dict(n.kwargs))))
            except Exception as exc:  # a description bug must name the node it failed on
                raise node_error("block pass", n, exc) from exc
        return tuple(out)


def _digest(key: tuple) -> str:
    """A short digest of ``repr(key)`` (stored in kernel databases: block rows are found by it)."""
    return hashlib.sha1(_key_repr(key, {}).encode()).hexdigest()[:12]


def _key_repr(value: Any, printed: dict[TensorSpec, str]) -> str:
    """``repr(value)`` for a key, each distinct TensorSpec printed once: a key holds a few hundred
    distinct specs many thousand times, and printing their symbolic sizes was most of a block pass."""
    if type(value) is tuple:
        inner = ", ".join(_key_repr(v, printed) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, TensorSpec):
        if value not in printed:   # as when keys held the spec's repr (digests in databases stay valid)
            printed[value] = repr(repr(value))
        return printed[value]
    return repr(value)


# ---------------------------------------------------------------------------------------------------
# Exact grouping of candidate instances into classes
# ---------------------------------------------------------------------------------------------------
class _OutOfWork(Exception):
    pass


# Matching two instances whose keys differ by node order is colour refinement (1-dimensional
# Weisfeiler-Lehman) of both together, then individualisation: a node still sharing its colour is given
# a colour of its own together with one candidate of the other instance, and the refinement repeats;
# a candidate whose refinement leaves the two instances' colour counts unequal is dropped (backtrack).
# Label-only VF2 (networkx) did this before, and on instances made of near-identical copies (a pipeline
# stage's chunk: one forward and backward per micro-batch) it backtracked until its budget ran out,
# ~2.5 s per pair of 868-node chunks; refinement settles such a pair with one individualisation.
# The work (node signatures computed) is capped at MATCH_WORK_PER_NODE_PAIR x n^2; past MATCH_MAX_NODES
# a pair is not tried at all. An instance not merged is its own class, priced the same, never wrongly.
MATCH_WORK_PER_NODE_PAIR = 1
MATCH_MAX_NODES = 1000


class _Refiner:
    """Colour refinement of two equal-size instances side by side: indices ``0..n-1`` are ``ref``'s
    nodes, ``n..2n-1`` the other's; edges inside an instance carry their input position."""

    def __init__(self, desc: _Describer, ref: Sequence[torch.fx.Node], other: Sequence[torch.fx.Node],
                 work: int) -> None:
        self.n, self.work_left = len(ref), work
        nodes = [*ref, *other]
        self.ins: list[list[tuple[int, int]]] = [[] for _ in nodes]
        self.outs: list[list[tuple[int, int]]] = [[] for _ in nodes]
        labels: dict[tuple, int] = {}
        self.labels = [labels.setdefault(desc.label(v), len(labels)) for v in nodes]
        for base, side in ((0, ref), (self.n, other)):
            index = {v: base + i for i, v in enumerate(side)}
            for v in side:
                for pos, inp in enumerate(v.all_input_nodes):
                    if inp in index:
                        self.ins[index[v]].append((pos, index[inp]))
                        self.outs[index[inp]].append((pos, index[v]))

    def refine(self, colour: list[int]) -> Optional[list[int]]:
        """The stable refinement of ``colour``; None once the two sides' colour counts differ (then no
        isomorphism respects ``colour``)."""
        classes = len(set(colour))
        while True:
            self.work_left -= len(colour)
            if self.work_left < 0:
                raise _OutOfWork
            ids: dict[tuple, int] = {}
            colour = [ids.setdefault((colour[i], tuple(sorted((p, colour[j]) for p, j in self.ins[i])),
                                      tuple(sorted((p, colour[j]) for p, j in self.outs[i]))), len(ids))
                      for i in range(len(colour))]
            if Counter(colour[: self.n]) != Counter(colour[self.n :]):
                return None
            if len(ids) == classes:
                return colour
            classes = len(ids)

    def match(self) -> Optional[list[int]]:
        """For each ``ref`` node, the index (in ``other``) of its image under an isomorphism that keeps
        labels and input positions; None if there is none."""
        colour = self.refine(self.labels)
        if colour is None:
            return None
        stack: list[tuple[list[int], int, Any]] = []   # (colouring, individualised node, candidates left)
        while True:
            shared = self._shared_colour(colour)
            if shared is None:   # every colour names one node per side: that is the isomorphism
                image = {c: i - self.n for i, c in enumerate(colour[self.n :], self.n)}
                return [image[c] for c in colour[: self.n]]
            node = next(i for i in range(self.n) if colour[i] == shared)
            stack.append((colour, node, iter([j for j in range(self.n, 2 * self.n) if colour[j] == shared])))
            colour = None
            while stack and colour is None:
                base, node, candidates = stack[-1]
                for cand in candidates:
                    trial = list(base)
                    trial[node] = trial[cand] = max(base) + 1
                    colour = self.refine(trial)
                    if colour is not None:
                        break
                else:
                    stack.pop()
            if colour is None:
                return None

    def _shared_colour(self, colour: list[int]) -> Optional[int]:
        """The colour of ``ref``'s smallest class of two or more nodes (None if all are single)."""
        counts = Counter(colour[: self.n])
        shared = [(k, c) for c, k in counts.items() if k > 1]
        return min(shared)[1] if shared else None


def _reorder_isomorphic(desc: _Describer, ref: Sequence[torch.fx.Node], other: Sequence[torch.fx.Node],
                        ref_key: tuple) -> Optional[list[torch.fx.Node]]:
    """``other`` in the canonical order of ``ref`` if the two are isomorphic (refinement, then the exact
    key), else None."""
    if len(ref) != len(other) or len(ref) > MATCH_MAX_NODES:
        return None
    try:
        image = _Refiner(desc, ref, other, MATCH_WORK_PER_NODE_PAIR * len(ref) ** 2).match()
    except _OutOfWork:
        return None   # not merged: priced separately, never wrongly
    if image is None:
        return None
    ordered = [other[i] for i in image]
    return ordered if desc.key(ordered) == ref_key else None


def _group(desc: _Describer, candidates: Sequence[Candidate]
           ) -> list[tuple[tuple, list[Candidate]]]:
    """Candidates (name, nodes in graph order) -> [(key, [(name, canonical nodes)])], exact."""
    groups: dict[tuple, list[Candidate]] = {}
    for name, nodes in candidates:
        groups.setdefault(desc.key(nodes), []).append((name, nodes))
    ordered = list(groups.items())
    merged: list[tuple[tuple, list[Candidate]]] = []
    for key, members in ordered:
        for mkey, mmembers in merged:
            ref_nodes = mmembers[0][1]
            mapped = _reorder_isomorphic(desc, ref_nodes, members[0][1], mkey)
            if mapped is None:
                continue
            remapped = [(name, _reorder_isomorphic(desc, ref_nodes, nodes, mkey)) for name, nodes in members]
            if all(nodes is not None for _, nodes in remapped):
                mmembers.extend(remapped)  # type: ignore[arg-type]
                break
        else:
            merged.append((key, list(members)))
    return merged


# ---------------------------------------------------------------------------------------------------
# Candidate instances from module metadata
# ---------------------------------------------------------------------------------------------------
def _module_candidates(values: Sequence[torch.fx.Node]) -> tuple[dict[str, Nodes], dict[str, str]]:
    """Layer (list entry) -> its value nodes in graph order, and layer -> module class name."""
    members: dict[str, list[torch.fx.Node]] = {}
    types: dict[str, str] = {}
    by_stack: dict[int, Any] = {}          # deep synthesised graphs share stack objects per module
    for node in values:
        raw = node.meta.get("nn_module_stack")
        stack = by_stack.get(id(raw)) if raw is not None else None
        if stack is None:
            stack = module_stack(node)
            if raw is not None:
                by_stack[id(raw)] = stack
        if not stack:
            continue
        layer = layer_of(stack[-1][0])
        if layer_pattern(layer) is None:
            continue
        members.setdefault(layer, []).append(node)
        if layer not in types:
            types[layer] = next((cls.rsplit(".", 1)[-1] for path, cls in stack if path == layer), "")
    return members, types


def _absorb(desc: _Describer, values: Sequence[torch.fx.Node], classes: list[list[Candidate]],
            ) -> list[list[Candidate]]:
    """Add unassigned value nodes lying between two nodes of the same instance to that instance, per
    class, when every instance of the class then still has one canonical key."""
    owner: dict[torch.fx.Node, tuple[int, int]] = {}
    for c, members in enumerate(classes):
        for k, (_, nodes) in enumerate(members):
            for n in nodes:
                owner[n] = (c, k)
    extra: dict[tuple[int, int], list[torch.fx.Node]] = {}
    pending: list[torch.fx.Node] = []
    last: Optional[tuple[int, int]] = None
    last_phase = ""
    for node in values:
        here = owner.get(node)
        if here is None:
            pending.append(node)
            continue
        phase = desc.program.phase_of(node)
        # between two nodes of one instance *and one phase*: the head of a training graph lies
        # between the last layer's forward and backward, and is not part of that layer
        if pending and here == last and phase == last_phase and all(
                desc.program.phase_of(n) == phase for n in pending):
            extra.setdefault(here, []).extend(pending)
        pending = []
        last, last_phase = here, phase
    out = []
    for c, members in enumerate(classes):
        if not any((c, k) in extra for k in range(len(members))):
            out.append(members)
            continue
        position = {n: i for i, n in enumerate(values)}
        grown = [(name, sorted(nodes + extra.get((c, k), []), key=position.__getitem__))
                 for k, (name, nodes) in enumerate(members)]
        keys = {desc.key(nodes) for _, nodes in grown}
        out.append(grown if len(keys) == 1 else members)
    return out


# ---------------------------------------------------------------------------------------------------
# Candidate instances from structure (tandem repeats of the label sequence)
# ---------------------------------------------------------------------------------------------------
def _cut_counts(values: Sequence[torch.fx.Node]) -> np.ndarray:
    """cut[b]: values defined before position b and still used at or after b (live across the cut)."""
    position = {n: i for i, n in enumerate(values)}
    diff = np.zeros(len(values) + 2, dtype=np.int64)
    for i, node in enumerate(values):
        last = max((position.get(u, -1) for u in node.users), default=-1)
        if any(u.op == "output" for u in node.users):
            last = len(values)
        if last > i:
            diff[i + 1] += 1
            diff[last + 1] -= 1
    return np.cumsum(diff)[: len(values) + 1]


def _best_repeat(labels: np.ndarray, lo: int, hi: int) -> Optional[tuple[int, int, int]]:
    """(start, period, length of the periodic run) covering the most nodes of labels[lo:hi]."""
    best: Optional[tuple[int, int, int]] = None
    best_cover = 0
    seg = labels[lo:hi]
    n = len(seg)
    for p in range(MIN_PERIOD_NODES, n // 2 + 1):
        if (n // p) * p <= best_cover:       # this period cannot cover more than the best
            continue
        eq = np.concatenate(([0], (seg[:-p] == seg[p:]).astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(eq))
        if len(edges) == 0:
            continue
        starts, ends = edges[0::2], edges[1::2]
        runs = ends - starts
        j = int(np.argmax(runs))
        length = int(runs[j]) + p               # the periodic stretch: run of matches plus one period
        cover = (length // p) * p
        if length // p >= MIN_INSTANCES and cover > best_cover:
            best, best_cover = (lo + int(starts[j]), p, length), cover
    return best


def _structural_candidates(desc: _Describer, values: Sequence[torch.fx.Node]) -> list[Candidate]:
    ids: dict[Any, int] = {}
    labels = np.array([ids.setdefault(desc.label(n), len(ids)) for n in values], dtype=np.int64)
    cut = _cut_counts(values)
    found: list[tuple[int, int, int]] = []           # (start, period, instances)
    todo = [(0, len(values))]
    while todo:
        lo, hi = todo.pop()
        rep = _best_repeat(labels, lo, hi)
        if rep is None:
            continue
        start, p, length = rep
        count = length // p
        spare = length - count * p
        # the rotation whose boundaries are crossed by the fewest live values (ties: the earliest)
        def crossing(r: int) -> tuple[int, int]:
            return sum(int(cut[start + r + k * p]) for k in range(count + 1)), r

        rot = min(range(spare + 1), key=crossing)
        first = start + rot
        found.append((first, p, count))
        todo += [(lo, first), (first + count * p, hi)]
    candidates = []
    for b, (first, p, count) in enumerate(sorted(found)):
        for k in range(count):
            candidates.append((f"repeat{b}.{k}", list(values[first + k * p: first + (k + 1) * p])))
    return candidates


# ---------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------
def block_pass(program: Program, am: Any = None) -> BlockInfo:
    """Find the repeated blocks of ``program`` and their canonical node correspondence.

    Args:
        program: any Program (inference or training graph); the graph is not modified.
        am: the AnalysisManager (unused; blocks need only the graph).
    Returns:
        BlockInfo with one BlockClass per class of isomorphic instances (>= 2 instances), and
        ``node_to_block`` mapping each member node to (class, instance, canonical position).

    Example::

        >>> info = block_pass(program, None)
        >>> info.classes[0].name, info.classes[0].instances[:2]
        ('h.*', ('h.0', 'h.1'))
    """
    values = [n for n in program.graph.nodes if is_value_node(n)]
    order = {n: i for i, n in enumerate(values)}
    desc = _Describer(program)
    members, types = _module_candidates(values)
    method = METHOD_MODULES
    classes: tuple[BlockClass, ...] = ()
    if members:
        by_pattern: dict[str, list[Candidate]] = {}
        for layer, nodes in members.items():
            by_pattern.setdefault(str(layer_pattern(layer)), []).append((layer, nodes))
        groups = [g for cands in by_pattern.values() for g in _group(desc, cands)]
        grown = _absorb(desc, values, [m for _, m in groups if len(m) >= MIN_INSTANCES])
        groups = [(desc.key(m[0][1]), m) for m in grown]
        classes = _classes(groups, types, lambda name: str(layer_pattern(name)), order)
    if not classes:
        method = METHOD_STRUCTURE
        groups = _group(desc, _structural_candidates(desc, values))
        classes = _classes(groups, {}, lambda name: name.rsplit(".", 1)[0] + ".*", order)
    if not classes:
        method = METHOD_NONE
    node_to_block = {}
    for c, cls in enumerate(classes):
        for k, names in enumerate(cls.nodes):
            for i, name in enumerate(names):
                node_to_block[name] = BlockRef(c, k, i)
    return BlockInfo(classes, node_to_block, method)


def _classes(groups: list[tuple[tuple, list[Candidate]]], types: Mapping[str, str],
             pattern_of: Any, order: Mapping[torch.fx.Node, int]) -> tuple[BlockClass, ...]:
    """BlockClasses in graph order of their first node, named by pattern (plus the module kind when one
    list holds several kinds)."""
    kept = [(key, members) for key, members in groups if len(members) >= MIN_INSTANCES]
    kept.sort(key=lambda km: min(order[nodes[0]] for _, nodes in km[1]))
    per_pattern: dict[str, list[int]] = {}
    for i, (_, members) in enumerate(kept):
        per_pattern.setdefault(pattern_of(members[0][0]), []).append(i)
    classes = []
    for i, (key, members) in enumerate(kept):
        members = sorted(members, key=lambda m: order[m[1][0]])
        pattern = pattern_of(members[0][0])
        mtype = types.get(members[0][0], "")
        siblings = per_pattern[pattern]
        name = pattern
        if len(siblings) > 1:
            kinds = [types.get(kept[j][1][0][0], "") for j in siblings]
            unique_kind = mtype and kinds.count(mtype) == 1
            name = f"{pattern} ({mtype})" if unique_kind else f"{pattern} [{siblings.index(i)}]"
        classes.append(BlockClass(name, mtype, tuple(m for m, _ in members),
                                  tuple(tuple(n.name for n in nodes) for _, nodes in members), _digest(key)))
    return tuple(classes)


# ---------------------------------------------------------------------------------------------------
# Consumers: depth-free reuse and the per-class report
# ---------------------------------------------------------------------------------------------------
def representatives(info: BlockInfo) -> dict[str, str]:
    """Each node of instance k > 0 -> its counterpart in instance 0 of its class.

    Corresponding nodes have the same op, constant arguments and symbolic input/output specs, so their
    OpCalls (and Costs, and prices at any binding) are equal: price the representative, reuse the result.
    """
    reps: dict[str, str] = {}
    for cls in info.classes:
        first = cls.nodes[0]
        for names in cls.nodes[1:]:
            for i, name in enumerate(names):
                reps[name] = first[i]
    return reps
