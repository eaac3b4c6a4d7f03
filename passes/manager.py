"""AnalysisManager: computes each pass's result once per program and target, and caches it.

A pass is a plain function ``pass_fn(program, am) -> FrozenResult``; consumers ask ``am.get(pass_fn)``
for what they need, so the order of passes follows from their requirements (LLVM new PM style).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from boomfx.core.devices import DeviceSpec
from boomfx.passes.costs.registry import CostRegistry, default_registry
from boomfx.core.program import Program

R = TypeVar("R")


class AnalysisManager:
    def __init__(self, program: Program, device: DeviceSpec, registry: Optional[CostRegistry] = None,
                 reuse_blocks: bool = True) -> None:
        self.program = program
        self.device = device
        self.reuse_blocks = reuse_blocks     # depth-free: compute per unique block, reuse for instances
        self.registry = registry or default_registry()
        self._results: dict[Callable[..., Any], Any] = {}

    def get(self, pass_fn: Callable[[Program, "AnalysisManager"], R]) -> R:
        if pass_fn not in self._results:
            self._results[pass_fn] = pass_fn(self.program, self)
        return self._results[pass_fn]
