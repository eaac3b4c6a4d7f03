"""The one registry of per-op cost formulas, and the values they return.

A formula is a small function registered by op object (never by string)::

    @register_cost(aten.mm.default)
    def mm_cost(call: OpCall) -> Cost:
        a, b = call.arg("self"), call.arg("mat2")
        ...

It receives an ``OpCall``: the op, its arguments normalised by schema name, with every tensor
replaced by a ``TensorSpec`` (sympy sizes) and every SymInt by a sympy expression, plus the output
specs. It returns a frozen ``Cost``. Ops with no formula are priced by ``fallback_cost`` (bytes of
inputs and outputs) and flagged unmodelled: an unknown op is never free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import sympy
import torch

from boomfx.passes.foreign_ops import library_op_name
from boomfx.passes.specs import SymExpr, TensorSpec

OpKey = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]


def _expr(value: Any) -> SymExpr:
    return sympy.sympify(value)


@dataclass(frozen=True)
class Cost:
    """Work of one kernel: FLOPs and bytes read/written, sympy expressions in the program's symbols."""

    flops: SymExpr = sympy.Integer(0)
    bytes_read: SymExpr = sympy.Integer(0)
    bytes_written: SymExpr = sympy.Integer(0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", _expr(self.flops))
        object.__setattr__(self, "bytes_read", _expr(self.bytes_read))
        object.__setattr__(self, "bytes_written", _expr(self.bytes_written))

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes_read + other.bytes_read,
                    self.bytes_written + other.bytes_written)

    def scale(self, factor: Any) -> "Cost":
        return Cost(self.flops * factor, self.bytes_read * factor, self.bytes_written * factor)

    @property
    def bytes_moved(self) -> SymExpr:
        return self.bytes_read + self.bytes_written

    def subs(self, bindings: Mapping[Any, Any]) -> "Cost":
        return Cost(self.flops.subs(bindings), self.bytes_read.subs(bindings), self.bytes_written.subs(bindings))

    def evaluate(self, bindings: Optional[Mapping[Any, Any]] = None) -> tuple[int, int, int]:
        """(flops, bytes_read, bytes_written) as Python ints; raises if a symbol stays unbound."""
        c = self.subs(bindings or {})
        out = []
        for v in (c.flops, c.bytes_read, c.bytes_written):
            if v.free_symbols:
                raise ValueError(f"unbound symbols {sorted(map(str, v.free_symbols))} in cost")
            out.append(int(v))
        return out[0], out[1], out[2]


ZERO = Cost()


@dataclass(frozen=True)
class OpCall:
    """One call of an aten op, with tensors as ``TensorSpec`` and sizes as sympy expressions.

    ``args`` holds the arguments by schema name (defaults filled in); ``outputs`` the output specs
    in schema order; ``context`` carries target-dependent choices (e.g. ``sdpa_backend``).
    """

    op: torch._ops.OpOverload
    args: Mapping[str, Any]
    outputs: tuple[Any, ...] = ()
    context: Mapping[str, Any] = field(default_factory=dict)

    def arg(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default)

    def tensor_args(self) -> list[TensorSpec]:
        """Every TensorSpec among the arguments, lists included, in schema order."""
        found: list[TensorSpec] = []
        for value in self.args.values():
            found.extend(_flatten_specs(value))
        return found

    def tensor_outputs(self) -> list[TensorSpec]:
        found: list[TensorSpec] = []
        for value in self.outputs:
            found.extend(_flatten_specs(value))
        return found

    @staticmethod
    def build(op: torch._ops.OpOverload, args: tuple, kwargs: Mapping[str, Any], outputs: tuple = (),
              context: Optional[Mapping[str, Any]] = None) -> "OpCall":
        """Normalise positional/keyword arguments by the op's schema (defaults filled in)."""
        named: dict[str, Any] = {}
        schema = op._schema
        for i, a in enumerate(schema.arguments):
            if i < len(args) and not a.kwarg_only:
                named[a.name] = args[i]
            elif a.name in kwargs:
                named[a.name] = kwargs[a.name]
            elif a.has_default_value():
                named[a.name] = a.default_value
            else:
                named[a.name] = None
        return OpCall(op, named, tuple(outputs), dict(context or {}))


def _flatten_specs(value: Any) -> list[TensorSpec]:
    if isinstance(value, TensorSpec):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[TensorSpec] = []
        for v in value:
            out.extend(_flatten_specs(v))
        return out
    return []


Formula = Callable[[OpCall], Cost]


class DuplicateRuleError(KeyError):
    pass


class CostRegistry:
    """Maps aten ops (overloads or whole packets) to cost formulas. Duplicates raise.

    Ops of other libraries (``transformers::grouped_mm_fallback``) may not exist in the process when
    the rules load, or exist only as a stand-in (``foreign_ops``): those are registered by their
    qualified name with ``register_library`` and found by the name the op has in the file.
    """

    def __init__(self, rules: Optional[Mapping[OpKey, Formula]] = None,
                 library_rules: Optional[Mapping[str, Formula]] = None) -> None:
        self._rules: dict[OpKey, Formula] = dict(rules or {})
        self._library_rules: dict[str, Formula] = dict(library_rules or {})

    def register_library(self, *qualified_names: str) -> Callable[[Formula], Formula]:
        """Register a formula for library ops by ``"namespace::op"`` (every overload)."""
        def decorator(fn: Formula) -> Formula:
            for name in qualified_names:
                if name in self._library_rules:
                    raise DuplicateRuleError(f"cost rule for {name} registered twice")
                self._library_rules[name] = fn
            return fn
        return decorator

    def register(self, *targets: OpKey) -> Callable[[Formula], Formula]:
        def decorator(fn: Formula) -> Formula:
            for target in targets:
                if target in self._rules:
                    raise DuplicateRuleError(f"cost rule for {target} registered twice")
                self._rules[target] = fn
            return fn
        return decorator

    def lookup(self, op: torch._ops.OpOverload) -> Optional[Formula]:
        rule = self._rules.get(op)
        if rule is None:
            packet = getattr(op, "overloadpacket", None)
            if packet is not None:
                rule = self._rules.get(packet)
        if rule is None and self._library_rules and getattr(op, "namespace", "aten") != "aten":
            rule = self._library_rules.get(library_op_name(op))
        return rule

    def extended(self, custom_rules: Mapping[OpKey, Formula]) -> "CostRegistry":
        """A copy with extra (or overriding) rules, for tests and users; the default is not mutated."""
        merged = dict(self._rules)
        merged.update(custom_rules)
        return CostRegistry(merged, self._library_rules)

    def __contains__(self, op: OpKey) -> bool:
        return self.lookup(op) is not None if isinstance(op, torch._ops.OpOverload) else op in self._rules

    def ops(self) -> list[OpKey]:
        return list(self._rules)


DEFAULT_REGISTRY = CostRegistry()
register_cost = DEFAULT_REGISTRY.register
register_library_cost = DEFAULT_REGISTRY.register_library


@dataclass(frozen=True)
class PricedCall:
    """A formula's answer for one call, with whether a real formula (not the fallback) produced it."""

    cost: Cost
    modelled: bool
    reason: str = ""


def fallback_cost(call: OpCall) -> Cost:
    """Bytes of every tensor argument read once and every output written once; no FLOPs assumed."""
    read = sum((t.nbytes for t in call.tensor_args()), sympy.Integer(0))
    written = sum((t.nbytes for t in call.tensor_outputs()), sympy.Integer(0))
    return Cost(0, read, written)


def price_call(call: OpCall, registry: Optional[CostRegistry] = None) -> PricedCall:
    """Price one call by its formula, or by bytes moved (flagged unmodelled) when there is none."""
    reg = registry or default_registry()
    rule = reg.lookup(call.op)
    if rule is None:
        return PricedCall(fallback_cost(call), False, f"no cost formula for {call.op}")
    return PricedCall(rule(call), True)


def default_registry() -> CostRegistry:
    """The registry with every built-in family module imported (import registers their rules)."""
    from boomfx.passes.costs import _load_families  # noqa: F401  (import side effect: registration)
    _load_families.ensure_loaded()
    return DEFAULT_REGISTRY


def iter_rules(registry: CostRegistry) -> Iterable[tuple[OpKey, Formula]]:
    return registry._rules.items()
