"""Give back what torch's process-wide caches keep of a captured program once the program is gone.

Why: a long-lived process (the pytest plugin over a large suite, the torch.compile backend inside a training
job, a sweep script) analyses many programs, and torch keeps two things of each forever:

- ``ShapeEnv`` methods memoised with class-level ``functools.lru_cache`` (``get_implications``,
  ``constrain_symbol_range``, ... unbounded): the cache keys hold ``self``, so every ShapeEnv a load or a
  training trace created stays alive, with its fake-tensor dispatch cache (fake tensors, sym nodes);
- ``torch.fx.graph_module._loader.eval_cache`` and ``linecache``: the generated source of every GraphModule
  ever compiled, under a unique key (kept so tracebacks can show it).

Measured before this module (``benchmarks/memory_growth.py``, MLP ``--train`` analyses in one process):
~0.23 MiB per analysis, 12 ShapeEnvs alive after 6 analyses. ``release_when_collected(gm, keys)`` registers
a finaliser on the program's graph module: when it is collected, the FX sources registered while it was
captured are dropped and the ShapeEnv method caches are cleared (they are pure memo caches: a live ShapeEnv
only recomputes an entry).
"""
from __future__ import annotations

import linecache
import weakref
from typing import Any, Iterable

import torch


def fx_source_keys() -> set[str]:
    """The keys of the generated sources torch.fx holds now."""
    loader = getattr(torch.fx.graph_module, "_loader", None)
    return set(getattr(loader, "eval_cache", {}) or ())


def _shape_env_caches() -> list[Any]:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    return [v for v in vars(ShapeEnv).values() if hasattr(v, "cache_clear")]


def release(source_keys: Iterable[str]) -> None:
    """Drop these FX sources and clear the ShapeEnv method caches (which pin every ShapeEnv ever made)."""
    loader = getattr(torch.fx.graph_module, "_loader", None)
    cache = getattr(loader, "eval_cache", None)
    for key in source_keys:
        if isinstance(cache, dict):
            cache.pop(key, None)
        linecache.cache.pop(key, None)
    for cached in _shape_env_caches():
        cached.cache_clear()


def release_when_collected(owner: Any, source_keys: Iterable[str]) -> None:
    """``release(source_keys)`` once ``owner`` (a captured program's GraphModule) is garbage."""
    weakref.finalize(owner, release, tuple(source_keys))


__all__ = ["fx_source_keys", "release", "release_when_collected"]
