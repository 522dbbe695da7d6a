"""Every process a run starts dies with the run, however its starter ends (``kill -9`` included).

``die_with_parent(parent)`` arms the parent-death signal: on Linux ``prctl(PR_SET_PDEATHSIG)``, which
the kernel fires when the *thread* that forked this process exits (so a child must be forked from a
thread that lives as long as its parent process: the main thread); elsewhere a daemon thread polls
``os.getppid()``. It then checks ``os.getppid()`` once more: a parent that died before the signal was
armed is not missed.

``tie_to_starter()`` is the first thing a child of ``multiprocessing`` does (a rank of ``spawn``, the
planner process). Under ``"spawn"`` its parent is its starter. Under ``"forkserver"`` its parent is the
fork server, which exits when the pipe from its client (the launcher) reaches EOF; but the server
hands every child a copy of that pipe's write end, so as long as any child lives the server never sees
the launcher die, and nothing tells the children either (seen: SIGKILL of the launcher left ranks,
planner and server training on). The child closes its copy, after arming the signal against the
server (which cannot have exited yet: the copy kept it alive), so the launcher's death ends the server
and the server's ends the child, at once (the server skips its interpreter's teardown:
``hgraph.runtime.process.fork_server``).

``end_process(message)`` ends this process at once from any thread, for a watchdog whose main thread
is blocked in a collective no exception reaches: one line on stderr and, under ``spawn``, a note the
launcher reads to name the cause rather than report this rank as lost (``NOTE_ENV``).
"""
from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import forkserver
from typing import NoReturn, Optional

#: The file where a process that ends itself leaves its reason for its launcher (``launch.spawn`` sets it).
NOTE_ENV = "HGRAPH_EXIT_NOTE"
_PR_SET_PDEATHSIG = 1
#: How often the fallback watchdog looks at the parent id.
WATCH_INTERVAL_S = 0.5


def _set_pdeathsig(sig: int) -> bool:
    """Arms ``prctl(PR_SET_PDEATHSIG, sig)``; False where there is no prctl (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, sig: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os.kill(os.getpid(), sig)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> str:
    """This process gets ``sig`` when its parent ``parent`` exits; returns how: ``"prctl"`` or
    ``"watchdog"`` (a polling thread, where prctl is unavailable)."""
    how = "prctl" if _set_pdeathsig(sig) else "watchdog"
    if how == "watchdog":
        threading.Thread(target=_watch_parent, args=(parent, sig), name="hgraph-parent-watch",
                         daemon=True).start()
    if os.getppid() != parent:        # it died before the signal was armed
        os.kill(os.getpid(), sig)
    return how


def tie_to_starter(sig: int = signal.SIGKILL) -> str:
    """In a child of ``multiprocessing`` (spawn or forkserver): die with the process that started it,
    even when it is killed. Returns how the death is noticed (``die_with_parent``)."""
    server_pipe = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if server_pipe is None:         # "spawn": the parent is the starter itself
        return die_with_parent(multiprocessing.parent_process().pid, sig)
    how = die_with_parent(os.getppid(), sig)     # the server: alive while this child holds its pipe
    os.close(server_pipe)
    forkserver._forkserver._forkserver_alive_fd = None
    return how


def end_process(message: str, blame: Optional[int] = None, code: int = 1) -> NoReturn:
    """Ends this process now (``os._exit``): ``message`` on stderr and in the launcher's note, with
    ``blame``, the rank the message names as the cause."""
    sys.stderr.write(f"hgraph: {message}\n")
    sys.stderr.flush()
    note = os.environ.get(NOTE_ENV)
    if note:
        with open(note, "w", encoding="utf-8") as f:
            json.dump({"message": message, "blame": blame}, f)
    os._exit(code)


def read_note(path: str) -> Optional[dict]:
    """The note ``end_process`` left at ``path`` ({"message", "blame"}), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
