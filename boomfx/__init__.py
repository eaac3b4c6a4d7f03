"""boomfx: predict iteration time and GPU memory of a PyTorch model from its torch.export graph.

The public API is loaded lazily, so ``import boomfx`` stays cheap (it does not import torch)::

    import boomfx
    report = boomfx.analyze(model, x, device="a100-80gb", train=True, optimizer="sgd")
    report.time.total_ns, report.memory.fits
    boomfx.Report.from_json(text)
    boomfx.devices.get_device("h100")

``boomfx.analyze`` is the module ``boomfx/analyze.py`` made callable: calling it calls
``boomfx.analyze.analyze``, and ``boomfx.analyze.Analysis`` is still reachable, so the name works
whichever of the two was imported first. ``boomfx.passes.annotate`` works the same way.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "analyze": ("boomfx.analyze", None),
    "Analysis": ("boomfx.analyze", "Analysis"),
    "Report": ("boomfx.report", "Report"),
    "SCHEMA_VERSION": ("boomfx.report", "SCHEMA_VERSION"),
    "devices": ("boomfx.devices", None),
    "get_device": ("boomfx.devices", "get_device"),
}
# Submodules that share their name with the function they define.
_CALLABLE_SUBMODULES = frozenset({"analyze"})

__all__ = ["__version__", *_LAZY]


class _CallableModule(types.ModuleType):
    """A submodule that, called, calls its same-named function (``boomfx.analyze(...)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


class _Package(types.ModuleType):
    """Makes a callable-submodule callable however it gets imported (the import system binds a
    submodule on its package with ``setattr``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        wanted = self.__dict__.get("_CALLABLE_SUBMODULES", ())
        if name in wanted and isinstance(value, types.ModuleType) \
                and value.__name__ == f"{self.__name__}.{name}" and type(value) is types.ModuleType:
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


def make_package_lazy(package_name: str) -> None:
    """Give ``package_name`` (an imported package) callable same-named submodules; see module doc."""
    sys.modules[package_name].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'boomfx' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    if attr is not None:
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


make_package_lazy(__name__)
