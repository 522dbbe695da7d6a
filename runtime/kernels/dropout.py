"""Dropout whose masks do not depend on the parallel strategy: a counter-based hash of what an
element *is*, not of where it runs.

An element's keep/drop decision is a hash of (run seed, step, dropout site, document index,
position inside the document, feature index) — for attention probabilities (…, head, query
position, key position) — never of the rank, the micro-batch, the packing or the CP split. A
document therefore gets the same masks under any strategy, and a recomputed block draws the same
masks again (no generator state to save). Megatron and torchtitan draw masks from per-rank
generators instead, so the same data trains differently under another layout.

The hash is a 32-bit integer mixer (Wellons' ``lowbias32`` shape, multipliers below 2**31 so every
product fits in int64 on any device) applied to the keys in turn; the top 24 bits give a uniform
``u`` in [0, 1) exactly representable in fp32; an element is kept when ``u >= p`` and scaled by
``1 / (1 - p)``, as ``torch.nn.functional.dropout`` does. Per-token and per-feature keys are mixed
separately and combined with one more round per element, so the cost per element is one mix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hgraph.varlen_attention import allowed_keys

_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of int64 values (each taken mod 2**32)."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def combine(h: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
    """``h`` with one more key mixed in."""
    return mix(h ^ mix(torch.as_tensor(key, dtype=torch.int64, device=h.device) + 0x9E3779B9))


def uniform(h: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1) from mixed keys (the top 24 of 32 bits)."""
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class TokenKeys:
    """What identifies the tokens of the micro-batch a rank is running (its local tokens, in order)."""

    seed: int
    step: int
    documents: torch.Tensor     # [T_local] int64: each token's document index in the corpus
    positions: torch.Tensor     # [T_local] int64: each token's position inside its document
    doc_ids: tuple = ()         # the micro-batch's documents (packed order) -> corpus index (CP keys)

    def narrow(self, lo: int, hi: int) -> "TokenKeys":
        """The keys of local tokens ``[lo, hi)`` (a TP rank's slice under sequence parallelism)."""
        return TokenKeys(self.seed, self.step, self.documents[lo:hi], self.positions[lo:hi], self.doc_ids)

    def of_packed(self, tokens: Sequence[int], doc_of: Sequence[int], pos_of: Sequence[int]) -> "TokenKeys":
        """The keys of the micro-batch's packed tokens ``tokens`` (each token's place in the micro-batch
        ``doc_of`` and position ``pos_of``, as a CP layout gives them): the tokens a Ulysses rank holds
        after its all-to-all."""
        docs = torch.tensor([self.doc_ids[doc_of[i]] for i in tokens], dtype=torch.int64)
        return TokenKeys(self.seed, self.step, docs, torch.tensor([pos_of[i] for i in tokens], dtype=torch.int64),
                         self.doc_ids)

    def base(self, site: int, device: torch.device) -> torch.Tensor:
        """Per-token keys for dropout site ``site``: [T_local] int64."""
        h = torch.full((), self.seed, dtype=torch.int64, device=device)
        for key in (self.step, site):
            h = combine(h, key)
        return combine(combine(h, self.documents.to(device)), self.positions.to(device))


def dropout(x: torch.Tensor, p: float, site: int, keys: TokenKeys, token_dim: int = 1) -> torch.Tensor:
    """Dropout of ``x`` (tokens along ``token_dim``; every other dim a feature, counted row-major)."""
    if p <= 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    tokens = x.shape[token_dim]
    if tokens != keys.documents.numel():
        raise AssertionError(f"dropout: {tokens} tokens, keys for {keys.documents.numel()}")
    moved = x.movedim(token_dim, 0)
    features = moved[0].numel()
    per_token = keys.base(site, x.device)                                   # [T]
    per_feature = mix(torch.arange(features, dtype=torch.int64, device=x.device) + 0x632BE5AB)   # [F]
    keep = uniform(mix(per_token[:, None] ^ per_feature[None, :])) >= p    # [T, F]
    keep = keep.view(moved.shape).movedim(0, token_dim)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def attention_keep(p: float, site: int, keys: TokenKeys, q_rows: torch.Tensor, k_docs: torch.Tensor,
                   k_pos: torch.Tensor, heads: int, head_offset: int) -> torch.Tensor:
    """Keep mask ``[heads, q, k]`` of attention probabilities: local query tokens ``q_rows`` (indices
    into the keys' local tokens) against keys of documents ``k_docs`` at positions ``k_pos``; global
    head ``head_offset + h``."""
    device = k_pos.device
    per_query = keys.base(site, device)[q_rows]                                              # [q]
    head = mix(torch.arange(head_offset, head_offset + heads, dtype=torch.int64, device=device) + 0x1B873593)
    hq = mix(head[:, None] ^ per_query[None, :])                                             # [H, q]
    per_key = mix(mix(k_docs.to(torch.int64) + 0x5BD1E995) ^ k_pos.to(torch.int64))         # [k]
    return uniform(mix(hq[:, :, None] ^ per_key[None, None, :])) >= p


def attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list, p: float, site: int,
                           keys: TokenKeys, scale: Optional[float], enable_gqa: bool,
                           head_offset: int, softcap: Optional[float] = None) -> torch.Tensor:
    """Causal attention per document with dropout on the probabilities (the math of SDPA's
    ``dropout_p``: softmax, drop, rescale, then the values), keyed per (document, head, query
    position, key position). ``groups``: per document, (query rows, key rows, causal mask [q, k],
    key document indices, key positions). q ``[1, H, Tq, D]``; k, v ``[1, Hkv, Tk, D]``; the scaled
    scores are capped to ``tanh(s / softcap) * softcap`` when ``softcap`` is given."""
    heads, hkv = q.shape[1], k.shape[1]
    if enable_gqa and hkv != heads:
        k, v = k.repeat_interleave(heads // hkv, dim=1), v.repeat_interleave(heads // hkv, dim=1)
    s = scale if scale is not None else q.shape[-1] ** -0.5
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    for q_rows, k_rows, causal, k_docs, k_pos in groups:
        scores = (q[0][:, q_rows] @ k[0][:, k_rows].transpose(-1, -2)) * s
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        keep = attention_keep(p, site, keys, q_rows, k_docs, k_pos, heads, head_offset)
        probs = probs * keep.to(probs.dtype) * (1.0 / (1.0 - p))
        out = out.index_copy(2, q_rows, (probs @ v[0][:, k_rows])[None])
    return out


def cp_groups(layout, keys: TokenKeys, device: torch.device, window: Optional[int] = None) -> list:
    """``attention_with_dropout``'s groups for a CP rank: its queries against the gathered keys
    (``CPLayout.groups``, within a sliding ``window`` when given), with the keys' corpus documents and
    positions."""
    gathered = [i for t in layout.rank_tokens for i in t]
    k_doc = torch.tensor([keys.doc_ids[layout.doc_of[i]] for i in gathered], dtype=torch.int64, device=device)
    k_pos = torch.tensor([layout.pos_of[i] for i in gathered], dtype=torch.int64, device=device)
    return [(q_rows, k_rows, mask, k_doc[k_rows], k_pos[k_rows]) for q_rows, k_rows, mask in layout.groups(device, window)]


def packed_groups(keys: TokenKeys, device: torch.device, window: Optional[int] = None) -> list:
    """``attention_with_dropout``'s groups for a packed row holding whole documents (no CP), within a
    sliding ``window`` when given."""
    docs, pos = keys.documents, keys.positions
    starts = [0] + [i for i in range(1, len(pos)) if int(pos[i]) == 0] + [len(pos)]
    out = []
    for a, b in zip(starts, starts[1:]):
        rows = torch.arange(a, b, device=device)
        p = pos[a:b].to(device)
        out.append((rows, rows, allowed_keys(p, p, window), docs[a:b].to(device), p))
    return out
