"""Liveness of the ranks of a run, so a rank whose collective failed can name the rank that was lost.

Each rank's ``Heartbeat`` thread writes a timestamp to the run's key-value store (the default process
group's store: a file store under ``spawn``, the TCP store under ``torchrun``) every ``interval_s``.
When a collective fails (a peer's connection closed, or the timeout passed), ``lost_ranks`` waits
until a dead rank's heartbeat must be stale and returns the ranks whose last beat is older than
``stale_s``. A dead process stops beating; a live one blocked in a collective keeps beating (the
thread does not need the blocked main thread), so the two are told apart.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import torch.distributed as dist

_PREFIX = "hgraph/heartbeat/"


class Heartbeat:
    """Beats for ``rank`` into ``store`` until ``stop``; ``lost_ranks`` reads everyone's beats."""

    def __init__(self, store: Any, rank: int, world_size: int, interval_s: float = 0.5,
                 stale_s: float = 3.0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.stale_s = interval_s, stale_s
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

    def _beat(self) -> None:
        self.store.set(f"{_PREFIX}{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:    # the store went away with its host: nothing left to report to
                return

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
                if not self.store.check([key]) or now - float(self.store.get(key).decode()) > self.stale_s:
                    lost.append(r)
        except Exception:
            return [0]
        return lost

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
