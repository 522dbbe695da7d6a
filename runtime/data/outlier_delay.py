"""Mini-batches with WLB-LLM outlier delay (WLB-LLM §4.1): the training data stream of ``--outlier-queues K``.

The queues and their release rule are ``hgraph.runtime.data.wlb_packing.WLBPacker``'s (Alg. 1): a document
at least ``thresholds[0]`` tokens long waits in FIFO queue ``i`` (``L_i <= len < L_{i+1}``; default
``L / 2^(K-i)`` with ``L`` the longest document of the data, ``stream_thresholds``; the packer's
own default differs and a checkpoint stores these) until the queue holds ``release``
documents, then all of them join the step. WLB releases one per micro-batch; here ``release`` is the
world size (one per rank) capped by how many documents of length ``L`` a step's budget holds
(``release_size``): a larger group would not fit one step and would be split anyway (measured:
releasing 4 at 2048 tokens per step raised the planner's estimated imbalance, releasing 2 did not).
What is the trainer's own is how a mini-batch fills its ``tokens_per_iter`` budget:

1. documents held back from earlier steps (released but not fitting) go first, oldest first;
2. then new documents in file order, while they fit (``docs/architecture.md``, data order): a short document is
   taken; an outlier goes to its queue (it takes no room now) and a released group joins the step,
   what does not fit being held for the next step. While documents are held, reading stops at the
   next outlier, so held documents never pile up: each waits only behind the held ones before it,
   and short documents fill the room they leave (a step of a few long documents alone would leave
   ranks idle).

The end of the data releases everything (never drops one):

- the end of an epoch (the data wraps around): every queue is flushed into the held list, so an
  epoch's documents are all trained before the next epoch's are read;
- the run's end (``steps`` is the run's total): when the held and queued documents would need
  nearly all of the steps left, the stream stops delaying (``draining``): queues are flushed and
  new outliers are taken like any document; the last step trains whatever is still held even past
  the budget (the only step that may exceed ``tokens_per_iter``).

Documents are named by their *position* (documents read from the start of the run, all epochs), so
the state (position, queues, held) is plain JSON: a checkpoint stores it and a resumed stream
continues exactly. The stream is a pure function of the data and the state: the planner process gets
the same mini-batches as the trainer.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

from hgraph.errors import HGraphError
from hgraph.runtime.data.documents import Document, MiniBatch, longest_length, mini_batches
from hgraph.runtime.data.wlb_packing import DocLatency, StreamDoc, WLBPacker

_STATE_VERSION = 1


class _FileOrder:
    """File order over ``docs`` (``corpus.DataOrder`` without shuffle or mixture)."""

    def __init__(self, docs: Sequence[Document]) -> None:
        self.docs, self.epoch_size = docs, len(docs)

    def at(self, position: int) -> Document:
        return self.docs[position % self.epoch_size]


def _next_fit_steps(lengths: Sequence[int], budget: int) -> int:
    """Steps that train ``lengths`` in this order, whole documents, ``budget`` tokens each."""
    steps, room = 0, 0
    for n in lengths:
        if n > room:
            steps, room = steps + 1, budget
        room -= n
    return steps


def stream_thresholds(longest: int, num_queues: int) -> list[int]:
    """The stream's queue thresholds ``L / 2^(K-i)`` of the longest document ``L``: fixed here,
    apart from the packer's default, because checkpoints store them and a resume compares."""
    return [max(1, int(longest) >> (num_queues - i)) for i in range(num_queues)]


class DelayedMiniBatches:
    """The mini-batches of one run with outlier delay; ``state()`` after any batch
    is what a checkpoint stores, ``DelayedMiniBatches(..., state=that)`` continues from it."""

    def __init__(self, docs: Sequence[Document], tokens_per_iter: int, steps: int, num_queues: int,
                 release: int, *, state: Optional[dict] = None, order: Any = None) -> None:
        if not docs:
            raise HGraphError("no documents to train on")
        # position -> document (``corpus.DataOrder``); default file order
        self.order = order if order is not None else _FileOrder(docs)
        if num_queues < 1:
            raise HGraphError(f"--outlier-queues must be >= 1 for a delayed stream, got {num_queues}")
        self.docs, self.budget, self.steps = docs, int(tokens_per_iter), int(steps)
        longest = longest_length(docs)
        # WLBPacker holds the queues and releases them (Alg. 1); latency only matters to its packing,
        # which this stream does not use.
        self.wlb = WLBPacker(DocLatency(1.0, 0.0), max(1, int(release)), longest,
                             outlier_thresholds=stream_thresholds(longest, num_queues), refine_steps=0)
        self.position, self.step, self.draining = 0, 0, False
        self.held: list[StreamDoc] = []
        if state is not None:
            self._restore(state)

    # -- state ------------------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON of the queues and held documents ([position, arrival step] each) and the position."""
        pair = lambda d: [d.index, d.arrival]   # noqa: E731
        return {"outlier_delay": True, "version": _STATE_VERSION, "thresholds": list(self.wlb.thresholds),
                "release": self.wlb.n, "next_step": self.step, "next_document": self.position,
                "draining": self.draining, "queues": [[pair(d) for d in q] for q in self.wlb.queues],
                "held": [pair(d) for d in self.held], "pending": self.pending()}

    def _restore(self, state: dict) -> None:
        if not state.get("outlier_delay"):
            raise HGraphError("the saved stream state has no outlier delay")
        # the release size follows this run's world size (a resharded resume releases by its own);
        # the thresholds come from the data and K, so a difference means another --outlier-queues
        if list(state.get("thresholds", [])) != self.wlb.thresholds:
            raise HGraphError(f"--resume: the checkpoint's {len(state.get('thresholds', []))} outlier queues "
                              f"(thresholds {state.get('thresholds')}) differ from this run's "
                              f"{len(self.wlb.thresholds)} (thresholds {self.wlb.thresholds}); give the same "
                              "--outlier-queues")
        mk = lambda p: StreamDoc(int(p[0]), len(self.order.at(int(p[0]))), int(p[1]))   # noqa: E731
        for q, saved in zip(self.wlb.queues, state["queues"]):
            q.extend(mk(p) for p in saved)
        self.held = [mk(p) for p in state["held"]]
        self.position, self.step = int(state["next_document"]), int(state["next_step"])
        self.draining = bool(state["draining"])

    def pending(self) -> int:
        """Documents read but not trained yet (queued or held)."""
        return len(self.held) + sum(len(q) for q in self.wlb.queues)

    # -- the stream -------------------------------------------------------------------------------
    def _flush_queues(self) -> None:
        while any(self.wlb.queues):
            self.wlb.remained = []
            self.held.extend(self.wlb.take_pending([], flushing=True))

    def _should_drain(self) -> bool:
        queued = [d.length for q in self.wlb.queues for d in q]
        need = _next_fit_steps([d.length for d in self.held] + queued, self.budget)
        # one step of margin: a step may add a released group to the held list
        return need > 0 and need >= self.steps - self.step - 1

    def next_batch(self) -> MiniBatch:
        if self.step >= self.steps:
            raise HGraphError(f"the run has {self.steps} steps; no step {self.step}")
        last = self.step == self.steps - 1
        if not self.draining and (last or self._should_drain()):
            self.draining = True
            self._flush_queues()
        taken: list[StreamDoc] = []
        room = self.budget
        while self.held and (last or self.held[0].length <= room or not taken):
            d = self.held.pop(0)
            taken.append(d)
            room -= d.length
        n = self.order.epoch_size
        seen = {self.order.at(t.index).index for t in taken}
        while True:
            doc = self.order.at(self.position)
            if doc.index in seen:
                break                    # never the same document twice in one mini-batch (tiny data)
            d = StreamDoc(self.position, len(doc), self.step)
            if self.draining or d.length < self.wlb.thresholds[0]:
                if taken and d.length > room:
                    break
                taken.append(d)
                seen.add(doc.index)
                room -= d.length
            else:
                if self.held:
                    break                # a released group still waits: no new outlier until it is trained
                self.wlb.remained = []
                released = self.wlb.take_pending([d])   # queues it; a full queue releases its group
                for r in released:
                    if r.length <= room:
                        taken.append(r)
                        seen.add(self.order.at(r.index).index)
                        room -= r.length
                    else:
                        self.held.append(r)
            self.position += 1
            if self.position % n == 0:   # the data's end: this epoch's outliers are trained first
                self._flush_queues()
                if self.held:
                    if not taken:        # nothing in this step yet: the flushed outliers are its documents
                        while self.held and (not taken or self.held[0].length <= room):
                            d = self.held.pop(0)
                            taken.append(d)
                            room -= d.length
                    break                # ... before the next epoch is read
        if last:
            taken.extend(self.held)
            self.held = []
        batch = MiniBatch(self.step, tuple(self.order.at(d.index) for d in taken), self.position,
                          delayed=sum(d.arrival < self.step for d in taken), pending=self.pending(),
                          delay_iters=tuple(self.step - d.arrival for d in taken))
        if batch.num_targets == 0:
            raise HGraphError(f"step {self.step}: the mini-batch (documents {[d.index for d in batch.docs]}) is "
                              "empty of targets (only one-token documents); the loss is undefined")
        self.step += 1
        return batch


def delayed_mini_batches(docs: Sequence[Document], tokens_per_iter: int, steps: int, num_queues: int,
                         release: int, *, state: Optional[dict] = None,
                         order: Any = None) -> Iterator[tuple[MiniBatch, dict]]:
    """Each mini-batch of the steps left, with the stream's state after it (a checkpoint's queues)."""
    stream = DelayedMiniBatches(docs, tokens_per_iter, steps, num_queues, release, state=state, order=order)
    while stream.step < steps:
        batch = stream.next_batch()
        yield batch, stream.state()


def check_resume_queues(saved: dict, outlier_queues: int, folder) -> None:
    """A resume must keep the checkpoint's delayed documents: with the same number of queues (their
    thresholds), and never with delay turned off while documents wait (one-line HGraphError)."""
    waiting = int(saved.get("pending", 0)) if saved.get("outlier_delay") else 0
    saved_k = len(saved.get("thresholds", [])) if saved.get("outlier_delay") else 0
    if waiting and outlier_queues != saved_k:
        raise HGraphError(f"--resume: {str(folder)!r} holds {waiting} delayed documents in {saved_k} outlier "
                          f"queues; resume with --outlier-queues {saved_k} (got {outlier_queues}) so they are "
                          "trained")


def run_mini_batches(docs: Sequence[Document], world_size: int, *, tokens_per_iter: int, steps: int,
                     outlier_queues: int = 0, resumed=None, order: Any = None
                     ) -> Iterator[tuple[MiniBatch, Optional[dict]]]:
    """The mini-batches a run trains (its ``--tokens-per-iter``, ``--steps`` and
    ``--outlier-queues``) from its start or from the checkpoint ``resumed``, each with the delay
    state after it (None without outlier delay), in ``order`` (``corpus.DataOrder``; default file
    order). The trainer and the planner process both call this, so they see the same stream."""
    queues = outlier_queues
    saved = dict(resumed.delay_queues) if resumed is not None else {}
    if resumed is not None:
        check_resume_queues(saved, queues, resumed.path)
    if queues == 0:
        start_step = resumed.step if resumed is not None else 0
        start = resumed.data_position["next_document"] if resumed is not None else 0
        for batch in mini_batches(docs, tokens_per_iter, steps, start_step=start_step,
                                  start_position=start, order=order):
            yield batch, None
        return
    state = None
    if resumed is not None:
        state = saved
        if not state.get("outlier_delay") or len(state.get("thresholds", [])) != queues:
            # a checkpoint of a run without delay (or with other queues, all empty: checked above):
            # nothing waits, the stream starts at its position
            state = DelayedMiniBatches(docs, tokens_per_iter, steps, queues, world_size,
                                       order=order).state()
            state.update(next_step=resumed.step, next_document=resumed.data_position["next_document"])
    yield from delayed_mini_batches(docs, tokens_per_iter, steps, queues,
                                    release_size(docs, tokens_per_iter, world_size), state=state,
                                    order=order)


def release_size(docs: Sequence[Document], tokens_per_iter: int, world_size: int) -> int:
    """Outliers a full queue releases at once: WLB releases one per micro-batch, each able to hold the
    longest document; a step here holds ``tokens_per_iter // longest`` such, shared by the ranks."""
    longest = longest_length(docs)
    return max(1, min(int(world_size), int(tokens_per_iter) // longest))
