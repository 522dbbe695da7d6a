"""Which documents of a micro-batch each EP rank runs (``hgraph.dims.Splits.DOCUMENTS``).

An EP pipeline's micro-batch holds the documents of all its ``n`` EP ranks; each rank runs whole documents
of it (data parallel inside the pipeline) and they meet only in the experts' all-to-alls. The split is
one deterministic pure function of the lengths, so every rank of the pipeline computes the same one
without talking, and the planner prices an EP micro-batch by its slowest replica with the same function.

Balance by an attention-aware cost, ``len + len**2 / ATTENTION_TOKENS`` (a document's dense layers grow
with its length, its causal attention with its square): the documents, dearest first (ties by their place
in the micro-batch), each go to the least loaded rank (ties: the lowest). A micro-batch of at least ``n``
documents gives every rank one (the first ``n`` go to ``n`` empty ranks); a rank of a smaller one gets none and
runs a placeholder of one-token documents without targets (``engine.sequence_inputs.placeholder_documents``),
so that it takes part in the micro-batch's collectives: wasted work, which the fixed schedule's packing and
the planner's packer avoid by giving an EP micro-batch ``n`` documents wherever the pipeline has them.
"""
from __future__ import annotations

import heapq
from typing import Sequence

#: the length at which a document's attention costs as much as the rest of its layers, roughly: the
#: quadratic term's scale in the split's cost (a tie-breaker between near-equal splits, nothing more)
ATTENTION_TOKENS = 4096


def document_cost(length: int) -> float:
    """What one document of ``length`` tokens costs a rank in the split (``len + len**2 / c``)."""
    return length + length * length / ATTENTION_TOKENS


def split_documents(doc_lengths: Sequence[int], n: int) -> tuple[tuple[int, ...], ...]:
    """For each of ``n`` EP ranks, the places (0-based, ascending) in ``doc_lengths`` of the documents it
    runs: whole documents, every one exactly once, greedy longest-first onto the least loaded rank by
    ``document_cost``. ``n`` must be a positive integer."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"split_documents: the number of EP ranks must be a positive integer, got {n!r}")
    costs = [document_cost(l) for l in doc_lengths]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, r) for r in range(n)]       # (load, rank): the least loaded first, ties the lowest rank
    out: list[list[int]] = [[] for _ in range(n)]
    for i in order:
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return tuple(tuple(sorted(docs)) for docs in out)
