"""The fixed schedule's built-in dispatch and packing (``step_modes.dispatch_and_pack``), without processes:
an EP pipeline's micro-batches give every EP rank documents (``split_documents``) wherever the pipeline has
as many documents as EP ranks; dense pipelines pack first-fit-decreasing as before."""
from __future__ import annotations

import random

from hgraph.runtime.data.document_split import split_documents
from hgraph.runtime.data.documents import Document, first_fit
from hgraph.runtime.train.step_modes import dispatch_and_pack
from hgraph.strategy import Strategy


def _docs(lengths) -> list[Document]:
    return [Document(i, tuple(range(n))) for i, n in enumerate(lengths)]


def _ranks_without_documents(pipe, n: int) -> int:
    return sum(part == () for mb in pipe for part in split_documents([len(d) for d in mb], n))


def test_a_pp2_ep2_pipeline_gives_every_ep_rank_documents_in_every_microbatch():
    """1xTP1PP2EP2 over mini-batches of k >= 2 x micro-batches documents: no EP rank runs a placeholder.
    (First-fit under the default limit puts a long document alone in a micro-batch: the old rule left its
    second EP rank without a document in the first case.)"""
    strategy = Strategy.parse("1xTP1PP2EP2")
    rng = random.Random(0)
    cases = [[100, 10, 10, 10], [40, 30, 3, 2, 2], [9, 9, 9, 9, 9, 9]]
    cases += [[rng.choice((1, 2, 5, 30, 200)) for _ in range(rng.randint(4, 12))] for _ in range(40)]
    for lengths in cases:
        docs = _docs(lengths)
        (pipe,) = dispatch_and_pack(strategy, docs)
        assert len(pipe) >= 1 and all(len(mb) >= 2 for mb in pipe), lengths
        assert sorted(d.index for mb in pipe for d in mb) == list(range(len(docs)))    # each exactly once
        assert _ranks_without_documents(pipe, 2) == 0, (lengths, [[len(d) for d in mb] for mb in pipe])
    # about PP micro-batches where there are documents enough, as for a dense pipeline
    (pipe,) = dispatch_and_pack(strategy, _docs([9, 9, 9, 9, 9, 9]))
    assert len(pipe) == 2


def test_an_ep_pipeline_with_fewer_documents_than_ep_ranks_runs_them_in_one_microbatch():
    """Three documents on EP4: one micro-batch, its fourth EP rank without a document (the placeholder case
    stays reachable, and only there)."""
    for text in ("1xTP1PP1EP4", "1xTP1PP2EP4"):
        (pipe,) = dispatch_and_pack(Strategy.parse(text), _docs([13, 12, 2]))
        assert len(pipe) == 1 and _ranks_without_documents(pipe, 4) == 1


def test_an_ep_pipeline_keeps_a_given_microbatch_limit():
    """A user's micro-batch token limit wins over filling the EP ranks: first-fit's micro-batches stay."""
    (pipe,) = dispatch_and_pack(Strategy.parse("1xTP1PP2EP2"), _docs([10, 10, 10, 10]), microbatch_tokens=10)
    assert [[len(d) for d in mb] for mb in pipe] == [[10]] * 4
    (pipe,) = dispatch_and_pack(Strategy.parse("1xTP1PP2EP2"), _docs([10, 10, 10, 10]), microbatch_tokens=20)
    assert all(sum(len(d) for d in mb) <= 20 and len(mb) == 2 for mb in pipe)


def test_dense_pipelines_pack_first_fit_decreasing_as_before():
    """A pipeline without EP: longest first onto the pipeline with the fewest tokens per rank, then
    first-fit-decreasing into micro-batches of max(longest, tokens / PP) tokens, unchanged."""
    rng = random.Random(1)
    strategy = Strategy.parse("1xTP1PP2+1xTP1PP1EP2")
    for _ in range(20):
        docs = _docs([rng.randint(1, 300) for _ in range(rng.randint(2, 16))])
        dense = dispatch_and_pack(strategy, docs)[0]
        mine = [d for mb in dense for d in mb]
        if not mine:
            continue
        cap = max(max(len(d) for d in mine), -(-sum(len(d) for d in mine) // 2))
        expected = first_fit(sorted(mine, key=lambda d: (-len(d), d.index)), cap)
        assert dense == [sorted(b, key=lambda d: d.index) for b in expected]
