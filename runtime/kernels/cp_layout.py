"""Context-parallel sharding plans of one packed micro-batch (WLB-LLM §5) as data.

A packed micro-batch is the concatenation of documents; a CP group of ``cp`` ranks splits it so each
rank computes attention for its query tokens against the keys of the same document before them.

- *Per-sequence* sharding (the usual load-balanced ring split): cut the packed sequence into
  ``2*cp`` near-equal chunks; rank ``i`` takes chunks ``i`` and ``2*cp-1-i``. Balanced for one
  document, unbalanced when several documents are packed.
- *Per-document* sharding (WLB §5.1, padding-free): every document of length ``L`` is cut into
  ``2*cp`` chunks of ``D = L // (2*cp)`` tokens; rank ``i`` takes document chunks ``i`` and
  ``2*cp-1-i``; the ``L - 2*cp*D`` remainder tokens are dealt round-robin over the ranks, the deal
  continuing from document to document, so ranks differ by at most one token (none when the packed
  length divides by ``cp``) and nothing is padded.

A shard is a half-open token range of one document with its position inside the document (the
``position_ids`` and the causal key range) and inside the packed sequence. Attention work is
counted exactly: a query at document position ``p`` attends to ``p + 1`` keys.

Adaptive selection (WLB §5.3): an attention kernel processes each query range in tiles of ``tile``
(128) query rows times ``tile`` keys, padding partial tiles; its achieved throughput is lower for
short query ranges (no TMA multicast below ``full_rate_q`` query tokens). The CP latency of a plan is
the slowest rank's sum of ``FLOPs / throughput``; ``choose_sharding`` takes the faster plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError

PER_SEQUENCE = "per-sequence"
PER_DOCUMENT = "per-document"


@dataclass(frozen=True)
class Shard:
    """Tokens ``[start, end)`` of document ``doc``; ``offset`` is where the document starts in the pack."""

    doc: int
    start: int
    end: int
    offset: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def global_range(self) -> tuple[int, int]:
        """The shard's positions in the packed sequence."""
        return self.offset + self.start, self.offset + self.end

    @property
    def attention_pairs(self) -> int:
        """Causal (query, key) pairs: a query at document position p sees p + 1 keys."""
        s, e = self.start, self.end
        return (e * (e + 1) - s * (s + 1)) // 2


@dataclass(frozen=True)
class ShardingPlan:
    """Per CP rank, the shards it computes (queries), for one packed micro-batch."""

    method: str
    cp: int
    doc_lengths: tuple[int, ...]
    ranks: tuple[tuple[Shard, ...], ...]

    def tokens_per_rank(self) -> list[int]:
        return [sum(s.num_tokens for s in r) for r in self.ranks]

    def attention_pairs_per_rank(self) -> list[int]:
        return [sum(s.attention_pairs for s in r) for r in self.ranks]

    def attention_imbalance(self) -> float:
        """Max over mean of the per-rank attention work (1.0 = balanced)."""
        w = np.asarray(self.attention_pairs_per_rank(), dtype=np.float64)
        return float(w.max() / w.mean()) if w.sum() > 0 else 1.0

    def position_ids(self, rank: int) -> list[int]:
        """Document-local positions of the rank's tokens, in shard order."""
        return [p for s in self.ranks[rank] for p in range(s.start, s.end)]

    def to_dict(self) -> dict:
        return {"method": self.method, "cp": self.cp, "doc_lengths": list(self.doc_lengths),
                "ranks": [[{"doc": s.doc, "start": s.start, "end": s.end, "global": list(s.global_range)}
                           for s in r] for r in self.ranks]}


def _check(doc_lengths: Sequence[int], cp: int) -> tuple[list[int], list[int]]:
    if not isinstance(cp, (int, np.integer)) or cp < 1:
        raise HGraphError(f"CP degree must be a positive integer, got {cp!r}")
    lengths = [int(l) for l in doc_lengths]
    if not lengths or min(lengths) < 1:
        raise HGraphError(f"a packed micro-batch needs at least one document of positive length, got {lengths}")
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
    return lengths, offsets


def _split_range(lo: int, hi: int, lengths: list[int], offsets: list[int]) -> list[Shard]:
    """Shards of the packed positions ``[lo, hi)``, cut at document boundaries."""
    out = []
    d = int(np.searchsorted(np.asarray(offsets) + np.asarray(lengths), lo, side="right"))
    while lo < hi and d < len(lengths):
        start = lo - offsets[d]
        end = min(hi - offsets[d], lengths[d])
        if end > start:
            out.append(Shard(d, start, end, offsets[d]))
        lo = offsets[d] + end
        d += 1
    return out


def per_sequence_plan(doc_lengths: Sequence[int], cp: int) -> ShardingPlan:
    """Per-sequence sharding: ``2*cp`` near-equal chunks of the packed sequence, pairs ``(i, 2cp-1-i)``."""
    lengths, offsets = _check(doc_lengths, cp)
    total = sum(lengths)
    bounds = np.linspace(0, total, 2 * cp + 1).round().astype(int).tolist()
    ranks = []
    for i in range(cp):
        shards = []
        for c in (i, 2 * cp - 1 - i):
            shards += _split_range(bounds[c], bounds[c + 1], lengths, offsets)
        ranks.append(tuple(shards))
    return ShardingPlan(PER_SEQUENCE, int(cp), tuple(lengths), tuple(ranks))


def per_document_plan(doc_lengths: Sequence[int], cp: int) -> ShardingPlan:
    """Per-document, padding-free sharding (WLB §5.1)."""
    lengths, offsets = _check(doc_lengths, cp)
    ranks: list[list[Shard]] = [[] for _ in range(cp)]
    deal = 0  # round-robin pointer of remainder tokens, carried across documents
    for d, (L, off) in enumerate(zip(lengths, offsets)):
        D = L // (2 * cp)
        if D:
            for i in range(cp):
                for c in (i, 2 * cp - 1 - i):
                    ranks[i].append(Shard(d, c * D, (c + 1) * D, off))
        for p in range(2 * cp * D, L):
            ranks[deal % cp].append(Shard(d, p, p + 1, off))
            deal += 1
    merged = [tuple(_merge_adjacent(r)) for r in ranks]
    return ShardingPlan(PER_DOCUMENT, int(cp), tuple(lengths), tuple(merged))


def _merge_adjacent(shards: list[Shard]) -> list[Shard]:
    out: list[Shard] = []
    for s in shards:
        if out and out[-1].doc == s.doc and out[-1].end == s.start:
            out[-1] = Shard(s.doc, out[-1].start, s.end, s.offset)
        else:
            out.append(s)
    return out


@dataclass(frozen=True)
class AttentionKernelModel:
    """Latency estimate of a varlen causal attention kernel (WLB §5.2-5.3).

    ``flops_per_pair``: FLOPs of one (query, key) pair, forward and backward (``4 * hidden`` for the
    two forward GEMMs, times 3.5 with the backward: ``14 * hidden``). Throughputs are in TFLOP/s:
    ``peak_tflops`` for query ranges of at least ``full_rate_q`` tokens, ``short_q_tflops`` below
    (profiled; defaults follow WLB Fig. 10's H100 shape: about 2/3 of the rate without multicast).
    """

    hidden: int = 4096
    tile: int = 128
    peak_tflops: float = 400.0
    short_q_tflops: float = 270.0
    full_rate_q: int = 256
    flops_per_pair_factor: float = 14.0

    def shard_tiles(self, shard: Shard) -> int:
        """Tiles of ``tile x tile`` the kernel computes for one shard (causal, partial tiles padded)."""
        t = self.tile
        q_tiles = -(-shard.num_tokens // t)
        tiles = 0
        for k in range(q_tiles):
            q_end = min(shard.start + (k + 1) * t, shard.end)
            tiles += -(-q_end // t)  # key tiles up to the last query row of the tile
        return tiles

    def shard_ms(self, shard: Shard) -> float:
        flops = self.shard_tiles(shard) * self.tile * self.tile * self.flops_per_pair_factor * self.hidden
        rate = self.peak_tflops if shard.num_tokens >= self.full_rate_q else self.short_q_tflops
        return flops / (rate * 1e12) * 1e3

    def rank_ms(self, plan: ShardingPlan) -> list[float]:
        return [sum(self.shard_ms(s) for s in r) for r in plan.ranks]

    def plan_ms(self, plan: ShardingPlan) -> float:
        """CP attention latency: the slowest rank (the CP group is synchronous)."""
        return max(self.rank_ms(plan))


def choose_sharding(doc_lengths: Sequence[int], cp: int,
                    kernel: AttentionKernelModel = AttentionKernelModel()) -> tuple[ShardingPlan, dict[str, float]]:
    """The faster of per-sequence and per-document sharding for one micro-batch, with both estimates."""
    seq = per_sequence_plan(doc_lengths, cp)
    doc = per_document_plan(doc_lengths, cp)
    est = {PER_SEQUENCE: kernel.plan_ms(seq), PER_DOCUMENT: kernel.plan_ms(doc)}
    return (doc if est[PER_DOCUMENT] < est[PER_SEQUENCE] else seq), est
