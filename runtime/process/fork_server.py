"""The ranks' fork server ends the moment its launcher does.

The server (``multiprocessing.forkserver``) notices its launcher's death at once: the pipe from the
launcher reaches EOF and its loop raises ``SystemExit``. But a plain exit then runs the interpreter's
teardown with torch and the runtime imported (measured 1.5 s alone on a 2-core machine, 4-6 s beside
training ranks), and the ranks and the planner, which die with the server
(``hgraph.runtime.process.lifetime.tie_to_starter``), train and save checkpoints all that while.

This module is the last one the server preloads (``hgraph.runtime.train.launch.forkserver_preload``).
Imported there, it registers ``os._exit`` as the server's last exit handler, so it runs first and
the server ends without the teardown; its children (they end with ``os._exit``, never through exit
handlers) are not affected. Imported anywhere else it does nothing.
"""
from __future__ import annotations

import atexit
import os
import sys
from multiprocessing import forkserver


def in_fork_server() -> bool:
    """Whether this import runs inside the fork server's ``main`` (its preload)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _exit_at_once() -> None:
    os._exit(0)


if in_fork_server():
    atexit.register(_exit_at_once)
