"""``split_documents``: which documents of an EP micro-batch each EP rank runs (``runtime/data/document_split``)."""
import itertools

import pytest

from hgraph.runtime.data.document_split import document_cost, split_documents


def test_whole_documents_each_once_balanced_longest_first():
    lengths = (13, 5, 9, 7, 11, 3)
    split = split_documents(lengths, 2)
    assert sorted(i for part in split for i in part) == list(range(6))
    assert all(list(part) == sorted(part) for part in split)
    # by hand, dearest first onto the least loaded: 13 -> r0, 11 -> r1, 9 -> r1, 7 -> r0, then 5 -> r1 (its
    # 11 + 9 cost a hair less than 13 + 7: the quadratic term), 3 -> r0
    assert split == ((0, 3, 5), (1, 2, 4))
    loads = [sum(document_cost(lengths[i]) for i in part) for part in split]
    assert max(loads) - min(loads) <= document_cost(max(lengths))
    assert split_documents(list(lengths), 2) == split     # a pure function of the lengths


def test_attention_cost_prefers_splitting_the_long_documents():
    """The quadratic term: one 8192-token document outweighs four 2048-token ones on token count alone
    (equal), but not by cost: the long one gets a rank to itself."""
    split = split_documents((2048, 2048, 8192, 2048, 2048), 2)
    assert split == ((2,), (0, 1, 3, 4))


def test_fewer_documents_than_ranks_leaves_ranks_without_documents():
    assert split_documents((100,), 4) == ((0,), (), (), ())
    assert split_documents((3, 9), 4) == ((1,), (0,), (), ())
    assert split_documents((), 2) == ((), ())
    assert split_documents((5, 6, 7), 1) == ((0, 1, 2),)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_greedy_is_never_worse_than_the_longest_document_past_the_ideal(n):
    for lengths in itertools.product((1, 4, 9, 30), repeat=5):
        split = split_documents(lengths, n)
        assert sorted(i for part in split for i in part) == list(range(5))
        loads = [sum(document_cost(lengths[i]) for i in part) for part in split]
        ideal = sum(map(document_cost, lengths)) / n
        assert max(loads) <= ideal + max(map(document_cost, lengths))


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_a_bad_rank_count_is_one_line(n):
    with pytest.raises(ValueError, match="positive integer"):
        split_documents((1, 2), n)
