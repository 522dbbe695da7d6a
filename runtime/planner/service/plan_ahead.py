"""The planner process of a training run: plans for iterations k+1.. while iteration k trains
(producer-consumer with a bounded queue, Hydraulis App. E).

Who starts it: the launcher (``run_training``), before it spawns the ranks, from the ranks'
forkserver (``hgraph.runtime.train.launch.process_context``: forking the server, which has torch and
hgraph imported, instead of a fresh interpreter importing them saves ~2 s of CPU per run); under
``torchrun`` rank 0's process, as a fresh interpreter. The spawned ranks are daemon processes (so
that they never outlive a launcher that dies) and Python forbids a daemon process to have children;
keeping the ranks daemonic and starting the planner from their non-daemonic parent keeps that
guarantee. The planner process itself is a
daemon of its starter for the same reason, and dies with its starter however that ends
(``hgraph.runtime.process.lifetime``). It ignores SIGINT and SIGTERM: a Ctrl-C or a scheduler's SIGTERM
to the whole process group is for the ranks to handle (stop, or save and stop), and the planner is
stopped by its owner when the ranks are done.

The channel (``PlannerChannel``, picklable into the ranks at their start) has three parts:

* ``jobs``: rank 0 -> planner, one ``("setup", cost, candidates, method, time_limit_s)`` message once
  the cost model and candidates are known (they are measured by the ranks, after the planner started),
  then the mini-batches to plan as ``("batch", step, [document lengths])`` in training order, fed a few
  ahead of the plans taken (``FEED_AHEAD`` past ``depth``: the run's mini-batches are read as it goes,
  never all at its start: a long run at cluster scale has millions of steps of thousands of documents),
  ``("end",)`` after the last, or ``("stop",)``.
* ``plans``: planner -> rank 0, ``("plan", step, Plan)`` or ``("error", step, message)``, in step order.
* ``credits``: a semaphore of ``depth``: the planner takes one before it delivers a plan, rank 0 gives
  one back when it consumes a plan (``get``), so at most ``depth`` plans are made and not yet
  consumed: the planner runs at most ``depth`` iterations ahead. Rank 0 may read delivered plans
  before their step (``upcoming``: the strategies of the next steps, which the ranks build ahead)
  without letting the planner run further.
* ``alive``: the read end of a pipe whose only write end the planner holds: it reads EOF once the
  planner process is gone, however it ended (killed, crashed), with no polling of process ids.

``PlanConsumer`` (rank 0) takes the plans in order and measures how long it waited for each; when
the planner process dies or reports an error it raises ``PlannerLost`` and the caller falls back to
planning inline.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import queue as queue_mod
import signal
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

from hgraph.runtime.planner.selection import plan_iteration
from hgraph.runtime.process.lifetime import tie_to_starter

_POLL_S = 0.02
#: mini-batches rank 0 sends the planner beyond the ``depth`` plans it may make ahead
FEED_AHEAD = 2


class PlannerLost(RuntimeError):
    """The planner process is gone (or failed) before delivering the plan asked for."""


@dataclass
class PlannerChannel:
    """What rank 0 needs to talk to the planner process (picklable only while starting a process)."""

    jobs: Any
    plans: Any
    credits: Any
    alive: Any
    pid: int
    depth: int


def _serve(jobs, plans, credits, alive_w) -> None:
    """Planner process body: wait for the setup, then plan every batch in order into ``plans``
    (blocking while ``depth`` of its plans are not consumed)."""
    tie_to_starter()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    msg = jobs.get()
    if msg[0] != "setup":
        return
    _, cost, candidates, method, time_limit_s = msg
    previous = None
    while True:
        msg = jobs.get()
        if msg[0] != "batch":              # "end" after the last mini-batch, or "stop"
            break
        _, step, lengths = msg
        try:
            plan = plan_iteration(lengths, candidates, cost, method=method, index=step, time_limit_s=time_limit_s,
                                  previous=previous)
            previous = plan.strategy
        except BaseException as exc:  # noqa: BLE001 - the consumer reports it and plans inline
            plans.put(("error", step, f"{type(exc).__name__}: {exc}"))
            return
        credits.acquire()
        plans.put(("plan", step, plan))
    plans.close()
    plans.join_thread()           # everything delivered before the process (and ``alive``) ends
    del alive_w


class PlannerProcess:
    """The planner process, started by the process that owns it (the launcher, or torchrun's rank 0)."""

    def __init__(self, depth: int, context: Any = None) -> None:
        if depth < 1:
            raise ValueError(f"plan-ahead depth must be >= 1, got {depth}")
        # never a fork of the caller, which may hold threads: a fresh interpreter ("spawn"), or the
        # launcher's forkserver context, whose server has torch and hgraph imported already
        ctx = context if context is not None else mp.get_context("spawn")
        jobs, plans, credits = ctx.Queue(), ctx.Queue(), ctx.Semaphore(depth)
        alive_r, alive_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve, args=(jobs, plans, credits, alive_w), daemon=True,
                                   name="hgraph-planner")
        self.process.start()
        alive_w.close()                   # only the planner holds the write end now
        self.channel = PlannerChannel(jobs, plans, credits, alive_r, self.process.pid, depth)

    def close(self) -> None:
        """Stop the planner (it may be blocked on a full queue; it ignores SIGTERM) and release the queues."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        for q in (self.channel.jobs, self.channel.plans):
            q.cancel_join_thread()
            q.close()
        self.channel.alive.close()

    def __enter__(self) -> "PlannerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PlanConsumer:
    """Rank 0's side: send the job once, then take plans in step order (``upcoming`` reads the ones
    already delivered, without consuming them)."""

    def __init__(self, channel: PlannerChannel) -> None:
        self.channel = channel
        self.lost: Optional[str] = None
        self._delivered: collections.deque = collections.deque()    # read by ``upcoming``, not consumed
        self._remaining = 0            # plans the planner has still to give (batches sent, less plans taken)
        self._batches: Optional[Iterator[tuple[int, list[int]]]] = None   # not sent yet

    def setup(self, cost: Any, candidates: Sequence[Any], method: str, time_limit_s: float,
              batches: Iterable[tuple[int, list[int]]]) -> None:
        """Send the planner its setup and the first mini-batches (``(step, lengths)`` in training order,
        read from ``batches`` as plans are taken)."""
        self.channel.jobs.put(("setup", cost, list(candidates), method, time_limit_s))
        self._batches = iter(batches)
        self._feed()

    def _feed(self) -> None:
        """Keep ``depth + FEED_AHEAD`` mini-batches sent and not yet planned-and-taken; ``("end",)`` once
        the run has no more."""
        while self._batches is not None and self._remaining < self.channel.depth + FEED_AHEAD:
            batch = next(self._batches, None)
            if batch is None:
                self._batches = None
                self.channel.jobs.put(("end",))
                return
            step, lengths = batch
            self.channel.jobs.put(("batch", step, list(lengths)))
            self._remaining += 1

    def get(self, step: int) -> tuple[Any, float]:
        """The plan of ``step`` and the seconds waited for it; ``PlannerLost`` if the planner is gone."""
        if self.lost is not None:
            raise PlannerLost(self.lost)
        t0 = time.perf_counter()
        if not self._delivered:
            self._receive(step)
        kind, got, payload = self._delivered.popleft()
        wait = time.perf_counter() - t0
        if kind == "plan":
            self.channel.credits.release()      # the planner may make one more
            self._remaining -= 1
            self._feed()
        if kind == "error":
            self.lost = f"planner process failed at step {got}: {payload}"
            raise PlannerLost(self.lost)
        if got != step:
            self.lost = f"planner process sent the plan of step {got} where step {step} was expected"
            raise PlannerLost(self.lost)
        return payload, wait

    def upcoming(self, wait_for: int = 0) -> list[Any]:
        """The strategies of the plans delivered for the next steps, in step order (they stay for
        ``get``); read now, or after waiting until ``wait_for`` of them are there (fewer if the run has
        fewer steps left). Empty once the planner is lost or failed."""
        if self.lost is not None:
            return []
        while True:
            try:
                self._delivered.append(self.channel.plans.get_nowait())
            except (queue_mod.Empty, OSError, ValueError):
                break
        try:
            while (len(self._delivered) < min(wait_for, self._remaining)
                   and not (self._delivered and self._delivered[-1][0] == "error")):
                self._receive(None)
        except PlannerLost:
            return []
        out = []
        for kind, _, payload in self._delivered:
            if kind != "plan":
                break
            out.append(payload.strategy)
        return out

    def _receive(self, step: Optional[int]) -> None:
        """Wait for the planner's next message into the delivered ones; ``PlannerLost`` (naming
        ``step``, else the next one) once the process is gone."""
        while True:
            try:
                self._delivered.append(self.channel.plans.get(timeout=_POLL_S))
                return
            except queue_mod.Empty:
                if self._gone():
                    try:      # a plan may have been put just before the process ended
                        self._delivered.append(self.channel.plans.get(timeout=_POLL_S))
                        return
                    except queue_mod.Empty:
                        what = f"step {step}" if step is not None else "a coming step"
                        self.lost = f"planner process {self.channel.pid} exited before the plan of {what}"
                        raise PlannerLost(self.lost) from None

    def _gone(self) -> bool:
        try:
            if not self.channel.alive.poll():
                return False
            self.channel.alive.recv()       # never sent: only EOF gets here
        except (EOFError, OSError):
            return True
        return False

    def stop(self) -> None:
        try:
            self.channel.jobs.put(("stop",))
        except (OSError, ValueError):
            pass
