"""LLM serving predictions: a serving engine's KV-cache plan, step times and scheduler, from an export.

``serve(...)`` (``boomfx/serving/serve.py``) is the entry point; ``boomfx serve FILE.pt2`` its CLI.
Loaded lazily so that ``import boomfx.serving`` stays light.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "serve":
        from boomfx.serving.serve import serve
        return serve
    raise AttributeError(name)
