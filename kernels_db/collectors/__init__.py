"""Microbenchmark families for the model-free sweep: each module supplies ``configs`` and ``make_call``.

A family module (``matmul``, ``pointwise``, ``reduction``, ``conv``, ``attention``, ``generic``) has
exactly two public functions (Habitat's ``index_to_config`` / ``config_to_profiler_args`` split)::

    def configs(dtypes: Sequence[torch.dtype], grid: str = "small") -> list[Config]: ...
    def make_call(config: Config) -> OpCall: ...

``grid`` picks the sweep size: ``"tiny"`` (tests, seconds), ``"small"`` (a CPU, minutes), ``"large"``
(a GPU). The shared driver (``collect.collect_sweep``) keys and measures the calls; this package only
describes them. ``build_call`` derives output specs by running the op on meta tensors, so a family
never writes shape rules by hand.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

import sympy
import torch

from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec, contiguous_strides

FAMILIES: tuple[str, ...] = ("matmul", "pointwise", "reduction", "conv", "attention", "generic")
GRIDS: tuple[str, ...] = ("tiny", "small", "large")
Config = Mapping[str, Any]


def family(name: str) -> ModuleType:
    """The collector module of one family; unknown names raise with the list of known ones."""
    if name not in FAMILIES:
        raise KeyError(f"unknown collector family {name!r} (known: {', '.join(FAMILIES)})")
    return importlib.import_module(f"boomfx.kernels_db.collectors.{name}")


def check_grid(grid: str) -> None:
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")


def spec(shape: Sequence[int], dtype: torch.dtype, stride: Optional[Sequence[int]] = None) -> TensorSpec:
    """A TensorSpec with concrete sympy-Integer sizes (contiguous unless ``stride`` is given)."""
    sizes = tuple(sympy.Integer(s) for s in shape)
    strides = tuple(sympy.Integer(s) for s in stride) if stride is not None else contiguous_strides(sizes)
    return TensorSpec(sizes, strides, dtype)


def transposed(shape: Sequence[int], dtype: torch.dtype) -> TensorSpec:
    """A tensor of ``shape`` stored with its last two dims swapped (what ``.t()``/``.mT`` gives)."""
    *batch, rows, cols = shape
    stride = list(contiguous_strides(tuple(sympy.Integer(s) for s in (*batch, cols, rows))))
    stride[-1], stride[-2] = stride[-2], stride[-1]
    return spec(shape, dtype, [int(s) for s in stride])


def _to_meta(value: Any) -> Any:
    if isinstance(value, TensorSpec):
        return torch.empty_strided(
            [int(s) for s in value.shape], [int(s) for s in value.stride], dtype=value.dtype, device="meta"
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, sympy.Integer):
        return int(value)
    return value


def _to_spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec.from_tensor(value)
    if isinstance(value, (list, tuple)):
        return tuple(_to_spec(v) for v in value)
    return value


def build_call(
    op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]] = None
) -> OpCall:
    """An OpCall with outputs found by running ``op`` on meta tensors of the given specs."""
    kwargs = dict(kwargs or {})
    out = op(*_to_meta(list(args)), **{k: _to_meta(v) for k, v in kwargs.items()})
    outputs = _to_spec(out) if isinstance(out, (list, tuple)) else (_to_spec(out),)
    return OpCall.build(op, tuple(args), kwargs, tuple(outputs))


def log_sizes(lo: int, hi: int, per_octave: int = 1) -> list[int]:
    """Log-spaced sizes from ``lo`` to ``hi`` inclusive, ``per_octave`` points per doubling, rounded to ints.

    With ``per_octave=2`` the grid holds both powers of two and the 1.5x points between them, so
    lookups see aligned and less-aligned sizes (tile quantization shows up in the data).
    """
    out: set[int] = set()
    value = float(lo)
    while value <= hi * 1.0001:
        out.add(int(round(value)))
        value *= 2 ** (1 / per_octave)
    return sorted(out)
