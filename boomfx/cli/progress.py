"""Stage progress on stderr: shown on a terminal or with --verbose, silent otherwise (CI logs stay clean).

A stage prints ``[boomfx] NAME...`` and, when it ends, its time on the same line. A message logged
while a stage runs (the loader's "loaded X in 0.29 s") ends that open line first, so the stage's time
is then printed on a line of its own (``[boomfx] NAME: 0.7 s``) instead of after the message.
"""
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
        self._line_open = False     # the current stage's "NAME..." waits for its time on this line

    def stage(self, name: str) -> None:
        self.done()
        self._stage = name
        self._stage_started = time.perf_counter()
        if self.enabled:
            self.stream.write(f"[boomfx] {name}...")
            self.stream.flush()
            self._line_open = True

    def log(self, message: str) -> None:
        if self.enabled:
            opened = "\n" if self._line_open else ""
            indent = "  " if self._stage else ""
            self.stream.write(f"{opened}[boomfx] {indent}{message}\n")
            self.stream.flush()
            self._line_open = False

    def done(self) -> None:
        if self._stage is not None and self.enabled:
            took = f"{time.perf_counter() - self._stage_started:.1f} s"
            self.stream.write(f" {took}\n" if self._line_open else f"[boomfx] {self._stage}: {took}\n")
            self.stream.flush()
        self._stage = None
        self._line_open = False

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started
