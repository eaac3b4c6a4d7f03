"""Which database file an analysis reads: the ``--db`` value resolved against the device's default path."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from boomfx.core.devices import DeviceSpec
from boomfx.core.errors import OptionError

AUTO_DB = "auto"
NO_DB = "none"


def resolve_db_path(db: Optional[str], device: DeviceSpec) -> Optional[Path]:
    """``None``/"none": no database; "auto": the user-cache database of ``device`` if one exists;
    "default": that path (it must exist); anything else is a path that must exist."""
    from boomfx.kernels_db.store import default_db_path
    if db is None or db == NO_DB:
        return None
    if db == AUTO_DB:
        path = default_db_path(device.name)
        return path if path.exists() else None
    path = default_db_path(device.name) if db == "default" else Path(db)
    if not path.exists():
        raise OptionError(f"no kernel database at {path} (collect one with `boomfx kernels collect`)")
    return path
