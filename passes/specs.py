"""Symbolic tensor descriptions that every pass and cost formula works with.

Passes never touch real or fake tensors directly: the capture stage turns each fx value into a
``TensorSpec`` whose sizes are sympy expressions in the program's symbols (``s0``, ``s1``...), so
formulas stay symbolic until the driver binds concrete sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import sympy
import torch

SymExpr = sympy.Expr


def to_sympy(value: Any) -> Any:
    """A SymInt/SymFloat/int becomes a sympy expression (ints stay sympy Integers); other values pass through."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return sympy.Integer(value)
    return value


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element (bool is 1 byte in PyTorch storages)."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class TensorSpec:
    """Shape, strides and dtype of one tensor value, sizes as sympy expressions.

    ``storage_numel`` is the number of elements of the underlying storage that this view can reach;
    the liveness pass uses storages (not views) so aliases are counted once.
    """

    shape: tuple[SymExpr, ...]
    stride: tuple[SymExpr, ...]
    dtype: torch.dtype
    storage_offset: SymExpr = sympy.Integer(0)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "TensorSpec":
        """Build from a fake/meta tensor; symbolic sizes become sympy expressions."""
        shape = tuple(to_sympy(s) for s in t.shape)
        try:
            stride = tuple(to_sympy(s) for s in t.stride())
            offset = to_sympy(t.storage_offset())
        except (RuntimeError, NotImplementedError):  # sparse / nested layouts have no strides
            stride = contiguous_strides(shape)
            offset = sympy.Integer(0)
        return TensorSpec(shape, stride, t.dtype, offset)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> SymExpr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> SymExpr:
        """Bytes of the logical tensor (what a kernel reading it whole moves)."""
        return self.numel * self.itemsize

    def subs(self, bindings: Mapping[sympy.Symbol, int]) -> "TensorSpec":
        return TensorSpec(
            tuple(sympy.sympify(s).subs(bindings) for s in self.shape),
            tuple(sympy.sympify(s).subs(bindings) for s in self.stride),
            self.dtype,
            sympy.sympify(self.storage_offset).subs(bindings),
        )


def contiguous_strides(shape: tuple[SymExpr, ...]) -> tuple[SymExpr, ...]:
    strides: list[SymExpr] = []
    acc: SymExpr = sympy.Integer(1)
    for size in reversed(shape):
        strides.append(acc)
        acc = acc * size
    return tuple(reversed(strides))


def concrete_int(value: Any) -> int:
    """A bound size as an int; a size with symbols left raises ValueError (bind sizes before asking)."""
    expr = sympy.sympify(value)
    if expr.free_symbols:
        raise ValueError(f"unbound symbols {sorted(map(str, expr.free_symbols))}: bind sizes first")
    return int(expr)


def concrete_shape(spec: "TensorSpec") -> tuple[int, ...]:
    """The bound shape of ``spec`` as ints (see ``concrete_int``)."""
    return tuple(concrete_int(s) for s in spec.shape)
