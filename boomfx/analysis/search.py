"""Largest value of a symbol (batch, seq) that fits on the device, found by bisection on the
memory-only evaluation and checked exactly at the boundary (value fits, value + 1 does not)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import sympy

from boomfx.analysis.analysis import Analysis
from boomfx.core.errors import DimError
from boomfx.core.program import SymbolInfo

_UNBOUNDED_CAP = 1 << 24


@dataclass(frozen=True)
class SearchResult:
    symbol: str
    largest_fitting: Optional[int]       # None: even the smallest value does not fit
    first_failing: Optional[int]         # None: the largest allowed value fits
    evaluations: int


def largest_fitting(analysis: Analysis, info: SymbolInfo, fixed: Mapping[sympy.Symbol, int]) -> SearchResult:
    count = 0

    def fits(value: int) -> bool:
        nonlocal count
        count += 1
        bindings = dict(fixed)
        bindings[info.symbol] = value
        return analysis.evaluate(bindings, memory_only=True).report.memory.fits

    lo = max(info.min_value, 1)
    if not fits(lo):
        return SearchResult(info.name, None, lo, count)
    hi_limit = info.max_value if info.max_value is not None else _UNBOUNDED_CAP
    # exponential probe for a failing value, then bisection between the last fit and it
    good, probe = lo, lo
    bad: Optional[int] = None
    while bad is None:
        probe = min(probe * 2, hi_limit)
        if fits(probe):
            good = probe
            if probe == hi_limit:
                return SearchResult(info.name, good, None, count)
        else:
            bad = probe
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return SearchResult(info.name, good, bad, count)


def symbol_for(analysis: Analysis, role: str) -> SymbolInfo:
    try:
        return analysis.program.symbol(role)
    except KeyError:
        raise DimError(f"--max-{role}: no symbol of the program is identified as {role}") from None
