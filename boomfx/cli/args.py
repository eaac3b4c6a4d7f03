"""Values of the command line's repeatable options (``--dim NAME=VALUE``, ``--sweep NAME=V1,V2``), shared by
``boomfx analyze`` and ``boomfx kernels collect``."""
from __future__ import annotations

from boomfx.core.errors import BoomfxError


def parse_dim(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise BoomfxError(f"--dim expects NAME=VALUE, got '{text}'")
    try:
        return name.strip(), int(value)
    except ValueError:
        raise BoomfxError(f"--dim {name}: '{value}' is not an integer") from None


def parse_sweep(text: str) -> tuple[str, list[int]]:
    name, sep, values = text.partition("=")
    try:
        parsed = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        parsed = []
    if not sep or not name or not parsed:
        raise BoomfxError(f"--sweep expects NAME=V1,V2,..., got '{text}'")
    return name.strip(), parsed
