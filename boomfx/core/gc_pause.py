"""Pause Python's cyclic garbage collector for one short-lived, allocation-heavy job.

Why (benchmarks/speed_llama70b.py): an analysis builds ~1M long-lived objects (fx nodes, fake tensors,
sympy expressions, OpCalls); each automatic collection traverses them, and on an 80-layer Llama
training analysis the collector took about a quarter of the run (15.2 s -> 11.7 s of CPU without it).
Those objects are kept until the end, so there is little cyclic garbage to reclaim: the peak
resident memory grew by ~30 MB (450 -> 480 MB) with the collector off. Reference counting still frees
everything that is not in a cycle.

Example::

    with gc_paused():
        run_analyze(args)
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic cyclic collection within; restore the previous state on exit."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
