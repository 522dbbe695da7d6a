"""CP sharding plans: coverage, token and attention balance, adaptive choice."""
import pytest
from hypothesis import given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.runtime.kernels.cp_layout import (PER_DOCUMENT, PER_SEQUENCE, AttentionKernelModel, Shard,
                                              choose_sharding, per_document_plan, per_sequence_plan)


def _coverage(plan):
    """Every (doc, position) pair exactly once, and global positions consistent with offsets."""
    seen = {}
    for r, shards in enumerate(plan.ranks):
        for s in shards:
            g0, g1 = s.global_range
            assert g1 - g0 == s.num_tokens and g0 == s.offset + s.start
            for p in range(s.start, s.end):
                assert (s.doc, p) not in seen
                seen[(s.doc, p)] = r
    expected = {(d, p) for d, L in enumerate(plan.doc_lengths) for p in range(L)}
    assert set(seen) == expected


def _brute_pairs(plan, rank):
    return sum(p + 1 for s in plan.ranks[rank] for p in range(s.start, s.end))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(1, 4))
def test_both_plans_cover_every_token_once(lengths, cp):
    for plan in (per_sequence_plan(lengths, cp), per_document_plan(lengths, cp)):
        _coverage(plan)
        for r in range(cp):
            assert plan.attention_pairs_per_rank()[r] == _brute_pairs(plan, r)
            assert plan.position_ids(r) == [p for s in plan.ranks[r] for p in range(s.start, s.end)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(1, 4))
def test_per_document_token_counts_differ_by_at_most_one(lengths, cp):
    tokens = per_document_plan(lengths, cp).tokens_per_rank()
    assert max(tokens) - min(tokens) <= 1
    if sum(lengths) % cp == 0:
        assert len(set(tokens)) == 1  # no padding needed


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 4))
def test_per_document_equal_attention_when_divisible(units, cp):
    lengths = [u * 2 * cp for u in units]
    plan = per_document_plan(lengths, cp)
    assert len(set(plan.attention_pairs_per_rank())) == 1
    assert len(set(plan.tokens_per_rank())) == 1


def test_per_sequence_is_unbalanced_for_packed_documents():
    lengths = [49152, 16384]
    seq, doc = per_sequence_plan(lengths, 2), per_document_plan(lengths, 2)
    assert seq.attention_imbalance() > 1.5
    assert doc.attention_imbalance() == pytest.approx(1.0)
    # Rank 0 holds chunk 0 (document 0 head) and chunk 3 (document 1), rank 1 the middle of doc 0.
    assert [(s.doc, s.start, s.end) for s in seq.ranks[0]] == [(0, 0, 16384), (1, 0, 16384)]
    assert [(s.doc, s.start, s.end) for s in seq.ranks[1]] == [(0, 16384, 32768), (0, 32768, 49152)]


def test_kernel_tiles_pad_short_queries():
    k = AttentionKernelModel(tile=128)
    assert k.shard_tiles(Shard(0, 0, 1, 0)) == 1
    assert k.shard_tiles(Shard(0, 0, 128, 0)) == 1
    assert k.shard_tiles(Shard(0, 0, 256, 0)) == 1 + 2
    assert k.shard_tiles(Shard(0, 256, 300, 0)) == 3  # keys 0..299 -> 3 key tiles


def test_adaptive_choice():
    plan, est = choose_sharding([49152, 16384], 2)
    assert plan.method == PER_DOCUMENT and est[PER_DOCUMENT] < est[PER_SEQUENCE]
    plan, est = choose_sharding([100] * 64, 4)  # short documents: per-document pads every chunk
    assert plan.method == PER_SEQUENCE and est[PER_SEQUENCE] < est[PER_DOCUMENT]


def test_bad_input():
    with pytest.raises(HGraphError):
        per_document_plan([], 2)
    with pytest.raises(HGraphError):
        per_sequence_plan([10], 0)
