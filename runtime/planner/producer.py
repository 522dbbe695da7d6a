"""Plans computed ahead in a separate process (producer-consumer, Hydraulis App. E).

A ``spawn``-started worker plans iterations ``start, start+1, ...`` into a bounded queue while the
trainer (the consumer) runs the current one; ``get()`` returns the plans in order and records how
long the consumer waited. If the worker fails or dies, ``get()`` raises ``PlanProducerDied`` so the
caller can fall back to planning inline (``plan_iteration``).
"""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
from typing import Sequence

import numpy as np

from hgraph.runtime.planner.plan import Plan
from hgraph.strategy import Strategy


class PlanProducerDied(RuntimeError):
    """The planning worker stopped before delivering the requested plan."""


def _produce(out, lengths, batches, candidates, cost, method, seed, start):
    """Worker body: plan every mini-batch in order; report an error instead of dying silently."""
    from hgraph.runtime.planner.selection import plan_iteration

    k = start
    try:
        for k, ids in enumerate(batches, start):
            plan = plan_iteration(lengths[ids], candidates, cost, method=method, seed=seed, doc_ids=ids, index=k)
            out.put(("plan", plan))
        out.put(("done", None))
    except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer as a message
        out.put(("error", f"planning iteration {k} failed: {type(exc).__name__}: {exc}"))


class PlanProducer:
    """Plan mini-batches ahead of the trainer in a worker process.

    ``batches`` are arrays of document indices into ``lengths`` (e.g. ``lengths_io.minibatches``);
    ``depth`` bounds how many plans may wait in the queue. Use as a context manager or call
    ``close()``.
    """

    def __init__(self, lengths, batches: Sequence[np.ndarray], candidates: Sequence[Strategy], cost, *,
                 method: str = "fast", seed: int = 0, depth: int = 4, start_index: int = 0,
                 poll_s: float = 0.05):
        self._ctx = mp.get_context("spawn")
        self._queue = self._ctx.Queue(maxsize=max(int(depth), 1))
        self._next = start_index
        self._end = start_index + len(batches)
        self._poll_s = poll_s
        self.wait_ms: list[float] = []
        self._process = self._ctx.Process(
            target=_produce, daemon=True,
            args=(self._queue, np.asarray(lengths, dtype=np.int64), [np.asarray(b, dtype=np.int64) for b in batches],
                  list(candidates), cost, method, seed, start_index))
        self._process.start()

    @property
    def total_wait_ms(self) -> float:
        return float(sum(self.wait_ms))

    def __iter__(self):
        while self._next < self._end:
            yield self.get()

    def get(self, timeout: float | None = None) -> Plan:
        """The next plan in order; raises PlanProducerDied if the worker failed or died,
        StopIteration when every mini-batch was delivered, TimeoutError after ``timeout`` seconds."""
        if self._next >= self._end:
            raise StopIteration("every planned iteration was delivered")
        t0 = time.perf_counter()
        while True:
            try:
                kind, payload = self._queue.get(timeout=self._poll_s)
                break
            except queue_mod.Empty:
                if not self._process.is_alive():
                    # One last look: the worker may have put its message just before exiting.
                    try:
                        kind, payload = self._queue.get(timeout=self._poll_s)
                        break
                    except queue_mod.Empty:
                        raise PlanProducerDied(
                            f"planning worker exited (code {self._process.exitcode}) before iteration {self._next}") from None
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"no plan for iteration {self._next} after {timeout} s") from None
        self.wait_ms.append((time.perf_counter() - t0) * 1e3)
        if kind == "error":
            raise PlanProducerDied(payload)
        if kind != "plan" or payload.index != self._next:
            raise PlanProducerDied(f"planning worker sent {kind!r} where iteration {self._next} was expected")
        self._next += 1
        return payload

    def close(self) -> None:
        """Stop the worker (if still running) and release the queue."""
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(timeout=5)
        self._queue.cancel_join_thread()  # the worker is gone; do not block on undelivered plans
        self._queue.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def __enter__(self) -> "PlanProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
