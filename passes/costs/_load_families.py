"""Imports every op-family module once so their ``@register_cost`` rules land in the registry."""
import importlib

FAMILIES = ("matmul", "conv", "attention", "pointwise", "reduction", "norms", "indexing", "views",
            "optimizer", "collectives", "pooling", "grouped_mm", "recurrent", "spectral")
_loaded = False


def ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    for name in FAMILIES:
        try:
            importlib.import_module(f"boomfx.passes.costs.{name}")
        except ModuleNotFoundError as exc:  # a family module not written yet
            if exc.name != f"boomfx.passes.costs.{name}":
                raise
    _loaded = True
