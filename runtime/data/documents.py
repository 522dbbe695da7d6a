"""Training data: documents, a JSONL file of ``input_ids``, and the mini-batches of a run.

A ``Document`` is an index and its tokens: a tuple for documents held in memory (``read_jsonl``, one
JSON object per line with ``input_ids``; blank lines skipped), or ``StoredTokens`` for a document of a
token store (``hgraph.runtime.data.stored``), whose length is known without reading it and whose
tokens are read from the memory map only when a micro-batch is packed.

A mini-batch takes whole documents in the run's order (``hgraph.runtime.data.corpus.DataOrder``: file
order or a seeded permutation per epoch) until the next one would pass ``tokens_per_iter``
(``docs/architecture.md``, data order). When the data runs out before the last step, the next mini-batch starts a new epoch, so
any number of steps can be trained. With outlier delay (``--outlier-queues``) the stream is
``hgraph.runtime.data.outlier_delay``'s, which uses these types.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.jsonl import jsonl_values


@dataclass(frozen=True)
class Document:
    """One training document: its 0-based position in the data and its tokens (a tuple, or a lazy
    ``StoredTokens`` sequence that knows its length and reads the tokens when asked)."""

    index: int
    input_ids: Sequence[int]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class MiniBatch:
    """The documents of one training step (whole documents, file order)."""

    step: int
    docs: tuple[Document, ...]
    # documents consumed from the start of the run once this batch is taken (all epochs): the data
    # position a checkpoint stores, so a resumed run starts at exactly the next document
    next_position: int = 0
    # outlier delay (``hgraph.runtime.data.outlier_delay``): documents of this batch read in an earlier
    # step, documents read but not yet trained after it, and each document's delay in steps
    delayed: int = 0
    pending: int = 0
    delay_iters: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(len(d) for d in self.docs)

    @property
    def num_targets(self) -> int:
        """Next-token targets: a document of l tokens has l - 1 (``docs/architecture.md``, loss)."""
        return sum(max(len(d) - 1, 0) for d in self.docs)


def read_jsonl(path: Union[str, Path], vocab_size: Optional[int] = None) -> list[Document]:
    """The documents of a JSONL file; a malformed line raises HGraphError naming the file and line."""
    path = Path(path)
    docs: list[Document] = []
    for where, obj in jsonl_values(path, expect="each line must be an object with 'input_ids'"):
        ids = obj.get("input_ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise HGraphError(f"{where}: expected an object with 'input_ids' as a list of ints")
        if not ids:
            raise HGraphError(f"{where}: 'input_ids' is empty; a document needs at least one token")
        bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
        if bad is not None:
            allowed = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            raise HGraphError(f"{where}: token id {bad} is outside the vocabulary {allowed}")
        docs.append(Document(len(docs), tuple(ids)))
    if not docs:
        raise HGraphError(f"data file {str(path)!r} holds no documents")
    return docs


def doc_lengths(docs: Sequence[Document]) -> np.ndarray:
    """The documents' lengths as an int64 array (a stored sequence's ``lengths``: no token is read)."""
    lengths = getattr(docs, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))


#: documents whose lengths one pass of ``check_lengths`` compares at once: every rank scans the whole
#: corpus at its start, so its memory is this many (a few tens of MB), not the corpus' (an int64 copy of
#: every length and a mask, 9 bytes a document: 22 GB for a 2T-token corpus)
SCAN_CHUNK = 1 << 22


def longest_length(docs: Sequence[Document]) -> int:
    """The longest document's length; a stored sequence's lengths are read in chunks in their own dtype
    (every rank of an outlier-delayed run asks, and an int64 copy would cost 8 bytes a document)."""
    lengths = getattr(docs, "lengths", None)
    if lengths is None:
        return int(doc_lengths(docs).max())
    return max(int(np.max(lengths[start:start + SCAN_CHUNK])) for start in range(0, len(lengths), SCAN_CHUNK))


def check_lengths(docs: Sequence[Document], tokens_per_iter: int, max_len: Optional[int]) -> None:
    """Every document must fit a mini-batch and the model: one line naming the first that does not."""
    if tokens_per_iter < 1:
        raise HGraphError(f"--tokens-per-iter must be >= 1, got {tokens_per_iter}")
    lengths = getattr(docs, "lengths", None)       # a store's: scanned in its own dtype, chunk by chunk
    lengths = doc_lengths(docs) if lengths is None else lengths
    limit = min(tokens_per_iter, max_len) if max_len is not None else tokens_per_iter
    over = next((start + int(hits[0]) for start in range(0, len(lengths), SCAN_CHUNK)
                 if (hits := np.flatnonzero(np.asarray(lengths[start:start + SCAN_CHUNK]) > limit)).size), None)
    if over is not None:
        i = over
        n = int(lengths[i])
        if max_len is not None and n > max_len:
            raise HGraphError(f"document {i} has {n} tokens, longer than the {max_len} the model supports "
                              "(its max_seq_len); --long truncate|split|drop handles such documents")
        raise HGraphError(f"document {i} has {n} tokens, more than --tokens-per-iter {tokens_per_iter}: a "
                          "mini-batch holds whole documents (--long truncate|split|drop handles such "
                          "documents)")


def first_fit(docs: Sequence[Document], cap: int) -> list[list[Document]]:
    """Documents, in the order given (longest first for first-fit-decreasing), into bins of at most
    ``cap`` tokens: each goes to the first bin with room, else opens a new one."""
    bins: list[list[Document]] = []
    room: list[int] = []
    for d in docs:
        j = next((j for j, r in enumerate(room) if r >= len(d)), None)
        if j is None:
            bins.append([d])
            room.append(cap - len(d))
        else:
            bins[j].append(d)
            room[j] -= len(d)
    return bins


def mini_batches(docs: Sequence[Document], tokens_per_iter: int, steps: int, *, start_step: int = 0,
                 start_position: int = 0, order: Any = None) -> Iterator[MiniBatch]:
    """The mini-batches of steps ``start_step .. steps-1``: whole documents in the run's order
    (``order.at(position)``, a ``hgraph.runtime.data.corpus.DataOrder``; default file order, wrapping
    around at the end), the first one at position ``start_position`` (documents consumed so far, all
    epochs counted: a checkpoint's data position).

    Raises HGraphError for a mini-batch without any target (only one-token documents): its loss
    (a sum over no targets divided by zero) is undefined.
    """
    if not docs:
        raise HGraphError("no documents to train on")
    at = order.at if order is not None else (lambda p: docs[p % len(docs)])
    pos = start_position
    for step in range(start_step, steps):
        taken: list[Document] = []
        seen: set[int] = set()
        total = 0
        while True:
            d = at(pos)
            if taken and (total + len(d) > tokens_per_iter or d.index in seen):
                break       # full, or the same document again (tiny data): never twice in one mini-batch
            if len(d) > tokens_per_iter:
                raise HGraphError(f"document {d.index} has {len(d)} tokens, more than --tokens-per-iter "
                                  f"{tokens_per_iter}: a mini-batch holds whole documents")
            taken.append(d)
            seen.add(d.index)
            total += len(d)
            pos += 1
        batch = MiniBatch(step, tuple(taken), pos)
        if batch.num_targets == 0:
            raise HGraphError(f"step {step}: the mini-batch (documents {[d.index for d in taken]}) is empty of "
                              "targets (only one-token documents); the loss is undefined")
        yield batch
