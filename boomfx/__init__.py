"""boomfx: predict iteration time and GPU memory of a PyTorch model from its torch.export graph.

The public API is loaded lazily, so ``import boomfx`` stays cheap (it does not import torch)::

    import boomfx
    report = boomfx.analyze(model, x, device="a100-80gb", train=True, optimizer="sgd")
    report.time.total_ns, report.memory.fits
    boomfx.Report.from_json(text)
    boomfx.get_device("h100")

Exported names (each a plain object; the module that defines it is given beside it):
``analyze`` (function, boomfx/distributed/api.py: boomfx/analysis/analysis.py's, plus ``parallel=``), ``Analysis``, ``AnalyzeOptions``,
``capture`` (function, boomfx/frontend/capture.py), ``Report`` and ``SCHEMA_VERSION``
(boomfx/report/model.py), ``annotate`` (the FX pass, boomfx/integrations/annotate.py),
``search_plans`` (``--search``, boomfx/distributed/plan_search.py), ``get_device`` and the ``devices`` registry module (boomfx/core/devices.py), ``validate`` (predicted vs
measured on this machine, boomfx/validate/run.py; the package is callable).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "analyze": ("boomfx.distributed.api", "analyze"),
    "search_plans": ("boomfx.distributed.plan_search", "search_plans"),   # --search
    "Analysis": ("boomfx.analysis.analysis", "Analysis"),
    "AnalyzeOptions": ("boomfx.analysis.analysis", "AnalyzeOptions"),
    "capture": ("boomfx.frontend.capture", "capture"),
    "annotate": ("boomfx.integrations.annotate", "annotate"),
    "Report": ("boomfx.report.model", "Report"),
    "SCHEMA_VERSION": ("boomfx.report.model", "SCHEMA_VERSION"),
    "devices": ("boomfx.core.devices", None),
    "get_device": ("boomfx.core.devices", "get_device"),
    "validate": ("boomfx.validate", None),     # callable: boomfx.validate(FILE.pt2, ...) (boomfx/validate/run.py)
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'boomfx' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
