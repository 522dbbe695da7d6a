"""A micro-batch as one rank of its pipeline runs it: the documents of its EP rank (``own_documents``:
``runtime/data/document_split``), of those the tokens of its place in the sequence dimensions (CP's
balanced split into shards, each cut contiguously over the Ulysses ranks), with their positions, the
whole documents' next-token targets, the dropout keys and the document boundaries packed attention
reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from hgraph.errors import HGraphError
from hgraph.ops import HeadInputs
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.data.document_split import split_documents
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.loss import packed_targets, stage_loss_sum
from hgraph.runtime.engine.memory import SequenceLayout
from hgraph.runtime.kernels.cp_attention import CPLayout
from hgraph.runtime.kernels.cp_layout import (PER_DOCUMENT, PER_SEQUENCE, choose_sharding, per_document_plan,
                                              per_sequence_plan)
from hgraph.runtime.kernels.dropout import TokenKeys
from hgraph.runtime.kernels.ulysses_layout import UlyssesLayout
from hgraph.strategy import Scheme
from hgraph.varlen_attention import DocumentBounds, cu_seqlens_for

ADAPTIVE = "adaptive"
CP_SHARDINGS = (ADAPTIVE, PER_DOCUMENT, PER_SEQUENCE)


def cp_layout_for(mb: "MicroBatch", cp: int, cp_rank: int, method: str = ADAPTIVE) -> CPLayout:
    """How a micro-batch is split over a CP group: per-document or per-sequence sharding, whichever
    the attention-kernel estimate says is faster (WLB-LLM §5.3), unless ``method`` forces one."""
    if method == PER_DOCUMENT:
        plan = per_document_plan(mb.doc_lengths, cp)
    elif method == PER_SEQUENCE:
        plan = per_sequence_plan(mb.doc_lengths, cp)
    elif method == ADAPTIVE:
        plan, _ = choose_sharding(mb.doc_lengths, cp)
        if min(plan.tokens_per_rank()) == 0:     # a short micro-batch: per-sequence chunks may be empty
            plan = per_document_plan(mb.doc_lengths, cp)
    else:
        raise HGraphError(f"CP sharding {method!r}: expected one of {', '.join(CP_SHARDINGS)}")
    if min(plan.tokens_per_rank()) == 0:
        raise HGraphError(f"a micro-batch of {mb.tokens} tokens leaves a rank of CP{cp} without tokens "
                          f"({plan.method} sharding); give CP micro-batches at least {cp} tokens")
    return CPLayout.from_plan(plan, mb.doc_lengths, cp_rank)


def own_documents(mb: MicroBatch, scheme: Scheme, doc_rank: int) -> MicroBatch:
    """The part of an EP pipeline's micro-batch that EP rank ``doc_rank`` runs: its documents by
    ``split_documents``; the micro-batch itself without EP. A rank the split gives no document runs a
    placeholder (``placeholder_documents``), so that it takes part in every collective of the micro-batch."""
    if scheme.doc_ranks == 1:
        return mb
    places = split_documents(mb.doc_lengths, scheme.doc_ranks)[doc_rank]
    return mb.select(places) if places else placeholder_documents(scheme)


def placeholder_documents(scheme: Scheme) -> MicroBatch:
    """What an EP rank without a document runs: ``2 * tp * seq`` one-token documents (``MicroBatch.placeholder``),
    so each TP and sequence rank holds a token at least, under any CP sharding (the per-sequence zigzag cuts
    ``2 * cp`` chunks). Why not zero tokens: a model reshaping by ``view(batch, tokens, -1, head_dim)`` (the
    zoo's Llama, Hugging Face's attention) cannot infer the -1 of an empty tensor."""
    return MicroBatch.placeholder(2 * scheme.tp * scheme.seq)


def sequence_layout(mb: "MicroBatch", scheme: Scheme, seq_rank: int, method: str = ADAPTIVE) -> SequenceLayout:
    """The tokens of ``mb`` that sequence rank ``seq_rank`` holds: CP's split (``cp_layout_for``) into
    ``scheme.cp`` shards, each cut contiguously over ``scheme.ul`` Ulysses ranks (Ulysses inner)."""
    shard, ul_rank = scheme.seq_place(seq_rank)
    shards = cp_layout_for(mb, scheme.cp, shard, method) if scheme.cp > 1 else CPLayout.whole(mb.doc_lengths)
    return shards if scheme.ul == 1 else UlyssesLayout(shards, scheme.ul, ul_rank)


def token_documents(mb: "MicroBatch") -> torch.Tensor:
    """Each packed token's document index in the corpus (its place in the micro-batch if unknown)."""
    ids = mb.doc_indices or tuple(range(len(mb.doc_lengths)))
    return torch.repeat_interleave(torch.tensor(ids, dtype=torch.long), torch.tensor(mb.doc_lengths))


def microbatch_inputs(mb: MicroBatch, scheme: Scheme, seq_rank: int, cp_sharding: str, seed: int, step: int
                      ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[SequenceLayout],
                                 TokenKeys]:
    """Sequence rank ``seq_rank``'s ``input_ids``, ``position_ids`` and (with a sequence split) targets of
    ``mb``, with its layout (None without a split) and the dropout keys of its tokens at ``step``."""
    ids, pos, targets, layout = mb.input_ids, mb.position_ids, None, None
    docs = token_documents(mb)
    if scheme.seq > 1:   # this CP / Ulysses rank's tokens; targets stay those of the whole documents
        layout = sequence_layout(mb, scheme, seq_rank, cp_sharding)
        local = torch.tensor(layout.local_tokens, dtype=torch.long)
        cu = cu_seqlens_for(mb.doc_lengths)
        ids, pos, docs = ids[:, local], pos[:, local], docs[local]
        targets = packed_targets(mb.input_ids, cu)[:, local]
    keys = TokenKeys(seed, step, docs, pos[0], mb.doc_indices or tuple(range(len(mb.doc_lengths))))
    return ids, pos, targets, layout, keys


def document_bounds(mb: MicroBatch, layout: Optional[SequenceLayout], scheme: Scheme, device: torch.device
                    ) -> Optional[DocumentBounds]:
    """The micro-batch's document boundaries for packed attention, on the host and copied to the
    device once, where attention runs on the whole micro-batch: without a sequence split, and on a
    Ulysses rank without CP (after its all-to-all). A CP rank's attention, under Ulysses too, takes
    its layout instead: None."""
    whole = layout is None or (scheme.ul > 1 and scheme.cp == 1)
    return DocumentBounds.of(mb.doc_lengths, device) if whole else None


@dataclass(frozen=True)
class MicroBatchFeed:
    """What one rank's graph is fed for a micro-batch of one step: its inputs at its sequence rank
    (``microbatch_inputs``), the document boundaries, tensors moved to its device, the loss of its output."""

    scheme: Scheme
    seq_rank: int
    cp_sharding: str
    seed: int
    step: int
    device: torch.device
    #: its EP rank (``RankCoord.doc_rank``): which documents of each micro-batch it runs
    doc_rank: int = 0

    def own(self, mb: MicroBatch) -> MicroBatch:
        """The documents of ``mb`` this rank runs (``own_documents``)."""
        return own_documents(mb, self.scheme, self.doc_rank)

    def inputs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                                Optional[SequenceLayout], TokenKeys]:
        return microbatch_inputs(mb, self.scheme, self.seq_rank, self.cp_sharding, self.seed, self.step)

    def documents(self, mb: MicroBatch, layout: Optional[SequenceLayout]) -> Optional[DocumentBounds]:
        return document_bounds(mb, layout, self.scheme, self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without waiting for the GPU (a copy from pageable memory waits
        for the stream; one from pinned memory is queued)."""
        if self.device.type != "cuda" or t.is_cuda:
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def loss_sum(self, out: Union[torch.Tensor, HeadInputs], ids: torch.Tensor, targets: Optional[torch.Tensor],
                 mb: MicroBatch, comm: CommContext) -> torch.Tensor:
        """The summed next-token cross-entropy of the last stage's output ``out`` (logits, or the
        output head's inputs: ``engine.loss.stage_loss_sum``)."""
        if targets is None:
            targets = packed_targets(ids, cu_seqlens_for(mb.doc_lengths))
        return stage_loss_sum(out, self.to_device(targets), comm)
