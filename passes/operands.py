"""Which program values a kernel call reads and writes, by name, and whose storage each one is.

Why: a real step hands each kernel the tensors its earlier kernels left: AdamW's per-parameter loop runs
ten small ops on one parameter's tensors in a row, each reading what the op before it just touched;
a forward op reads the activation its predecessor just wrote. The in-step rotation
(``kernels_db/in_step.py``) times every call where it stands in the step, and with these names it
passes each call those same tensors rather than synthetic ones of its own (which the rest of the step
has long evicted from the caches by the time the call runs).

``Operand.value`` is the fx node whose value the argument is; ``Operand.storage`` the node whose output
owns that storage (views and in-place writes followed back through the schema's alias annotations,
``passes/aliasing.py``), so a view of a value built or produced earlier can be made over its storage.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

from boomfx.passes.aliasing import output_aliases
from boomfx.passes.costs.registry import OpCall


@dataclass(frozen=True)
class Operand:
    """One tensor argument: the value passed (an fx node's name) and the value owning its storage."""

    value: str
    storage: str


@dataclass(frozen=True)
class Operands:
    """A call's tensor arguments in its kernel key's order (``kernels_db/keys.py``: the op's schema order,
    lists flattened) and the value each of its outputs is (None: an output nothing reads by name; an
    in-place write's output has its argument's storage)."""

    inputs: tuple[Optional[Operand], ...]
    outputs: tuple[Optional[Operand], ...]


class _Tag:
    """Stands for a tensor argument while ``OpCall.build`` puts the arguments in schema order."""

    __slots__ = ("node",)

    def __init__(self, node: torch.fx.Node) -> None:
        self.node = node


def _tagged(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return _Tag(arg) if isinstance(arg.meta.get("val"), torch.Tensor) else None
    if isinstance(arg, (list, tuple)):
        return [_tagged(a) for a in arg]
    return None


def _tags(value: Any) -> list[_Tag]:
    if isinstance(value, _Tag):
        return [value]
    if isinstance(value, list):
        return [t for v in value for t in _tags(v)]
    return []


class StorageRoots:
    """The node owning each value's storage, memoised over one graph."""

    def __init__(self) -> None:
        self._roots: dict[torch.fx.Node, str] = {}

    def __call__(self, node: torch.fx.Node) -> str:
        chain = []
        root: Optional[str] = None
        while root is None:
            known = self._roots.get(node)
            if known is not None:
                root = known
                break
            chain.append(node)
            source = self._aliased(node)
            if source is None:
                root = node.name
            else:
                node = source
        for n in chain:
            self._roots[n] = root
        return root

    @staticmethod
    def _aliased(node: torch.fx.Node) -> Optional[torch.fx.Node]:
        """The node whose storage ``node``'s value shares, or None for a fresh storage."""
        if node.op != "call_function":
            return None
        if node.target is operator.getitem:   # output i of a multi-output call: fresh unless that output aliases
            src, index = node.args[0], node.args[1]
            if not isinstance(src, torch.fx.Node) or not isinstance(index, int):
                return None
            aliases = output_aliases(src) if isinstance(src.meta.get("val"), (list, tuple)) else [(src, False)]
            found = aliases[index] if index < len(aliases) else None
            return found[0] if found is not None else None
        aliases = output_aliases(node)
        return aliases[0][0] if len(aliases) == 1 and aliases[0] is not None else None


def operands_of(node: torch.fx.Node, roots: StorageRoots) -> Operands:
    """The ``Operands`` of a kernel node: an aten-style OpOverload call, or a compiled program's fused group
    (``passes/fused_op.FusedKernel``: its tensor inputs are its first arguments, in its OpCall's order)."""
    if getattr(node.target, "boomfx_fused", False):
        tensors = node.args[:node.target.n_tensor_inputs]
        inputs = tuple(Operand(a.name, roots(a)) if isinstance(a, torch.fx.Node) else None for a in tensors)
    else:
        call = OpCall.build(node.target, tuple(_tagged(a) for a in node.args),
                            {k: _tagged(v) for k, v in node.kwargs.items()})
        inputs = tuple(Operand(t.node.name, roots(t.node)) for value in call.args.values() for t in _tags(value))
    val = node.meta.get("val")
    if not isinstance(val, (list, tuple)):
        return Operands(inputs, (Operand(node.name, roots(node)),))
    by_index = {u.args[1]: u for u in node.users if u.target is operator.getitem and isinstance(u.args[1], int)}
    return Operands(inputs, tuple(Operand(by_index[i].name, roots(by_index[i])) if i in by_index else None
                                  for i in range(len(val))))
