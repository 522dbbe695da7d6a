"""The planner's start reads the corpus' lengths on rank 0 only: every rank used to turn the whole
corpus' lengths into a Python list (~36 bytes a document: 72 GB per rank for a 2T-token corpus) that
only rank 0's candidates and checks read. Rank 1 is run here without processes: it gets what rank 0
broadcast (recorded from rank 0's run) and must not read a length."""
import numpy as np
import pytest

from hgraph.frontends.zoo import llama
from hgraph.runtime.data.documents import Document
from hgraph.runtime.planner.service import iteration


class CountedLengths:
    """Documents whose ``lengths`` (what ``doc_lengths`` reads) count how often they are read."""

    def __init__(self, lengths):
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self.reads = 0

    @property
    def lengths(self):
        self.reads += 1
        return self._lengths

    def __len__(self):
        return self._lengths.size

    def __getitem__(self, i):
        return Document(i, (1,) * int(self._lengths[i]))


@pytest.mark.parametrize("strategies", ["auto", "4xTP1PP1;2xTP1PP2"])
def test_only_rank_0_reads_the_corpus_lengths(monkeypatch, strategies):
    model = llama.build("tiny")
    lengths = np.random.default_rng(0).integers(2, 200, size=400)
    broadcast, real = [], iteration._on_rank0

    def record(compute, rank):
        broadcast.append(real(compute, rank))
        return broadcast[-1]

    monkeypatch.setattr(iteration, "_on_rank0", record)
    docs0 = CountedLengths(lengths)
    p0 = iteration.IterationPlanner.create(strategies, "analytic", model, docs0, 1024, 0, 4)
    assert docs0.reads > 0
    given = iter(broadcast)
    monkeypatch.setattr(iteration, "_on_rank0", lambda compute, rank: next(given))
    docs1 = CountedLengths(lengths)
    p1 = iteration.IterationPlanner.create(strategies, "analytic", model, docs1, 1024, 1, 4)
    assert docs1.reads == 0
    assert p1.candidates == p0.candidates and p1.source == p0.source
