"""Stage progress on stderr: shown on a terminal or with --verbose, silent otherwise (CI logs stay clean)."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class StageProgress:
    def __init__(self, enabled: Optional[bool] = None, stream: Optional[TextIO] = None) -> None:
        self.stream = stream if stream is not None else sys.stderr   # looked up now: tests swap sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.started = time.perf_counter()
        self._stage: Optional[str] = None
        self._stage_started = self.started

    def stage(self, name: str) -> None:
        self.done()
        self._stage = name
        self._stage_started = time.perf_counter()
        if self.enabled:
            self.stream.write(f"[boomfx] {name}...")
            self.stream.flush()

    def log(self, message: str) -> None:
        if self.enabled:
            self.stream.write(f"\n[boomfx]   {message}" if self._stage else f"[boomfx] {message}\n")
            self.stream.flush()

    def done(self) -> None:
        if self._stage is not None and self.enabled:
            self.stream.write(f" {time.perf_counter() - self._stage_started:.1f}s\n")
            self.stream.flush()
        self._stage = None

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started
