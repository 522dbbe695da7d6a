"""How a run reports progress without knowing how it is drawn.

The runtime never draws bars itself (the terminal is the caller's business): the caller passes a
factory of bars in the run's config (``hgraph train`` passes ``hgraph.tools.cli.progress.Progress``,
bound to whether it draws on this terminal). Rank 0 makes its bars with it: ``factory(total, label,
plain=...)`` -> a bar with ``update``, ``write`` (a line above the bar) and ``close``. ``plain`` asks
a bar that is not drawn to print its notes as plain lines. Other ranks, and a run without a
factory, get ``PrintedLines``: no bar, only the lines written. ``PlainLines`` is the factory of a front
door that draws nothing (``hgraph.train``): a bar asked to be ``plain`` prints each update as the line
``label: note (i/n)``, as ``hgraph train``'s bars do off a terminal.
"""
from __future__ import annotations

from typing import Optional, Protocol

from hgraph.runtime.process.run_log import run_log

log = run_log(__name__)


class ProgressBar(Protocol):
    def update(self, n: int = 1, note: str = "") -> None: ...

    def write(self, line: str) -> None: ...

    def close(self) -> None: ...


class ProgressFactory(Protocol):
    def __call__(self, total: int, label: str, *, plain: bool = False) -> ProgressBar: ...


class PrintedLines:
    """No bar: the lines written go to the run's log (stdout, ``process.run_log``), updates are not shown."""

    def update(self, n: int = 1, note: str = "") -> None:
        pass

    def write(self, line: str) -> None:
        log.info(line)

    def close(self) -> None:
        pass


class PlainLines(PrintedLines):
    """No bar drawn; with ``plain`` each update with a note is the line ``label: note (i/n)``."""

    def __init__(self, total: int, label: str, *, plain: bool = False) -> None:
        self.total, self.label, self.plain, self.done = max(int(total), 1), label, plain, 0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        if self.plain and note:
            log.info(f"{self.label}: {note} ({self.done}/{self.total})")


def progress_bar(factory: Optional[ProgressFactory], total: int, label: str, *, rank: int,
                 plain: bool = False) -> ProgressBar:
    """Rank 0's bar from ``factory``; ``PrintedLines`` on the other ranks or without a factory."""
    if factory is None or rank != 0:
        return PrintedLines()
    return factory(total, label, plain=plain)
