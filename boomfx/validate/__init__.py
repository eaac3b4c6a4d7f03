"""``boomfx validate``: predicted vs measured on this machine (boomfx/validate/run.py)."""
from __future__ import annotations

from boomfx.validate.result import OpComparison, ValidationResult
from boomfx.validate.run import validate

__all__ = ["validate", "ValidationResult", "OpComparison"]
