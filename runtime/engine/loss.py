"""The training loss of hgraph: next-token cross-entropy inside each document of a packed row.

A document of ``l`` tokens has ``l - 1`` targets (its last token predicts nothing: the next token
belongs to another document). ``packed_loss_sum`` returns the SUM over the micro-batch's targets;
the caller divides by ``num_targets`` of the whole mini-batch, so any packing and any micro-batch
split give the same loss and gradient as one device on the whole mini-batch (``docs/architecture.md``, loss).

A last stage whose graph ends in the output head (``ops.output_head``) hands the runtime the head's
inputs instead of logits (``ops.HeadInputs``); ``stage_loss_sum`` then computes the same sum chunk by
chunk and vocabulary-parallel under TP (``runtime/kernels/head_cross_entropy``), so the whole
``[tokens, vocab]`` fp32 logits are never held.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from hgraph.errors import HGraphError
from hgraph.ops import HeadInputs
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.kernels.head_cross_entropy import VocabSplit, head_cross_entropy_sum
from hgraph.varlen_attention import CuSeqlens, boundaries

IGNORE_INDEX = -100


def num_targets(doc_lengths: Sequence[int]) -> int:
    """The number of next-token targets of documents of these lengths: sum of ``max(l - 1, 0)``."""
    return sum(max(int(n) - 1, 0) for n in doc_lengths)


def packed_targets(input_ids: torch.Tensor, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Targets ``[1, T]``: the next token of the same document, ``IGNORE_INDEX`` at each document end."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise HGraphError(f"packed loss expects input_ids of shape [1, T], got {list(input_ids.shape)}")
    cu = boundaries(cu_seqlens, input_ids.shape[1])
    targets = torch.roll(input_ids, -1, dims=1)
    ends = torch.tensor([b - 1 for a, b in zip(cu, cu[1:]) if b > a], dtype=torch.long,
                        device=input_ids.device)
    targets[0, ends] = IGNORE_INDEX
    return targets


def packed_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Summed next-token cross-entropy over every document of the packed row (fp32 scalar).

    ``logits``: ``[1, T, V]``; ``input_ids``: ``[1, T]``; ``cu_seqlens``: document boundaries.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise HGraphError(f"packed loss: logits {list(logits.shape)} must be [1, T, V] for input_ids "
                          f"{list(input_ids.shape)}")
    targets = packed_targets(input_ids, cu_seqlens)
    # lower-precision logits are upcast: the sum over many tokens needs fp32
    return F.cross_entropy(logits[0].float(), targets[0], ignore_index=IGNORE_INDEX, reduction="sum")


def stage_loss_sum(out: Union[torch.Tensor, HeadInputs], targets: torch.Tensor,
                   comm: Optional[CommContext] = None,
                   chunk: Optional[int] = None) -> torch.Tensor:
    """Summed next-token cross-entropy of a last stage's output against ``targets`` ``[1, T]``
    (``IGNORE_INDEX`` where a token has none): from logits ``[1, T, V]``, or ``chunk`` tokens at a time
    (default: by the vocabulary's size) from the output head's inputs (``HeadInputs``; ``comm`` gives
    the TP group a split vocabulary lies on, and whether its loss is vocabulary-parallel)."""
    if not isinstance(out, HeadInputs):
        if out.dim() != 3 or out.shape[:2] != targets.shape:
            raise HGraphError(f"packed loss: logits {list(out.shape)} must be [1, T, V] for targets "
                              f"{list(targets.shape)}")
        return F.cross_entropy(out[0].float(), targets[0], ignore_index=IGNORE_INDEX, reduction="sum")
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])
    if hidden.shape[0] != targets.numel():
        raise HGraphError(f"packed loss: output head input {list(out.hidden.shape)} does not match targets "
                          f"{list(targets.shape)}")
    split = None
    if out.piece_ranks:
        members = sorted(out.piece_ranks)      # the group's rank order; each member's piece is its place
        order = tuple(out.piece_ranks.index(r) for r in members)
        split = VocabSplit(comm.groups.get(members), order, out.vocab, comm.vocab_parallel_loss, comm.issuer)
    return head_cross_entropy_sum(hidden, out.weight, out.bias, targets.reshape(-1),
                                  ignore_index=IGNORE_INDEX, vocab_start=out.vocab_start,
                                  vocab_local=out.vocab_local, split=split, chunk=chunk)
