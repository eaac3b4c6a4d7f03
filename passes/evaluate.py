"""Evaluate symbolic sizes at one binding of the program's symbols, caching by expression.

Shapes repeat across layers, so the number of distinct expressions is small even in huge graphs;
``xreplace`` on a cached expression is far cheaper than ``subs`` on every node.
"""
from __future__ import annotations

from typing import Any, Mapping

import sympy


class UnboundSymbolError(ValueError):
    pass


class Evaluator:
    def __init__(self, bindings: Mapping[sympy.Symbol, int],
                 symbol_map: Mapping[sympy.Symbol, sympy.Symbol] | None = None,
                 data_dependent_value: int | None = None) -> None:
        self.bindings: dict[sympy.Basic, sympy.Integer] = {s: sympy.Integer(v) for s, v in bindings.items()}
        # symbols of a re-traced graph that stand for exported symbols
        for traced, exported in (symbol_map or {}).items():
            if exported in self.bindings:
                self.bindings[traced] = self.bindings[exported]
        self._cache: dict[Any, int] = {}
        self.bound_specs: dict[Any, Any] = {}   # TensorSpec -> the same spec at these bindings (opcall.bind_value)
        # Value for the unbacked symbols of scalar arguments (AdamW's step count from ``step.item()``):
        # they change no kernel's time or memory, but a symbolic scalar cannot be keyed or measured.
        # None leaves such scalars symbolic.
        self.data_dependent_value = data_dependent_value
        self._scalar_cache: dict[Any, Any] = {}

    def data_dependent(self, expr: sympy.Basic) -> sympy.Basic:
        """``expr`` (a scalar with unbacked symbols) at ``data_dependent_value``, or unchanged."""
        if self.data_dependent_value is None:
            return expr
        hit = self._scalar_cache.get(expr)   # AdamW repeats a few expressions per parameter
        if hit is None:
            fixed = sympy.Integer(self.data_dependent_value)
            out = sympy.sympify(expr).xreplace(self.bindings).xreplace({s: fixed for s in expr.free_symbols})
            hit = sympy.Integer(int(out)) if out.is_integer else sympy.Float(float(out))
            self._scalar_cache[expr] = hit
        return hit

    def __call__(self, expr: Any) -> int:
        if isinstance(expr, int):
            return expr
        hit = self._cache.get(expr)
        if hit is not None:
            return hit
        value = sympy.sympify(expr).xreplace(self.bindings)
        if value.free_symbols:
            raise UnboundSymbolError(f"unbound symbols {sorted(map(str, value.free_symbols))} in {expr}")
        result = int(value)
        self._cache[expr] = result
        return result

    def number(self, expr: Any) -> float:
        """Like ``__call__`` for expressions that may be fractional (FLOPs of causal attention, means)."""
        if isinstance(expr, (int, float)):
            return float(expr)
        value = sympy.sympify(expr).xreplace(self.bindings)
        if value.free_symbols:
            raise UnboundSymbolError(f"unbound symbols {sorted(map(str, value.free_symbols))} in {expr}")
        return float(value)
