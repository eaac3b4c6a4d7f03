"""Synthesise an N-layer training graph from the trace of a truncated model (layers 0, 1, 2, N-1).

Why: see ``boomfx.training.truncate``. This module does the graph surgery, in one pass over the traced
graph, checking every assumption it relies on (violations raise ``Unsupported``):

* **Segments.** Each call node of the forward / backward (+ recompute) phases belongs to a layer
  instance by its module path (backward nodes carry their forward node's path); unlabelled nodes
  after a node of an instance and before the next instance's node of the same phase group join the
  earlier instance (e.g. the sum of the two gradients reaching a layer's input). Symbolic-size nodes
  belong to no segment: they are matched by expression. Instances 1, 2 (the template T) and N-1 (S)
  must have identical op sequences per phase, and each segment must be contiguous.
* **References.** Every argument of a template node is explained as: a node of the instance d = -1,
  0 or +1 away (same phase group, same position), a parameter-like placeholder of the template, or a
  shared value. The explanation is confirmed on instances 1 and S wherever it can be checked.
* **Copies** of the template's forward go right after its forward, copies of its backward right
  before its backward (layers run in reverse there), so the order matches a full trace.
* **Optimizer.** Foreach ops take lists with one entry per parameter: the copies' entries are inserted
  after the template's. Per-parameter scalar work (``step`` reads, bias corrections) is tagged with
  its parameter and replicated in place.

Copied nodes share the template's ``meta["val"]`` (same symbolic shapes; no data); copied parameter
and optimizer-state placeholders get ``meta["boomfx.storage_key"]`` so liveness does not mistake
them for weights tied to the template's.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from boomfx.core import fx_copy
from boomfx.core.layers import clean_module_path, layer_index
from boomfx.core.program import (
    PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, PHASE_RECOMPUTE, ROLE_GRAD, ROLE_OPT_STATE, ROLE_PARAM,
)


class Unsupported(Exception):
    """A structural assumption does not hold: trace the whole model instead."""


STORAGE_KEY = "boomfx.storage_key"
_FWD, _BWD = "F", "B"


def _group(phase: Optional[str]) -> Optional[str]:
    if phase == PHASE_FORWARD:
        return _FWD
    if phase in (PHASE_BACKWARD, PHASE_RECOMPUTE):
        return _BWD
    return None


def _sym_key(node: fx.Node) -> Optional[tuple]:
    """(type, expression) of a node producing a SymInt/SymFloat/SymBool, else None."""
    val = node.meta.get("val")
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(val).__name__, val.node.expr)
    return None


def _leaves(args: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    map_arg(args, lambda n: out.append(n) or n)
    return out


def _shape(args: Any) -> Any:
    return map_arg(args, lambda n: None)


class _Expander:
    def __init__(self, traced: Any, prefix: str, template: int, num_layers: int, last: Optional[int] = None) -> None:
        self.t = traced
        self.prefix = prefix
        self.T = template
        self.N = num_layers                          # layers of the result
        self.S = num_layers - 1 if last is None else last   # the traced last instance (keeps its name)
        self.order = [1, template, self.S]           # aligned instances (0 may differ: first layer)
        self.copies = list(range(template + 1, num_layers - 1))
        self.graph = traced.gm.graph
        self.nodes = list(self.graph.nodes)
        self.phases = traced.phases
        self._stacks: dict[tuple, dict] = {}

    # -- naming ------------------------------------------------------------------------------
    def fqn_in(self, fqn: Optional[str], inst: int) -> bool:
        return bool(fqn) and fqn.startswith(f"{self.prefix}.{inst}.")

    def rename_fqn(self, fqn: str, j: int) -> str:
        return f"{self.prefix}.{j}." + fqn[len(f"{self.prefix}.{self.T}."):]

    def rename(self, name: str, j: int) -> str:
        token = self.prefix.replace(".", "_")
        return re.sub(rf"{re.escape(token)}_{self.T}(?=_|$)", f"{token}_{j}", name, count=1)

    def rename_stack(self, stack: dict, j: int) -> dict:
        """The module stack of layer ``j``'s copy; one shared dict per (stack, layer): nodes of one
        module share it, so consumers may cache per stack object."""
        key = (tuple(stack.items()), j)
        hit = self._stacks.get(key)
        if hit is None:
            hit = self._stacks[key] = self._rename_stack(stack, j)
        return hit

    def _rename_stack(self, stack: dict, j: int) -> dict:
        out = {}
        head = f"{self.prefix}.{self.T}"
        for key, value in stack.items():
            path, cls = value if isinstance(value, tuple) else (value, "")
            clean = clean_module_path(str(path))
            if clean == head or clean.startswith(head + "."):
                path = f"{self.prefix}.{j}" + clean[len(head):]
                key = self.rename(str(key), j)
            out[key] = (path, cls)
        return out

    # -- segmentation -----------------------------------------------------------------------
    def segment(self) -> None:
        where: dict[fx.Node, tuple[int, str]] = {}
        pending: list[fx.Node] = []
        last: Optional[tuple[int, str]] = None
        self.sym = {n: k for n in self.nodes if n.op == "call_function" and (k := _sym_key(n)) is not None}
        for node in self.nodes:
            if node.op != "call_function" or node in self.sym:
                continue    # symbolic sizes: interchangeable by expression, matched by value
            group = _group(self.phases.get(node.name))
            if group is None:
                pending, last = [], None
                continue
            idx = layer_index(node, self.prefix)
            if idx is None:
                pending.append(node)
                continue
            here = (idx, group)
            # between two nodes of one instance: that instance; between two instances of one phase
            # group (the sum of the gradients reaching a layer's input): the earlier one
            if pending and last is not None and last[1] == group:
                for p in pending:
                    where[p] = last
            pending = []
            where[node] = here
            last = here
        segs: dict[tuple[int, str], list[fx.Node]] = {}
        self.segs = segs
        for node in self.nodes:
            if node in where:
                segs.setdefault(where[node], []).append(node)
        position = {n: i for i, n in enumerate(n for n in self.nodes if n not in self.sym)}
        for key, members in segs.items():
            if position[members[-1]] - position[members[0]] + 1 != len(members):
                raise Unsupported(f"layer {key[0]} ({key[1]}) is not contiguous in the traced graph")
        for g in (_FWD, _BWD):
            seqs = [segs.get((i, g)) for i in self.order]
            if any(s is None for s in seqs):
                raise Unsupported(f"no {g} segment for some layer")
            ref = [n.target for n in seqs[0]]
            if any([n.target for n in s] != ref for s in seqs[1:]):
                raise Unsupported(f"layers 1, {self.T}, {self.S} differ in phase {g}")
        if not (position[segs[(self.T, _FWD)][-1]] < position[segs[(self.S, _FWD)][0]]
                and position[segs[(self.S, _BWD)][-1]] < position[segs[(self.T, _BWD)][0]]):
            raise Unsupported("layers are not traced in stack order")
        self.segs = segs
        self.where = {n: (i, g, k) for (i, g), members in segs.items() for k, n in enumerate(members)}
        # each segment's region: its span in the graph, with the size nodes interleaved in it
        at = {n: i for i, n in enumerate(self.nodes)}
        self.region = {}
        for key, m in segs.items():
            start = at[m[0]]
            while start > 0 and self.nodes[start - 1] in self.sym:   # size nodes made just before it
                start -= 1
            self.region[key] = self.nodes[start: at[m[-1]] + 1]
        self.region_of = {n: key[0] for key, nodes in self.region.items() for n in nodes if n in self.sym}
        t_region = set(self.region[(self.T, _FWD)]) | set(self.region[(self.T, _BWD)])
        self.local_sym: set[fx.Node] = set()
        for n in self.nodes:         # size nodes of the template's span that read its values
            if n in self.sym and n in t_region and any(
                    self.where.get(a, (None,))[0] == self.T or a in self.local_sym for a in n.all_input_nodes):
                self.local_sym.add(n)

    # -- placeholders -----------------------------------------------------------------------
    def placeholder_maps(self) -> None:
        fqn_of: dict[str, Optional[str]] = {}
        names = [n for n in self.nodes if n.op == "placeholder"]
        param_fqn = self.t.param_names
        # opt-state (and --resident-grads grad) placeholders carry their parameter's FQN in their name:
        # "<key>_<param placeholder>"
        by_param_name = {name: fqn for name, fqn in param_fqn.items()}
        for n in names:
            if n.name in by_param_name:
                fqn_of[n.name] = by_param_name[n.name]
                continue
            for pname, fqn in by_param_name.items():
                if n.name.endswith("_" + pname) and self.t.input_roles.get(n.name) in (ROLE_OPT_STATE, ROLE_GRAD):
                    fqn_of[n.name] = fqn
                    break
        self.fqn_of = fqn_of
        self.t_placeholders = [n for n in names if self.fqn_in(fqn_of.get(n.name), self.T)]
        # the counterpart of each template placeholder in instances 1 and S (by renamed name)
        by_name = {n.name: n for n in names}
        self.ph_in: dict[int, dict[fx.Node, fx.Node]] = {}
        for inst in (1, self.S):
            m = {}
            for n in self.t_placeholders:
                other = by_name.get(self.rename(n.name, inst))
                if other is None:
                    raise Unsupported(f"no counterpart of {n.name} in layer {inst}")
                m[n] = other
            self.ph_in[inst] = m

    # -- explanations of the template's references -----------------------------------------
    def _explain(self, a: fx.Node) -> tuple:
        if a in self.sym:
            return ("sym", self.sym[a], a)
        if a in self.where:
            i, g, k = self.where[a]
            if i not in self.order:
                raise Unsupported(f"layer {self.T} reads {a.name} of layer {i}")
            d = self.order.index(i) - self.order.index(self.T)
            return ("rel", d, g, k)
        if a in self.ph_in[1]:
            return (ROLE_PARAM, a)
        return ("shared", a)

    def _expect(self, desc: tuple, inst: int) -> Any:
        kind = desc[0]
        if kind == "rel":
            _, d, g, k = desc
            pos = self.order.index(inst) + d
            if not 0 <= pos < len(self.order):
                return None              # not checkable on this instance
            return self.segs[(self.order[pos], g)][k]
        if kind == ROLE_PARAM:
            return self.ph_in[inst][desc[1]]
        return desc[1]

    def _matches(self, desc: tuple, b: fx.Node, want: Any) -> bool:
        if desc[0] == "sym":
            return self.sym.get(b) == desc[1]
        return b is want

    def explain_template(self) -> None:
        self.plans: dict[fx.Node, list[tuple]] = {}
        for g in (_FWD, _BWD):
            for k, node in enumerate(self.segs[(self.T, g)]):
                others = [self.segs[(inst, g)][k] for inst in (1, self.S)]
                shape = _shape((node.args, node.kwargs))
                if any(_shape((o.args, o.kwargs)) != shape for o in others):
                    raise Unsupported(f"constant arguments of {node.name} differ between layers")
                mine = _leaves((node.args, node.kwargs))
                theirs = [_leaves((o.args, o.kwargs)) for o in others]
                plan = []
                for slot, a in enumerate(mine):
                    desc = self._explain(a)
                    checked = 0
                    for inst, leaves in zip((1, self.S), theirs):
                        want = self._expect(desc, inst)
                        if want is None:
                            continue
                        if not self._matches(desc, leaves[slot], want):
                            raise Unsupported(f"{node.name} reads {a.name}, which does not follow the layer "
                                              f"pattern in layer {inst}")
                        checked += 1
                    if not checked:
                        raise Unsupported(f"the reference of {node.name} to {a.name} cannot be checked")
                    plan.append(desc)
                self.plans[node] = plan

    # -- the optimizer ----------------------------------------------------------------------
    def optimizer_tags(self) -> None:
        params = [n for n in self.nodes if n.op == "placeholder" and n.name in self.t.param_names]
        self.P = [self.t.param_names[n.name] for n in params]
        index = {fqn: i for i, fqn in enumerate(self.P)}
        self.t_pos = [i for i, fqn in enumerate(self.P) if self.fqn_in(fqn, self.T)]
        if not self.t_pos or self.t_pos != list(range(self.t_pos[0], self.t_pos[-1] + 1)):
            raise Unsupported("the template's parameters are not contiguous in the optimizer's lists")
        self.insert_at = self.t_pos[-1] + 1
        tags: dict[fx.Node, frozenset] = {}
        for n in self.nodes:
            fqn = self.fqn_of.get(n.name) if n.op == "placeholder" else None
            if fqn in index:
                tags[n] = frozenset([index[fqn]])
        for name, fqn in self.t.grad_nodes.items():
            if fqn in index:
                node = next((n for n in self.nodes if n.name == name), None)
                if node is not None:
                    tags[node] = frozenset([index[fqn]])
        self.tags = tags
        self.foreach: set[fx.Node] = set()

    def is_foreach(self, node: fx.Node) -> bool:
        n = len(self.P)
        return any(isinstance(a, (list, tuple)) and len(a) == n for a in (*node.args, *node.kwargs.values()))

    def tag_of(self, node: fx.Node) -> frozenset:
        if node.target is operator.getitem and node.args and node.args[0] in self.foreach:
            return frozenset([node.args[1]])
        if self.is_foreach(node):
            self.foreach.add(node)
            return frozenset()
        out: frozenset = frozenset()
        for a in node.all_input_nodes:
            if a in self.foreach:
                raise Unsupported(f"{node.name} reads the list result of {a.name}")
            out |= self.tags.get(a, frozenset())
        return out

    # -- building ---------------------------------------------------------------------------
    def build(self) -> Any:
        self.segment()
        self.placeholder_maps()
        self.explain_template()
        self.optimizer_tags()
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        envs: dict[int, dict[fx.Node, fx.Node]] = {j: {} for j in self.copies}
        phases: dict[str, str] = {}
        roles = dict(self.t.input_roles)
        param_names = dict(self.t.param_names)
        t_set = {g: set(self.segs[(self.T, g)]) for g in (_FWD, _BWD)}
        s_set = set(self.segs[(self.S, _FWD)]) | set(self.segs[(self.S, _BWD)])
        allowed_readers = t_set[_FWD] | t_set[_BWD] | set(self.segs[(1, _FWD)]) | set(self.segs[(1, _BWD)]) | s_set
        t_all = t_set[_FWD] | t_set[_BWD]
        last_copy = self.copies[-1] if self.copies else None
        first_opt = next((i for i, n in enumerate(self.nodes) if self.phases.get(n.name) == PHASE_OPTIMIZER), None)
        opt_region = set(self.nodes[first_opt:]) if first_opt is not None else set()
        t_tagged: set[fx.Node] = set(self.t_placeholders) | {n for n in self.tags if n in t_all}

        def copy_node(old: fx.Node, j: int, arg_fn: Any) -> fx.Node:
            node = fx_copy.copy_node(new, old, arg_fn)
            if "nn_module_stack" in old.meta:
                node.meta["nn_module_stack"] = self.rename_stack(old.meta["nn_module_stack"], j)
            if old.name in self.phases:
                phases[node.name] = self.phases[old.name]
            envs[j][old] = node
            return node

        def resolve(desc: tuple, j: int, leaf: Optional[fx.Node] = None) -> fx.Node:
            kind = desc[0]
            if kind == "rel":
                _, d, g, k = desc
                inst = j + d
                old = self.segs[(self.T, g)][k]
                if inst == self.T:
                    return env[old]
                if inst == self.N - 1:
                    return env[self.segs[(self.S, g)][k]]
                if inst < self.T:
                    return env[self.segs[(inst, g)][k]]
                return envs[inst][old]
            if j == self.T:        # the template itself: its own parameters and shared values
                return env[leaf]
            if kind == ROLE_PARAM:
                return envs[j][desc[1]]
            if kind == "sym":
                a = desc[2]
                if a in envs[j]:
                    return envs[j][a]          # the copy's own size node (reads the copy's tensors)
                if a in env:
                    return env[a]
                if desc[1] not in by_expr:
                    raise Unsupported(f"no symbolic size {desc[1]} before the copies of layer {j}")
                return by_expr[desc[1]]
            return env[desc[1]]

        def sym_arg(x: fx.Node, j: int) -> fx.Node:
            """An input of a copied size node: the copy's counterpart of a layer value, else itself."""
            if x in envs[j]:
                return envs[j][x]
            if x in self.where:
                i, g, k = self.where[x]
                if i not in self.order:
                    raise Unsupported(f"a size node of layer {self.T} reads {x.name} of layer {i}")
                return resolve(("rel", self.order.index(i) - self.order.index(self.T), g, k), j)
            return env[x]

        def emit_segment_copy(g: str, j: int) -> None:
            for old in self.region[(self.T, g)]:
                if old in self.plans:
                    plan = iter(self.plans[old])
                    copy_node(old, j, lambda a: resolve(next(plan), j))
                elif old in self.local_sym:
                    # size nodes reading the layer's tensors are uses of them (liveness): copy in place
                    copy_node(old, j, lambda a: sym_arg(a, j))

        def map0(a: fx.Node, reader: fx.Node) -> fx.Node:
            if reader in self.sym:             # a symbolic size: as the layer it lies in reads
                if a in t_all and self.region_of.get(reader) == self.S and last_copy is not None:
                    return envs[last_copy][a]
                return env[a]
            if a in t_all and reader not in allowed_readers and reader not in opt_region:
                raise Unsupported(f"{reader.name} reads {a.name} of the template layer")
            if a in t_all and reader in s_set and last_copy is not None:
                return envs[last_copy][a]      # layer N-1 reads layer N-2, the last copy
            if a in self.t_placeholders and reader not in t_all and reader not in opt_region:
                raise Unsupported(f"{reader.name} reads the template's {a.name}")
            return env[a]

        def mapj(a: Any, j: int) -> Any:
            if not isinstance(a, fx.Node):
                return a
            if a in envs[j]:
                return envs[j][a]
            if a in t_tagged:
                raise Unsupported(f"{a.name} of the template has no copy")
            return env[a]

        buffer: list[fx.Node] = []
        by_expr: dict[tuple, fx.Node] = {}      # first new node of each symbolic expression

        def flush() -> None:
            if not buffer:
                return
            for j in self.copies:
                for old in buffer:
                    if old.op == "placeholder":
                        node = new.placeholder(self.rename(old.name, j))
                        node.meta = dict(old.meta)
                        node.meta[STORAGE_KEY] = ("copy", node.name)
                        envs[j][old] = node
                        roles[node.name] = roles[old.name]
                        if old.name in param_names:
                            param_names[node.name] = self.rename_fqn(param_names[old.name], j)
                    elif old.target is operator.getitem and old.args[0] in self.foreach:
                        t = self.t_pos.index(old.args[1])
                        idx = self.insert_at + (j - self.copies[0]) * len(self.t_pos) + t
                        node = new.call_function(old.target, (env[old.args[0]], idx))
                        node.meta = dict(old.meta)
                        phases[node.name] = self.phases.get(old.name, PHASE_OPTIMIZER)
                        envs[j][old] = node
                    else:
                        copy_node(old, j, lambda a: mapj(a, j))
            buffer.clear()

        def expand_list(lst: Any, reader: fx.Node) -> Any:
            if not (isinstance(lst, (list, tuple)) and len(lst) == len(self.P)):
                return map_arg(lst, lambda a: map0(a, reader))
            head = [map_arg(x, lambda a: map0(a, reader)) for x in lst[: self.insert_at]]
            mid = [mapj(lst[p], j) for j in self.copies for p in self.t_pos]
            tail = [map_arg(x, lambda a: map0(a, reader)) for x in lst[self.insert_at:]]
            return type(lst)(head + mid + tail)

        fwd_last = self.segs[(self.T, _FWD)][-1]
        bwd_first = self.segs[(self.T, _BWD)][0]
        for old in self.nodes:
            if old.op == "placeholder":
                if old in self.t_placeholders:
                    env[old] = fx_copy.copy_node(new, old)
                    buffer.append(old)
                    continue
                flush()
                env[old] = fx_copy.copy_node(new, old)
                continue
            if old not in opt_region:
                flush()
            if old is bwd_first:
                for j in reversed(self.copies):
                    emit_segment_copy(_BWD, j)
            if old in opt_region and old.op == "call_function":
                tag = self.tag_of(old)
                if len(tag) > 1 and tag & set(self.t_pos):
                    raise Unsupported(f"{old.name} mixes the template's parameters with others")
                if old in self.foreach:
                    flush()
                    for a in (*old.args, *old.kwargs.values()):
                        if isinstance(a, fx.Node) and self.tags.get(a, frozenset()) & set(self.t_pos):
                            raise Unsupported(f"{old.name} reads a per-parameter value outside its lists")
                    args = tuple(expand_list(a, old) for a in old.args)
                    kwargs = {k: expand_list(v, old) for k, v in old.kwargs.items()}
                    node = new.create_node(old.op, old.target, args, kwargs, old.name)
                    node.meta = dict(old.meta)
                    val = old.meta.get("val")
                    if isinstance(val, (list, tuple)) and len(val) == len(self.P):
                        node.meta["val"] = type(val)(list(val[: self.insert_at])
                                                     + [val[p] for _ in self.copies for p in self.t_pos]
                                                     + list(val[self.insert_at:]))
                    env[old] = node
                    phases[node.name] = self.phases.get(old.name, PHASE_OPTIMIZER)
                    continue
                self.tags[old] = tag
                is_t = bool(tag) and next(iter(tag)) in self.t_pos
                if not is_t:
                    flush()
                if old.target is operator.getitem and old.args[0] in self.foreach:
                    i = old.args[1]
                    idx = i if i < self.insert_at else i + len(self.copies) * len(self.t_pos)
                    node = new.call_function(old.target, (env[old.args[0]], idx))
                    node.meta = dict(old.meta)
                else:
                    node = fx_copy.copy_node(new, old, lambda a: map0(a, old))
                env[old] = node
                if old.name in self.phases:
                    phases[node.name] = self.phases[old.name]
                if is_t:
                    t_tagged.add(old)
                    buffer.append(old)
                continue
            if old in opt_region:
                flush()
            if old in self.plans:      # the template: its neighbours above may now be copies
                plan = iter(self.plans[old])
                env[old] = fx_copy.copy_node(new, old, lambda a: resolve(next(plan), self.T, a))
            else:
                env[old] = fx_copy.copy_node(new, old, lambda a: map0(a, old))
            if old in self.sym:
                by_expr.setdefault(self.sym[old], env[old])
            if old.name in self.phases:
                phases[env[old].name] = self.phases[old.name]
            if old is fwd_last:
                for j in self.copies:
                    emit_segment_copy(_FWD, j)
        flush()
        grad_nodes: dict[str, str] = {}
        by_name = {n.name: n for n in self.nodes}
        for name, fqn in self.t.grad_nodes.items():
            old = by_name[name]
            grad_nodes[env[old].name] = fqn
            if self.fqn_in(fqn, self.T):
                for j in self.copies:
                    if old not in envs[j]:
                        raise Unsupported(f"the gradient {name} of {fqn} has no copy")
                    grad_nodes[envs[j][old].name] = self.rename_fqn(fqn, j)
        return _graph_module(self.t.gm, new), roles, phases, param_names, grad_nodes


def _graph_module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that does not generate Python code for its (large) graph until it is called."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
        gm = _LazyGraphModule(root, graph)
    except Exception:  # noqa: BLE001 - older torch: the eager (slower) GraphModule
        gm = fx.GraphModule(root, graph)
    gm.meta.update(root.meta)
    return gm


def expand(traced: Any, prefix: str, template: int, num_layers: int, last: Optional[int] = None) -> Any:
    """The TracedProgram of the ``num_layers`` model, from the trace of layers 0, 1, 2 and ``last`` (N-1 of the
    export; by default ``num_layers - 1``). A depth below the export's (a search's depth probe) keeps the
    last layer's name: the layers are 0 .. num_layers-2 and ``last``, in stack order."""
    from boomfx.training.trace import TracedProgram

    if num_layers < template + 2:
        raise Unsupported(f"cannot synthesise {num_layers} layers from a trace of layers 0..{template} and the last")
    gm, roles, phases, param_names, grad_nodes = _Expander(traced, prefix, template, num_layers, last).build()
    return TracedProgram(gm, roles, phases, dict(traced.symbol_map), param_names, grad_nodes)
