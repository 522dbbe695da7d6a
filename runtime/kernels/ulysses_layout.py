"""Which tokens of a packed micro-batch a Ulysses rank holds, inside its CP shard (USP's 2-D).

A scheme with ``CP c`` and ``UL u`` splits a micro-batch twice: CP's balanced split
(``kernels/cp_layout``: per-document or per-sequence, the zigzag generalised to any ``c``) gives each CP
shard its tokens, and the ``u`` Ulysses ranks of a shard take contiguous, near-equal pieces of them
(``shard_bounds``: sizes differ by at most one token, for any ``u``). Ulysses attention runs on every
token of the shard, so its split only balances the tokens; the all-to-all gathers the pieces in
Ulysses-rank order, which is the shard's own token order. Without CP the shard is the whole micro-batch
(``CPLayout.whole``).
"""
from __future__ import annotations

from dataclasses import dataclass

from hgraph.runtime.kernels.cp_attention import CPLayout
from hgraph.shard_rule import shard_bounds, shard_sizes


@dataclass(frozen=True, eq=False)
class UlyssesLayout:
    """A Ulysses rank's tokens: piece ``ul_rank`` of ``ul`` of the CP shard ``shards.cp_rank``."""

    shards: CPLayout      # the CP split of the micro-batch; its ``cp_rank`` is this rank's shard
    ul: int
    ul_rank: int

    @property
    def shard_tokens(self) -> tuple[int, ...]:
        """The CP shard's packed tokens, in the order the all-to-all gathers them."""
        return self.shards.local_tokens

    @property
    def sizes(self) -> list[int]:
        """Tokens per Ulysses rank of the shard: the all-to-all's piece sizes."""
        return shard_sizes(len(self.shard_tokens), self.ul)

    @property
    def local_tokens(self) -> tuple[int, ...]:
        """The packed tokens this rank holds outside attention."""
        lo, hi = shard_bounds(len(self.shard_tokens), self.ul_rank, self.ul)
        return self.shard_tokens[lo:hi]

    @property
    def doc_of(self) -> tuple[int, ...]:
        """Each packed token's document (its place in the micro-batch)."""
        return self.shards.doc_of

    @property
    def pos_of(self) -> tuple[int, ...]:
        """Each packed token's position inside its document."""
        return self.shards.pos_of
