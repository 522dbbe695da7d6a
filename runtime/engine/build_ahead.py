"""Builds that run ahead of the step that needs them: one background thread of this rank.

The executor hands it the host work of a strategy it has not run (the Program, and this rank's
graph and Pull/Push plans for it) as soon as the step mode knows that strategy comes next, so the
work overlaps the steps before it; the step that needs the strategy then only looks it up.

One thread, one build at a time, in the order asked: a build is Python (fx passes, plan
arithmetic) that holds the GIL, so a second one would only take turns with the first and with the
step. A build must not run collectives or allocate what its strategy's step will hold (the
executor's ``prepare`` side of a rank state is written for that); whoever takes its result does
the rest on the main thread. The thread is a daemon: a run that ends, or fails, never waits for a
build nobody will use.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional


@dataclass(frozen=True)
class BuildTiming:
    """How a build ran: ``build_s`` its wall time, ``cpu_s`` its thread's CPU time, ``started_at`` its
    start (``time.perf_counter``, this process), ``ahead``: on the build-ahead thread."""

    build_s: float
    cpu_s: float
    started_at: float
    ahead: bool = False


class AheadBuilds:
    """A background thread running ``submit``ted builds in order; ``take`` waits for one."""

    def __init__(self, name: str = "hgraph-build-ahead") -> None:
        self._name = name
        self._jobs: "queue.Queue[Optional[tuple[Future, Callable[[], Any]]]]" = queue.Queue()
        self._pending: dict[Hashable, Future] = {}
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            _run_one(*job)
            del job      # nothing of the last build stays referenced while the thread waits for the next

    def submit(self, key: Hashable, build: Callable[[], Any]) -> bool:
        """Run ``build()`` on the thread after the builds asked before; False (nothing done) if ``key``
        is already pending."""
        if key in self._pending:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        future: Future = Future()
        self._pending[key] = future
        self._jobs.put((future, build))
        return True

    def pending(self, key: Hashable) -> bool:
        return key in self._pending

    def finished(self) -> dict[Hashable, Any]:
        """The results of the builds done and not yet taken, by key (failed ones left out)."""
        return {key: f.result()[0] for key, f in self._pending.items() if f.done() and not f.cancelled()
                and f.exception() is None}

    def take(self, key: Hashable) -> tuple[Any, BuildTiming]:
        """The result of ``key``'s build and its timing, waiting for it to finish (its error raised here)."""
        return self._pending.pop(key).result()

    def close(self) -> None:
        """Forget builds not yet started and let the thread end after the one it runs."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


def _run_one(future: Future, build: Callable[[], Any]) -> None:
    """Run one build into its future (its result and ``BuildTiming``, or its error)."""
    if not future.set_running_or_notify_cancel():
        return
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        value = build()
    except BaseException as exc:   # noqa: BLE001 - raised again where the result is taken
        future.set_exception(exc)
    else:
        future.set_result((value, BuildTiming(time.perf_counter() - t0, time.thread_time() - c0, t0, ahead=True)))
