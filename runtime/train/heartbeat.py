"""Liveness of the ranks of a run: a rank that died is named when a collective fails, and a rank that
stopped answering (SIGSTOP, a frozen host) is named within the heartbeat timeout, and the run ends.

Each rank's ``Heartbeat`` thread writes a timestamp and its host to the run's key-value store (the
default process group's store: a file store under ``spawn``, the TCP store under ``torchrun``) every
``interval_s``. When a collective fails (a peer's connection closed, or the timeout passed),
``lost_ranks`` waits until a dead rank's heartbeat must be stale and returns the ranks whose last beat
is older than ``stale_s``. A dead process stops beating; a live one blocked in a collective keeps
beating (the thread does not need the blocked main thread), so the two are told apart.

A stopped process neither beats nor closes its connections, so its peers' collectives only fail at
their timeout (600 s under a launcher). With ``timeout_s`` the thread also watches its peers: a peer
whose beat has not changed for ``timeout_s`` (measured on this rank's clock, so clock skew between
hosts does not matter) is handed to ``on_unresponsive`` with its host, once; the trainer's handler ends
this process with one line naming it (``hgraph.runtime.process.lifetime.end_process``), which ends the
run: the launcher, or torchrun's agent, stops the others. A rank that finished writes a last beat
marked done, so a peer still finishing (rank 0 writing files) does not take it for stopped.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

_PREFIX = "hgraph/heartbeat/"


#: A peer that stopped answering: (rank, host, seconds since its beat last changed).
Silent = tuple[int, str, float]


class Heartbeat:
    """Beats for ``rank`` into ``store`` until ``stop``; ``lost_ranks`` reads everyone's beats; with
    ``timeout_s``, peers silent that long go to ``on_unresponsive``."""

    def __init__(self, store: Any, rank: int, world_size: int, interval_s: float = 0.5,
                 stale_s: float = 3.0, timeout_s: Optional[float] = None,
                 on_unresponsive: Optional[Callable[[list[Silent]], None]] = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.stale_s = interval_s, stale_s
        self.timeout_s, self.on_unresponsive = timeout_s, on_unresponsive
        self.host = socket.gethostname()
        self._seen: dict[int, tuple[bytes, float]] = {}     # peer -> (its last beat, when it changed here)
        # reading every peer's beat costs world_size store reads: often enough for the timeout, no more
        self._watch_every_s = None if timeout_s is None else max(interval_s, timeout_s / 10)
        self._next_watch = time.monotonic()
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"hgraph-heartbeat-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def for_default_group(cls, **kwargs: Any) -> Optional["Heartbeat"]:
        """A heartbeat on the default group's store; None without a process group or a store."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError):
            return None
        return cls(store, dist.get_rank(), dist.get_world_size(), **kwargs)

    def _beat(self, done: bool = False) -> None:
        self.store.set(f"{_PREFIX}{self.rank}", f"{time.time()!r} {self.host}" + (" done" if done else ""))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                silent = []
                if self._watch_every_s is not None and time.monotonic() >= self._next_watch:
                    self._next_watch = time.monotonic() + self._watch_every_s
                    silent = self.unresponsive()
            except Exception:    # the store went away with its host: nothing left to report to
                return
            if silent and not self._stop.is_set():
                if self.on_unresponsive is not None:
                    self.on_unresponsive(silent)
                return

    def unresponsive(self) -> list[Silent]:
        """Peers whose beat has not changed for ``timeout_s`` as seen from here (one that has not beaten
        yet, or that finished, is not counted)."""
        now = time.monotonic()
        silent = []
        for r in range(self.world_size):
            key = f"{_PREFIX}{r}"
            if r == self.rank or not self.store.check([key]):
                continue
            beat = self.store.get(key)
            last, since = self._seen.get(r, (None, now))
            if beat != last:
                self._seen[r] = (beat, now)
                continue
            fields = beat.decode().split()
            if now - since > self.timeout_s and "done" not in fields[2:]:
                silent.append((r, fields[1] if len(fields) > 1 else "?", now - since))
        return silent

    def lost_ranks(self) -> list[int]:
        """Ranks whose heartbeat stopped (waits ``stale_s`` first so a just-died rank shows as stale).

        When the store itself is gone (its host rank died), returns ``[0]`` under ``torchrun``'s
        convention that rank 0 hosts it.
        """
        time.sleep(self.stale_s)
        now = time.time()
        lost = []
        try:
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                key = f"{_PREFIX}{r}"
                if not self.store.check([key]) or now - float(self.store.get(key).decode().split()[0]) > self.stale_s:
                    lost.append(r)
        except Exception:
            return [0]
        return lost

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
        try:
            self._beat(done=True)
        except Exception:     # the store's host has gone already
            pass


def silent_peers_text(silent: list[Silent], rank: int, timeout_s: float) -> str:
    """The line that names the peers that stopped answering."""
    who = ", ".join(f"rank {r} on {host} (no heartbeat for {age:.1f} s)" for r, host, age in silent)
    return (f"{who} stopped answering (heartbeat timeout {timeout_s:g} s: stopped or frozen, e.g. SIGSTOP); "
            f"rank {rank} ends the run")
