"""A dependency-free progress bar with ETA for long collections, written to stderr.

Quiet unless the stream is a terminal (or ``enabled=True``), so logs and CI output stay clean; a
collection passes ``enabled=False`` to silence it. Redraws at most every ``min_interval_s``.

Example::

    with Progress(total=40, desc="collect") as bar:
        for key in keys:
            ...
            bar.update(note=key.op)

Output looks like ``collect [########------------] 16/40  40% 0:12<0:18 aten.mm.default``.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

BAR_CHARS = 24


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Counts finished items out of ``total`` and estimates the remaining time from the mean rate so far."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        stream: Optional[TextIO] = None,
        enabled: Optional[bool] = None,
        min_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(int(total), 0)
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.done = 0
        self.start_s = clock()
        self._last_draw_s = -float("inf")
        self._width = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def eta_s(self) -> Optional[float]:
        """Seconds left at the mean rate so far; None before the first item finishes."""
        if self.done == 0:
            return None
        elapsed = self.clock() - self.start_s
        return elapsed / self.done * max(self.total - self.done, 0)

    def line(self, note: str = "") -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * BAR_CHARS))
        eta = self.eta_s()
        elapsed = format_duration(self.clock() - self.start_s)
        timing = f"{elapsed}<{format_duration(eta)}" if eta is not None else f"{elapsed}<?"
        bar = "#" * filled + "-" * (BAR_CHARS - filled)
        head = f"{self.desc} " if self.desc else ""
        return f"{head}[{bar}] {self.done}/{self.total} {frac * 100:3.0f}% {timing} {note}".rstrip()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = self.clock()
        if self.enabled and (now - self._last_draw_s >= self.min_interval_s or self.done >= self.total):
            self._draw(self.line(note))
            self._last_draw_s = now

    def _draw(self, text: str) -> None:
        pad = max(self._width - len(text), 0)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
