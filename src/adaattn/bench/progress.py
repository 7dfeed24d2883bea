"""A progress bar on stderr: redrawn in place on a terminal, one line per step in a log."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`step(text)` starts step i of `total`; `note(text)` updates the current step's detail."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, width: int = 24):
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.width = width
        self.done = 0
        self.text = ""
        self.t0 = time.perf_counter()
        self._last_len = 0

    def step(self, text: str) -> None:
        """Begin the next step; the bar shows the steps finished before it."""
        self.text = text
        if not self.enabled:
            return
        if self.tty:
            self._draw(text)
        else:
            elapsed = time.perf_counter() - self.t0
            print(f"bench [{self.done + 1}/{self.total}] {text} ({elapsed:.0f} s)", file=self.stream, flush=True)
        self.done += 1

    def note(self, detail: str) -> None:
        if self.tty:
            self._draw(f"{self.text}: {detail}")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self.stream.flush()

    def _draw(self, text: str) -> None:
        filled = int(self.width * self.done / self.total)
        elapsed = time.perf_counter() - self.t0
        line = f"bench [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:4.0f}s {text}"
        line = line[:120]
        pad = max(0, self._last_len - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._last_len = len(line)
