"""Attention of one context-parallel rank: its query tokens against the gathered keys of the CP group.

A packed micro-batch is split over the ``cp`` ranks of a CP group by a sharding plan
(``hgraph.runtime.kernels.cp_layout``: per-sequence or per-document). Each rank computes every
op on its own tokens; only attention needs the others' keys and values, which the Communicate
Activation subgraph all-gathers (pieces in CP-rank order). ``CPLayout`` says, for one micro-batch,
which packed tokens each rank holds and each token's document and position; ``cp_attention`` then
lets every local query attend to the gathered keys of the same document at positions up to its own
— exactly the causal attention of each document run alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from hgraph.varlen_attention import allowed_keys, masked_attention


@dataclass
class CPLayout:
    """Which tokens of a packed micro-batch each CP rank holds (indices into the packed sequence)."""

    cp_rank: int
    rank_tokens: tuple[tuple[int, ...], ...]
    doc_of: tuple[int, ...]
    pos_of: tuple[int, ...]
    _groups: Optional[dict] = field(default=None, repr=False)     # window -> groups

    @classmethod
    def from_plan(cls, plan, doc_lengths: Sequence[int], cp_rank: int) -> "CPLayout":
        """From a ``ShardingPlan`` (its ``ranks[i]`` lists rank i's shards) of documents of ``doc_lengths``."""
        doc_of, pos_of = [], []
        for d, length in enumerate(doc_lengths):
            doc_of.extend([d] * length)
            pos_of.extend(range(length))
        tokens = tuple(tuple(i for s in shards for i in range(*s.global_range)) for shards in plan.ranks)
        return cls(cp_rank, tokens, tuple(doc_of), tuple(pos_of))

    @classmethod
    def whole(cls, doc_lengths: Sequence[int]) -> "CPLayout":
        """One rank holding every packed token in order (the one CP shard of a Ulysses-only scheme)."""
        doc_of, pos_of = [], []
        for d, length in enumerate(doc_lengths):
            doc_of.extend([d] * length)
            pos_of.extend(range(length))
        return cls(0, (tuple(range(len(doc_of))),), tuple(doc_of), tuple(pos_of))

    @property
    def cp(self) -> int:
        return len(self.rank_tokens)

    @property
    def local_tokens(self) -> tuple[int, ...]:
        return self.rank_tokens[self.cp_rank]

    @property
    def sizes(self) -> list[int]:
        """Tokens per CP rank: the all-gather's piece sizes."""
        return [len(t) for t in self.rank_tokens]

    def groups(self, device: torch.device, window: Optional[int] = None
               ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per document held here: (local query rows, gathered key rows, causal mask [q, k], within
        ``window`` keys of the query when given)."""
        if self._groups is None:
            self._groups = {}
        if window not in self._groups:
            gathered = [i for t in self.rank_tokens for i in t]
            keys: dict[int, list[int]] = {}
            for row, i in enumerate(gathered):
                keys.setdefault(self.doc_of[i], []).append(row)
            queries: dict[int, list[int]] = {}
            for row, i in enumerate(self.local_tokens):
                queries.setdefault(self.doc_of[i], []).append(row)
            out = []
            for d, q_rows in queries.items():
                k_rows = keys[d]
                q_pos = torch.tensor([self.pos_of[self.local_tokens[r]] for r in q_rows])
                k_pos = torch.tensor([self.pos_of[gathered[r]] for r in k_rows])
                out.append((torch.tensor(q_rows, device=device), torch.tensor(k_rows, device=device),
                            allowed_keys(q_pos, k_pos, window).to(device)))
            self._groups[window] = out
        return self._groups[window]


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout,
                 scale: Optional[float] = None, enable_gqa: bool = False, softcap: Optional[float] = None,
                 window: Optional[int] = None) -> torch.Tensor:
    """Local queries ``q`` [1, H, T_local, D] against gathered ``k``/``v`` [1, Hkv, T_cp, D] (logit
    ``softcap`` and sliding ``window`` as in ``hgraph.varlen_attention``)."""
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    for q_rows, k_rows, mask in layout.groups(q.device, window):
        o = masked_attention(q[:, :, q_rows], k[:, :, k_rows], v[:, :, k_rows], mask, scale, enable_gqa, softcap)
        out = out.index_copy(2, q_rows, o)
    return out
