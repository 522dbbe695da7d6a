"""A micro-batch: the documents one pipeline runs as one packed row.

The planner makes micro-batches (which documents, in which order) and the engine runs them, so the
type lives with the data both read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from hgraph.errors import HGraphError


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One packed row: documents concatenated (``input_ids [1, T]``) with per-document positions.

    The row is built when first read: only the ranks of the pipeline that runs it read its documents'
    tokens (a stored document's tokens stay in the memory map until then)."""

    doc_lengths: tuple[int, ...]
    doc_indices: tuple[int, ...] = ()
    sources: tuple = field(default=(), repr=False)    # each document's token ids (any int sequence)

    @classmethod
    def pack(cls, docs: Sequence[Sequence[int]], indices: Sequence[int] = ()) -> "MicroBatch":
        """Pack token lists into one row; positions restart at 0 for every document."""
        if not docs or any(len(d) == 0 for d in docs):
            raise HGraphError("a micro-batch needs at least one document and no empty document")
        return cls(tuple(len(d) for d in docs), tuple(indices), tuple(docs))

    @classmethod
    def placeholder(cls, n: int) -> "MicroBatch":
        """``n`` one-token documents of token 0 with corpus indices -1, -2, ... (``is_placeholder``): what an
        EP rank without a document of its micro-batch runs to take part in its collectives. A one-token
        document has no target, so the loss and every gradient through its tokens get exact zeros."""
        return cls((1,) * n, tuple(range(-1, -n - 1, -1)), ((0,),) * n)

    def select(self, places: Sequence[int]) -> "MicroBatch":
        """The micro-batch of the documents at ``places`` (0-based, in order) of this one: an EP rank's own
        (``runtime/data/document_split``). They keep their corpus indices (or, where this micro-batch has
        none, their places in it), so their dropout keys are the ones they have here."""
        ids = self.doc_indices or tuple(range(len(self.doc_lengths)))
        return MicroBatch(tuple(self.doc_lengths[i] for i in places), tuple(ids[i] for i in places),
                          tuple(self.sources[i] for i in places))

    @cached_property
    def input_ids(self) -> torch.Tensor:
        row = np.concatenate([np.asarray(d, dtype=np.int64) for d in self.sources])
        return torch.from_numpy(row)[None]

    @cached_property
    def position_ids(self) -> torch.Tensor:
        return torch.cat([torch.arange(n) for n in self.doc_lengths])[None]

    @property
    def tokens(self) -> int:
        return int(sum(self.doc_lengths))


def is_placeholder(doc_ids: Sequence[int]) -> bool:
    """Whether a micro-batch's corpus indices ``doc_ids`` are a placeholder's (``MicroBatch.placeholder``)."""
    return bool(doc_ids) and min(doc_ids) < 0
