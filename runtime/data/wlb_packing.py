"""WLB-LLM packing: variable-length packing with multi-level outlier delay queues (WLB-LLM §4, Alg. 1).

A packer turns a stream of global batches (document lengths with their global indices) into
packed micro-batches, one batch of ``num_microbatches`` micro-batches per ``push``, and emits every
document still held back on ``flush``. No packer ever drops or duplicates a document.

- ``WLBPacker``: WLB-LLM Alg. 1. Documents at least ``outlier_thresholds[0]`` tokens long wait in
  FIFO queue ``i`` (``L_i <= len < L_{i+1}``) until the queue holds ``N`` documents, then all ``N``
  join the same batch, one per micro-batch. Pending documents are placed longest first into the
  micro-batch with the least *latency* (attention ``a l^2`` plus linear ``b l``, Eq. 2) if it stays
  within ``max_len`` tokens, else into the shortest micro-batch, else they wait for the next batch.
  A short local search (moves and swaps off the slowest micro-batch) then lowers the maximum further;
  it is bounded in steps so a batch packs in a few milliseconds. One deviation from Alg. 1: the
  documents held back from the previous batch are placed before the new ones (each group longest
  first), so a short document cannot be pushed back batch after batch. ``capacity`` (tokens per
  micro-batch, WLB's memory-bound ``L_max``) may exceed ``max_len`` (the context window); with
  ``capacity == max_len`` a batch of ``N * max_len`` tokens has no slack and delays pile up.

The fixed-length packers WLB compares against (its Table 2 baselines) are offline baselines:
``hgraph.runtime.research.fixed_length``.

Imbalance degree (WLB §6.4): ``max micro-batch latency * PP / total latency`` where the batch has
``PP`` micro-batches per pipeline (WLB runs ``N = PP`` micro-batches per DP rank); here ``PP`` is the
number of micro-batches of the batch, so a perfectly balanced batch scores 1.0.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError


@dataclass(frozen=True)
class DocLatency:
    """Latency of documents in one micro-batch: ``a l^2 + b l`` per document, ``c`` once (ms)."""

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c) < 0 or (self.a == 0 and self.b == 0):
            raise HGraphError(f"document latency needs a, b, c >= 0 and a or b > 0, got {self.a}, {self.b}, {self.c}")

    @classmethod
    def from_cost_model(cls, cost, scheme) -> "DocLatency":
        """Coefficients of ``scheme`` in a ``CostModel``."""
        a, b, c = cost.coeffs(scheme)
        return cls(float(a), float(b), float(c))

    def docs(self, lengths) -> np.ndarray:
        arr = np.asarray(lengths, dtype=np.float64)
        return self.a * arr * arr + self.b * arr

    def microbatch(self, lengths) -> float:
        if len(lengths) == 0:
            return 0.0
        return float(self.docs(lengths).sum()) + self.c


def imbalance_degree(microbatch_latencies: Sequence[float]) -> float:
    """WLB imbalance degree ``max * V / sum`` of ``V`` micro-batch latencies (1.0 = balanced)."""
    lat = np.asarray(microbatch_latencies, dtype=np.float64)
    if lat.size == 0 or lat.sum() <= 0:
        return 1.0
    return float(lat.max() * lat.size / lat.sum())


@dataclass
class PackedBatch:
    """One global batch after packing: ``microbatches`` hold global document indices."""

    index: int
    microbatches: list[list[int]]
    latencies_ms: list[float]
    imbalance: float
    pack_ms: float
    from_flush: bool = False

    def to_dict(self) -> dict:
        return {"index": self.index, "microbatches": self.microbatches, "imbalance": self.imbalance,
                "pack_ms": self.pack_ms}


@dataclass
class StreamDoc:
    index: int
    length: int
    arrival: int  # batch index at which the document was pushed


@dataclass
class DelayStats:
    """Per-document delay (batches between arrival and the batch that trains it)."""

    delays: dict[int, int] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)

    def record(self, doc: StreamDoc, batch_index: int) -> None:
        if doc.index in self.delays:
            raise AssertionError(f"document {doc.index} emitted twice")
        self.delays[doc.index] = batch_index - doc.arrival
        self.lengths[doc.index] = doc.length

    def mean_delay(self) -> float:
        """Mean over all documents (0 for a document trained in the batch it arrived in)."""
        return float(np.mean(list(self.delays.values()))) if self.delays else 0.0

    def token_weighted_delay(self) -> float:
        if not self.delays:
            return 0.0
        d = np.asarray(list(self.delays.values()), dtype=np.float64)
        w = np.asarray([self.lengths[i] for i in self.delays], dtype=np.float64)
        return float((d * w).sum() / w.sum())

    def delayed_fraction(self) -> float:
        return float(np.mean([d > 0 for d in self.delays.values()])) if self.delays else 0.0


class StreamPacker:
    """Common stream handling: validation, batch numbering, delay accounting, flush."""

    def __init__(self, latency: DocLatency, num_microbatches: int, max_len: int,
                 capacity: Optional[int] = None) -> None:
        if not isinstance(num_microbatches, (int, np.integer)) or num_microbatches < 1:
            raise HGraphError(f"number of micro-batches must be a positive integer, got {num_microbatches!r}")
        if not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise HGraphError(f"max length must be a positive integer, got {max_len!r}")
        self.latency = latency
        self.n = int(num_microbatches)
        self.max_len = int(max_len)
        # Tokens one micro-batch may hold (the memory limit, WLB's L_max); documents are at most
        # ``max_len`` (the context window). Var-length packing may fill past the context window.
        self.capacity = int(capacity) if capacity is not None else self.max_len
        if self.capacity < self.max_len:
            raise HGraphError(f"micro-batch capacity {self.capacity} is below the max length {self.max_len}")
        self.batch_index = 0
        self.stats = DelayStats()
        self._seen: set[int] = set()
        self._next_auto_index = 0
        self.remained: list[StreamDoc] = []

    def _admit(self, lengths, indices) -> list[StreamDoc]:
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if indices is None:
            indices = np.arange(self._next_auto_index, self._next_auto_index + lengths.size)
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size != lengths.size:
            raise HGraphError(f"got {lengths.size} lengths but {indices.size} document indices")
        if lengths.size and lengths.min() < 1:
            k = int(np.argmin(lengths))
            raise HGraphError(f"document {int(indices[k])} has length {int(lengths[k])}; lengths must be positive")
        if lengths.size and lengths.max() > self.max_len:
            k = int(np.argmax(lengths))
            raise HGraphError(f"document {int(indices[k])} has {int(lengths[k])} tokens, more than the max length "
                              f"{self.max_len}; truncate or drop it before packing")
        idx = indices.tolist()
        fresh = set(idx)
        if len(fresh) != len(idx) or not fresh.isdisjoint(self._seen):
            dup = next(i for k, i in enumerate(idx) if i in self._seen or i in idx[:k])
            raise HGraphError(f"document index {dup} was pushed twice")
        self._seen |= fresh
        docs = [StreamDoc(i, l, self.batch_index) for i, l in zip(idx, lengths.tolist())]
        if indices.size:
            self._next_auto_index = max(self._next_auto_index, int(indices.max()) + 1)
        return docs

    def _emit(self, bins: list[list[StreamDoc]], t0: float, from_flush: bool) -> PackedBatch:
        mbs = [[d.index for d in b] for b in bins]
        lats = [self.latency.microbatch([d.length for d in b]) for b in bins]
        for b in bins:
            for d in b:
                self.stats.record(d, self.batch_index)
        batch = PackedBatch(self.batch_index, mbs, lats, imbalance_degree(lats),
                            (time.perf_counter() - t0) * 1e3, from_flush)
        self.batch_index += 1
        return batch

    def pending(self) -> int:
        """Documents pushed but not yet emitted."""
        return len(self.remained)

    def push(self, lengths, indices=None) -> PackedBatch:
        """Pack one global batch (lengths, optional global indices; default: consecutive)."""
        t0 = time.perf_counter()
        docs = self._admit(lengths, indices)
        pending = self.take_pending(docs)
        bins, left = self._pack(pending)
        self.remained = left
        return self._emit(bins, t0, False)

    def flush(self) -> list[PackedBatch]:
        """Emit every held-back document, in as many extra batches as needed."""
        out = []
        while self.pending():
            t0 = time.perf_counter()
            pending = self.take_pending([], flushing=True)
            bins, left = self._pack(pending)
            if sum(len(b) for b in bins) == 0:  # cannot happen: the longest always fits an empty bin
                raise AssertionError("flush made no progress")
            self.remained = left
            out.append(self._emit(bins, t0, True))
        return out

    # subclasses
    def take_pending(self, new_docs: list[StreamDoc], flushing: bool = False) -> list[StreamDoc]:
        raise NotImplementedError

    def _pack(self, docs: list[StreamDoc]) -> tuple[list[list[StreamDoc]], list[StreamDoc]]:
        raise NotImplementedError


def default_thresholds(max_len: int, num_queues: int) -> list[int]:
    """``K`` outlier thresholds splitting the upper half of the context: ``L/2 + i L / (2K)``.

    Why the upper half: a document past ``L/2`` sets the floor of its micro-batch (no other
    such document fits beside it under the context), so those are the ones worth grouping by
    length. Measured with the WLB bench (128K context, memory-capped micro-batches, 100 batches):
    two queues at ``[L/2, 3L/4]`` pack to imbalance 1.004-1.012 on the Wikipedia lengths and on
    Pareto and log-normal tails (two seeds each), where the earlier ``[L/4, L/2]`` gave 1.010-1.047
    (the queues held documents of 32K-64K that pack fine, while 64K-128K ones set the floors).
    """
    K = int(num_queues)
    return [max(1, max_len // 2 + i * max_len // (2 * K)) for i in range(K)]


class WLBPacker(StreamPacker):
    """WLB-LLM var-length packing with multi-level outlier delay (Alg. 1) plus a bounded local search.

    ``outlier_thresholds``: ascending ``L_1 < ... < L_K`` token thresholds, one FIFO queue each;
    default ``default_thresholds(max_len, num_queues)``: the upper half of the context split into
    ``K`` queues (``[L/2, 3L/4]`` for two).
    ``refine_steps``: moves/swaps tried off the slowest micro-batch (0 = plain Alg. 1).
    """

    def __init__(self, latency: DocLatency, num_microbatches: int, max_len: int, *,
                 capacity: Optional[int] = None, outlier_thresholds: Optional[Sequence[int]] = None,
                 num_queues: int = 2, refine_steps: int = 64) -> None:
        super().__init__(latency, num_microbatches, max_len, capacity)
        if outlier_thresholds is None:
            if not isinstance(num_queues, (int, np.integer)) or num_queues < 0:
                raise HGraphError(f"number of outlier queues must be >= 0, got {num_queues!r}")
            outlier_thresholds = default_thresholds(self.max_len, num_queues)
        th = [int(t) for t in outlier_thresholds]
        if any(b <= a for a, b in zip(th, th[1:])) or any(t < 1 for t in th):
            raise HGraphError(f"outlier thresholds must be positive and strictly ascending, got {th}")
        self.thresholds = th
        self.queues: list[deque[StreamDoc]] = [deque() for _ in th]
        self.refine_steps = int(refine_steps)

    def pending(self) -> int:
        return len(self.remained) + sum(len(q) for q in self.queues)

    def take_pending(self, new_docs: list[StreamDoc], flushing: bool = False) -> list[StreamDoc]:
        pending = list(self.remained)
        if new_docs and self.thresholds:
            qs = np.searchsorted(self.thresholds, [d.length for d in new_docs], side="right") - 1
            for d, q in zip(new_docs, qs.tolist()):
                (self.queues[q].append(d) if q >= 0 else pending.append(d))
        else:
            pending.extend(new_docs)
        for q in self.queues:
            # Alg. 1 lines 12-16: a full queue releases N outliers, one per micro-batch. At flush
            # time every queue releases what it holds (the data has ended).
            if len(q) >= self.n or flushing:
                for _ in range(min(self.n, len(q))):
                    pending.append(q.popleft())
        return pending

    def _pack(self, docs: list[StreamDoc]) -> tuple[list[list[StreamDoc]], list[StreamDoc]]:
        # Documents held back from the previous batch go first so none waits twice in a row
        # behind newer ones (no starvation); within each group longest first (Alg. 1 line 19).
        docs = sorted(docs, key=lambda d: (d.arrival >= self.batch_index, -d.length, d.index))
        lens = np.asarray([d.length for d in docs], dtype=np.int64)
        work = self.latency.docs(lens)
        n, cap = self.n, self.capacity
        load = [0.0] * n
        size = [0] * n
        assign = np.full(len(docs), -1, dtype=np.int64)
        for i, (l, w) in enumerate(zip(lens.tolist(), work.tolist())):
            j = min(range(n), key=load.__getitem__)
            if size[j] + l > cap:
                j = min(range(n), key=size.__getitem__)
                if size[j] + l > cap:
                    continue  # Alg. 1 line 32: wait for the next batch
            assign[i] = j
            load[j] += w
            size[j] += l
        if self.refine_steps:
            _refine_max_load(assign, lens, work, np.asarray(load), np.asarray(size, dtype=np.int64),
                             cap, self.refine_steps)
        bins: list[list[StreamDoc]] = [[] for _ in range(n)]
        left = []
        for i, j in enumerate(assign.tolist()):
            (bins[j].append(docs[i]) if j >= 0 else left.append(docs[i]))
        return bins, left


def _refine_max_load(assign: np.ndarray, lens: np.ndarray, work: np.ndarray, load: np.ndarray,
                     size: np.ndarray, max_len: int, steps: int) -> None:
    """Lower the largest bin load by moving or swapping one document off the heaviest bin.

    Each step takes the best single move (heaviest bin -> another bin) or swap (a document of the
    heaviest bin with a lighter document elsewhere) that lowers the pair's maximum, within the
    token limit; stops when none helps. Swap partners come from the two lightest bins only (they
    offer the largest gains), which keeps a step linear in the batch size. Works in place.
    """
    for _ in range(steps):
        h = int(np.argmax(load))
        in_h = np.nonzero(assign == h)[0]
        if in_h.size == 0:
            return
        light = [j for j in np.argsort(load)[:2].tolist() if j != h]
        others = np.nonzero(np.isin(assign, light))[0]
        best_gain, best = 0.0, None
        # Moves: document i of h to bin j.
        wi = work[in_h][:, None]
        new_h = load[h] - wi
        new_j = load[None, :] + wi
        fits = size[None, :] + lens[in_h][:, None] <= max_len
        fits[:, h] = False
        pair_max = np.maximum(new_h, new_j)
        gain = np.where(fits, load[h] - pair_max, -np.inf)
        k = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[k] > best_gain:
            best_gain, best = float(gain[k]), ("move", int(in_h[k[0]]), int(k[1]))
        # Swaps: document i of h with document o of another bin j.
        if others.size:
            jo = assign[others]
            delta = work[in_h][:, None] - work[others][None, :]  # load leaving h
            dlen = lens[in_h][:, None] - lens[others][None, :]
            ok = (delta > 0) & (size[h] - dlen <= max_len) & (size[jo][None, :] + dlen <= max_len)
            pair_max = np.maximum(load[h] - delta, load[jo][None, :] + delta)
            gain = np.where(ok, load[h] - pair_max, -np.inf)
            k = np.unravel_index(int(np.argmax(gain)), gain.shape)
            if gain[k] > best_gain:
                best_gain, best = float(gain[k]), ("swap", int(in_h[k[0]]), int(others[k[1]]))
        if best is None or best_gain <= 1e-12 * max(load[h], 1.0):
            return
        if best[0] == "move":
            _, i, j = best
            load[h] -= work[i]; size[h] -= lens[i]
            load[j] += work[i]; size[j] += lens[i]
            assign[i] = j
        else:
            _, i, o = best
            j = int(assign[o])
            d, dl = work[i] - work[o], lens[i] - lens[o]
            load[h] -= d; size[h] -= dl
            load[j] += d; size[j] += dl
            assign[i], assign[o] = j, h
