"""Progress bars for long work (calibration, proposal, training) that degrade to plain lines.

``Progress(total, label, enabled=...)``: on a terminal (``enabled``) one line is redrawn in place,
``label [#####-----] i/total note  elapsed``; lines written with ``write`` appear above it. Without a
terminal nothing is redrawn: ``update`` prints ``label: note (i/total)`` as a plain line when
``plain`` is set (and nothing otherwise), and ``write`` prints its line as is, so a log file or a pipe
gets readable lines and no control characters. No dependency beyond the standard library.
"""
from __future__ import annotations

import shutil
import sys
import time
from typing import Optional, TextIO


def stdout_is_terminal(stream: Optional[TextIO] = None) -> bool:
    stream = stream or sys.stdout
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def resolve_mode(mode: str, stream: Optional[TextIO] = None) -> bool:
    """``auto`` | ``on`` | ``off`` -> whether to draw bars (``auto``: only on a terminal)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"progress mode {mode!r}: allowed are auto, on, off")
    return mode == "on" or (mode == "auto" and stdout_is_terminal(stream))


class Progress:
    """One bar; ``close()`` clears it."""

    def __init__(self, total: int, label: str, *, enabled: bool = False, plain: bool = False,
                 stream: Optional[TextIO] = None, width: int = 24) -> None:
        self.total, self.label, self.enabled, self.plain = max(int(total), 1), label, enabled, plain
        self.stream = stream or sys.stdout
        self.width, self.done, self.note = width, 0, ""
        self.t0 = time.perf_counter()
        self._drawn = False

    def _line(self) -> str:
        filled = min(self.width, round(self.width * self.done / self.total))
        elapsed = time.perf_counter() - self.t0
        text = (f"{self.label} [{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total}"
                f" {self.note}  {elapsed:.0f}s")
        return text[:max(shutil.get_terminal_size((100, 20)).columns - 1, 20)]

    def _draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self._line())
        self.stream.flush()
        self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[2K")
            self._drawn = False

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        self.note = note
        if self.enabled:
            self._draw()
        elif self.plain and note:
            print(f"{self.label}: {note} ({self.done}/{self.total})", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A line above the bar (or just the line without a terminal)."""
        if self.enabled:
            self._clear()
        print(line, file=self.stream, flush=True)
        if self.enabled and self.done < self.total:
            self._draw()

    def close(self) -> None:
        if self.enabled:
            self._clear()
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
