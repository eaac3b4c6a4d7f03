"""Sizes read from the graph's inputs instead of from computed tensors (a compiled-program rewrite).

Why: ``aten.sym_size.int(t, d)`` of a computed tensor ``t`` is only a function of the input sizes; a
compiled graph knows it symbolically and never waits for ``t``'s kernel. In the fx graph, though, the
node reads ``t``, and when a fusion group both produces ``t`` and consumes a value computed from that
size (Mistral's mask: ``cat`` -> ``sym_size(cat, 1) - 1`` -> ``slice(cat, ..., end)`` -> ``sub`` in the
same group), the group depends on itself. :func:`sizes_from_inputs` rebuilds every such size from
``sym_size`` nodes of the placeholders (plus integer ``+``/``*``), so only real data dependencies remain.

Known limitations: an expression with operations other than integer sums and products, or a symbol
no placeholder carries as a whole dimension, is left reading its tensor.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx

from boomfx.core.program import Program

aten = torch.ops.aten


def _symbol_sources(graph: torch.fx.Graph) -> dict[sympy.Symbol, tuple[torch.fx.Node, int]]:
    """Each size symbol -> the first placeholder (and dim) whose size is exactly that symbol."""
    out: dict[sympy.Symbol, tuple[torch.fx.Node, int]] = {}
    for node in graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for dim, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                out.setdefault(size.node.expr, (node, dim))
    return out


class _Builder:
    """Emits fx nodes computing a sympy expression of size symbols (sums and products only)."""

    def __init__(self, graph: torch.fx.Graph, sources: dict[sympy.Symbol, tuple[torch.fx.Node, int]]) -> None:
        self.graph, self.sources = graph, sources
        self.made: dict[sympy.Symbol, torch.fx.Node] = {}

    def build(self, expr: sympy.Expr) -> Optional[tuple[Any, Any]]:
        """(fx argument, its value) for ``expr``, or None when it cannot be rebuilt."""
        if expr.is_Integer:
            return int(expr), int(expr)
        if isinstance(expr, sympy.Symbol):
            if expr not in self.sources:
                return None
            if expr not in self.made:
                placeholder, dim = self.sources[expr]
                node = self.graph.call_function(aten.sym_size.int, (placeholder, dim))
                node.meta["val"] = placeholder.meta["val"].shape[dim]
                self.made[expr] = node
            return self.made[expr], self.made[expr].meta["val"]
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            parts = [self.build(a) for a in expr.args]
            if any(p is None for p in parts):
                return None
            op = operator.add if isinstance(expr, sympy.Add) else operator.mul
            acc, acc_val = parts[0]
            for arg, val in parts[1:]:
                acc_val = op(acc_val, val)
                acc = self.graph.call_function(op, (acc, arg))
                acc.meta["val"] = acc_val
            return acc, acc_val
        return None


def sizes_from_inputs(program: Program) -> Program:
    """``program`` with every ``sym_size`` of a computed tensor rebuilt from placeholder sizes."""
    graph, _ = program.copied_graph()
    sources = _symbol_sources(graph)
    targets = [n for n in graph.nodes
               if n.op == "call_function" and n.target is aten.sym_size.int
               and isinstance(n.args[0], torch.fx.Node) and n.args[0].op != "placeholder"
               and isinstance(n.meta.get("val"), torch.SymInt)]
    first_op = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if not targets or not sources or first_op is None:
        return program
    changed = False
    builder = _Builder(graph, sources)
    for node in targets:
        with graph.inserting_before(first_op):   # in call order, operands before their users
            built = builder.build(sympy.expand(node.meta["val"].node.expr))
        if built is None:
            continue
        node.replace_all_uses_with(built[0]) if isinstance(built[0], torch.fx.Node) else _replace_with_int(node, built[0])
        graph.erase_node(node)
        changed = True
    return program.rewritten(graph) if changed else program


def _replace_with_int(node: torch.fx.Node, value: int) -> None:
    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
