"""The progress display: one status line on a terminal, one line per run
of an implementation otherwise (logs, CI)."""
from __future__ import annotations

import shutil
import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.total = total
        self.i = 0
        self.label = ""
        self.t0 = time.monotonic()
        self._shown = False
        self.prefix = ""  # e.g. "run 2/3  " while repeating the scenarios

    def _elapsed(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60}:{s % 60:02d}"

    def start(self, label: str) -> None:
        """A new run (one implementation at one N)."""
        self.i += 1
        self.label = self.prefix + label
        if not self.enabled:
            return
        if self.tty:
            self._line(self.label)
        else:
            print(f"[{self.i}/{self.total} {self._elapsed()}] {self.label}", file=self.stream,
                  flush=True)

    def detail(self, text: str) -> None:
        """What the current run is doing (a terminal only)."""
        if self.tty:
            self._line(f"{self.label}  {text}")

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        self.clear()
        print(text, file=self.stream, flush=True)

    def _line(self, text: str) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        line = f"[{self.i}/{self.total} {self._elapsed()}] {text}"
        self.stream.write("\r" + line[:width].ljust(width))
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self.tty and self._shown:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self.stream.flush()
            self._shown = False
