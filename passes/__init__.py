"""Analysis passes over a captured program: shapes/costs, blocks, kernels, liveness.

``boomfx.passes.annotate(gm_or_program, *example_inputs, device=...)`` writes each node's prediction
into ``node.meta["boomfx"]`` (see ``passes/annotate.py``). It is loaded lazily, and like
``boomfx.analyze`` it is the submodule made callable, so ``boomfx.passes.annotate.META_KEY`` works too.
"""
from __future__ import annotations

import importlib
from typing import Any

from boomfx import make_package_lazy

_CALLABLE_SUBMODULES = frozenset({"annotate"})
_LAZY = {"annotate": "boomfx.passes.annotate"}

__all__ = ["annotate"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'boomfx.passes' has no attribute {name!r}")
    return importlib.import_module(_LAZY[name])


make_package_lazy(__name__)
