"""The outlier-delay mini-batch stream: every document read is trained exactly once (flush included),
budgets and delays are bounded, and a stream restored from its JSON state continues exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.data.outlier_delay import DelayedMiniBatches, delayed_mini_batches, release_size


def _docs(n, max_len=128, seed=0):
    return [Document(i, tuple(d)) for i, d in enumerate(synthetic_documents(n, 256, max_len, seed=seed))]


def _run(docs, tokens, steps, queues=2, release=2):
    stream = DelayedMiniBatches(docs, tokens, steps, queues, release)
    # positions of the documents trained in each step, from the stream's own bookkeeping
    out = []
    for _ in range(steps):
        before = stream.position
        batch = stream.next_batch()
        out.append((batch, before, stream.state()))
    return stream, out


def _trained_positions(docs, batches):
    """Multiset of documents trained, per epoch-independent index."""
    counts = {}
    for b in batches:
        for d in b.docs:
            counts[d.index] = counts.get(d.index, 0) + 1
    return counts


@pytest.mark.parametrize("seed,tokens,steps,queues,release", [
    (0, 512, 12, 2, 2), (1, 512, 40, 1, 4), (2, 300, 25, 3, 2), (3, 1024, 9, 2, 3)])
def test_every_document_read_is_trained_exactly_once(seed, tokens, steps, queues, release):
    docs = _docs(150, seed=seed)
    stream, out = _run(docs, tokens, steps, queues, release)
    batches = [b for b, _, _ in out]
    assert stream.pending() == 0                      # the run's end flushed every delayed document
    read = stream.position                            # documents read from the start, all epochs
    expected = {}
    for p in range(read):
        expected[p % len(docs)] = expected.get(p % len(docs), 0) + 1
    assert _trained_positions(docs, batches) == expected
    assert sum(b.delayed for b in batches) > 0        # the data has outliers: some were delayed
    for b in batches[:-1]:
        assert b.tokens <= tokens                     # only the last step may pass the budget
        assert len({d.index for d in b.docs}) == len(b.docs)
    assert batches[-1].pending == 0
    # what waits is bounded: each queue holds fewer than `release`, at most one released group is
    # held at a time, plus what an epoch's end or the run's end flushed from the queues
    assert max(b.pending for b in batches) <= release + 2 * queues * (release - 1)
    for _, _, state in out:
        assert all(len(q) < release for q in state["queues"])


def test_epoch_end_flushes_so_no_document_waits_past_its_epoch():
    docs = _docs(40)
    stream, out = _run(docs, 512, 30)
    n = len(docs)
    for b, _, state in out:
        queued = [p for q in state["queues"] for p, _ in q] + [p for p, _ in state["held"]]
        # what waits belongs to the epoch being read (or, held, to the one just finished)
        assert all(p >= state["next_document"] - n for p in queued)


def test_without_outliers_the_stream_is_the_plain_one():
    docs = [Document(i, tuple(range(1, 2 + i % 7))) for i in range(60)]
    plain = list(mini_batches(docs, 40, 10))
    stream = DelayedMiniBatches(docs, 40, 10, 2, 2)
    # thresholds L/4, L/2 of the longest (7): lengths 3.. are outliers; with one queue of threshold
    # above every length nothing waits
    stream.wlb.thresholds = [100]
    got = [stream.next_batch() for _ in range(10)]
    assert [[d.index for d in b.docs] for b in got] == [[d.index for d in b.docs] for b in plain]
    assert [b.next_position for b in got] == [b.next_position for b in plain]


def test_restored_state_continues_exactly():
    docs = _docs(120, seed=4)
    full = list(delayed_mini_batches(docs, 400, 20, 2, 2))
    for cut in (3, 7, 13):
        state = json.loads(json.dumps(full[cut - 1][1]))   # what a checkpoint stores
        assert state["next_step"] == cut
        resumed = list(delayed_mini_batches(docs, 400, 20, 2, 2, state=state))
        assert [[d.index for d in b.docs] for b, _ in resumed] == [[d.index for d in b.docs] for b, _ in full[cut:]]
        assert [s for _, s in resumed] == [s for _, s in full[cut:]]
    assert any(full[c - 1][1]["pending"] > 0 for c in (3, 7, 13))


def test_restore_refuses_other_queues():
    docs = _docs(50)
    state = next(delayed_mini_batches(docs, 400, 5, 2, 2))[1]
    with pytest.raises(HGraphError, match="outlier queues"):
        DelayedMiniBatches(docs, 400, 5, 3, 2, state=state)
    with pytest.raises(HGraphError, match="no outlier delay"):
        DelayedMiniBatches(docs, 400, 5, 2, 2, state={"outlier_delay": False, "queues": []})


def test_mean_delay_on_the_builtin_like_data_is_small():
    docs = _docs(400, max_len=512, seed=0)
    batches = [b for b, _ in delayed_mini_batches(docs, 2048, 30, 2, 4)]
    delays = np.concatenate([b.delay_iters for b in batches])
    assert 0 < delays.mean() < 2


def test_release_size_is_one_per_rank_capped_by_what_a_step_holds():
    docs = [Document(0, tuple(range(1024))), Document(1, (1, 2))]
    assert release_size(docs, 8192, 4) == 4          # 8 documents of the longest fit: one per rank
    assert release_size(docs, 2048, 4) == 2          # only 2 fit a step
    assert release_size(docs, 1024, 4) == 1
