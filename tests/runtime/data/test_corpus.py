"""The data order (property tests): every document exactly once per epoch, in file order or a new seeded
permutation each epoch, with and without outlier delay, and across a resume; mixtures follow their weights."""
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.runtime.data.corpus import Corpus, DataOrder, corpus_of, parse_data_spec
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.data.outlier_delay import DelayedMiniBatches

SETTINGS = settings(max_examples=25, deadline=None)
lengths_st = st.lists(st.integers(2, 40), min_size=2, max_size=30)


def _docs(lengths):
    return [Document(i, tuple(range(1, n + 1))) for i, n in enumerate(lengths)]


@SETTINGS
@given(lengths=lengths_st, shuffle=st.booleans(), seed=st.integers(0, 3), epochs=st.integers(1, 3))
def test_every_epoch_is_a_permutation_and_a_resume_continues_it(lengths, shuffle, seed, epochs):
    docs = _docs(lengths)
    order = DataOrder(docs, shuffle=shuffle, seed=seed)
    n = len(docs)
    seq = [order.at(p).index for p in range(epochs * n)]
    for e in range(epochs):
        assert sorted(seq[e * n:(e + 1) * n]) == list(range(n))          # exactly once per epoch
    if not shuffle:
        assert seq == list(range(n)) * epochs
    budget = max(lengths) * 2
    steps = 2 * epochs * n
    full = list(mini_batches(docs, budget, steps, order=order))
    trained = [d.index for b in full for d in b.docs]
    assert trained == [DataOrder(docs, shuffle=shuffle, seed=seed).at(p).index for p in range(len(trained))]
    cut = steps // 2                                                      # a resume with a fresh order
    rest = list(mini_batches(docs, budget, steps, start_step=cut, start_position=full[cut - 1].next_position,
                             order=DataOrder(docs, shuffle=shuffle, seed=seed)))
    assert [[d.index for d in b.docs] for b in rest] == [[d.index for d in b.docs] for b in full[cut:]]


@SETTINGS
@given(lengths=st.lists(st.sampled_from([3, 5, 8, 60, 120]), min_size=4, max_size=24), shuffle=st.booleans(),
       seed=st.integers(0, 2), resume_at=st.integers(1, 10))
def test_outlier_delay_trains_each_document_once_per_epoch_across_a_resume(lengths, shuffle, seed, resume_at):
    docs = _docs(lengths + [120])          # an outlier (the queues' thresholds come from the longest)
    steps = 12
    stream = DelayedMiniBatches(docs, 160, steps, 2, 2, order=DataOrder(docs, shuffle=shuffle, seed=seed))
    batches, states = [], []
    while stream.step < steps:
        batches.append(stream.next_batch())
        states.append(stream.state())
    order = DataOrder(docs, shuffle=shuffle, seed=seed)
    read = Counter(order.at(p).index for p in range(stream.position))
    assert Counter(d.index for b in batches for d in b.docs) == read and stream.pending() == 0
    resumed = DelayedMiniBatches(docs, 160, steps, 2, 2, state=states[resume_at - 1],
                                 order=DataOrder(docs, shuffle=shuffle, seed=seed))
    again = [resumed.next_batch() for _ in range(resume_at, steps)]
    indices = lambda bs: [[d.index for d in b.docs] for b in bs]   # noqa: E731
    assert indices(again) == indices(batches[resume_at:])


@SETTINGS
@given(sizes=st.lists(st.integers(1, 12), min_size=2, max_size=4), raw=st.lists(st.integers(1, 9), min_size=4,
                                                                                 max_size=4),
       shuffle=st.booleans(), seed=st.integers(0, 2))
def test_a_mixture_follows_its_weights_and_reads_each_source_once_per_epoch(sizes, raw, shuffle, seed):
    weights = raw[:len(sizes)]
    parts = [_docs([2 + (i + k) % 5 for i in range(n)]) for k, n in enumerate(sizes)]
    corpus = corpus_of(parts, weights, [f"s{k}" for k in range(len(sizes))])
    order = DataOrder(corpus, shuffle=shuffle, seed=seed)
    total = 60
    picked = [order.source_of(p) for p in range(total)]
    counts = Counter(k for k, _ in picked)
    for k, w in enumerate(weights):
        assert abs(counts[k] - total * w / sum(weights)) <= 1.0 + 1e-9     # Megatron's blend: within one
        seq = [order.at(p).index - int(corpus.docs.starts[k]) for p in range(total) if picked[p][0] == k]
        n = sizes[k]
        for e in range(len(seq) // n):
            assert sorted(seq[e * n:(e + 1) * n]) == list(range(n))
    # deterministic under the seed, and a checkpoint's counts replay
    again = DataOrder(corpus, shuffle=shuffle, seed=seed)
    assert [again.at(p).index for p in range(total)][::-1] == [order.at(p).index for p in range(total)][::-1]
    state = order.state(37)
    assert sum(state["mixture"]["counts"]) == 37
    again.check_state({**state, "next_document": 37}, "ck")


def test_bad_mixtures_and_resumes_are_one_line():
    with pytest.raises(HGraphError, match="sum to zero"):
        parse_data_spec("0:a,0:b")
    with pytest.raises(HGraphError, match="is not WEIGHT:SOURCE"):
        parse_data_spec("0.5:a,x:b")
    assert [s.weight for s in parse_data_spec("0.7:a, 0.3:b")] == [0.7, 0.3]
    docs = _docs([3, 4, 5])
    order = DataOrder(Corpus(docs, [(0, 3, 1.0)], ["d"]), shuffle=True, seed=1)
    with pytest.raises(HGraphError, match="shuffled with seed 2"):
        order.check_state({"order": "shuffle", "seed": 2}, "ck")
    with pytest.raises(HGraphError, match="--no-shuffle"):
        order.check_state({"order": "file"}, "ck")
