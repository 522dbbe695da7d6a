"""The run's notes (what it chose, saved, fell back to) through ``logging``, in the run's format.

Every runtime module logs through ``run_log(__name__)``, a child of the ``hgraph`` logger. The first
call gives ``hgraph`` the run's handler, unless a program embedding hgraph gave it one of its own:
INFO records go to stdout and WARNING and above to stderr, each line the bare message (a note says
what it is about itself: ``hgraph: ...``, ``planner: ...``, ``checkpoint ...``), written to the
stream current when it is logged (a redirected ``sys.stdout``, a test's capture) and flushed, as the
step lines are. ``hgraph`` does not propagate to the root logger, so a program's root handlers do not
print a note twice; DEBUG records (``passes: ...``, ``compile: ...``) are shown only when asked
(``logging.getLogger("hgraph").setLevel(logging.DEBUG)``).
"""
from __future__ import annotations

import logging
import sys

ROOT = "hgraph"


class _RunStreams(logging.Handler):
    """INFO to stdout, WARNING and above to stderr, as the streams are when the record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:          # logging never raises into the run (``Handler.handleError``)
            self.handleError(record)


def run_log(name: str) -> logging.Logger:
    """The logger of module ``name`` (``hgraph...``), the run's handler installed on ``hgraph`` once."""
    root = logging.getLogger(ROOT)
    if not root.handlers:
        handler = _RunStreams()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(name)
