"""``boomfx validate``: predicted vs measured on this machine (boomfx/validate/run.py).

``boomfx.validate(...)`` calls :func:`boomfx.validate.run.validate`: this package is callable, so the
name works whether the function or the package was reached first (as the package is imported by
``import boomfx.validate`` and by the CLI).
"""
from __future__ import annotations

import sys
import types
from typing import Any

from boomfx.validate.result import OpComparison, ValidationResult
from boomfx.validate.run import validate

__all__ = ["validate", "ValidationResult", "OpComparison"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> ValidationResult:
        return validate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
