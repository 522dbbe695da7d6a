"""Lazy documents: a token store (or several) seen as a sequence of ``Document``s whose tokens stay
on disk until a rank packs them.

``StoreDocuments`` holds only arrays (the store's memory-mapped lengths, or for a view that cuts long
documents, ``rows``/``starts``/``lengths``): ``len(docs[i])`` reads a length, ``docs[i].input_ids``
is a ``StoredTokens`` that reads the memory map when it is turned into an array. ``ConcatDocuments``
puts several sequences end to end (the sources of a mixture). Every such sequence has ``lengths``
(an integer array: what the planner reads) and ``fingerprint`` (what a checkpoint records).

``limit_long`` applies ``--long``: documents longer than the limit (the model's context, and the
step's token budget) are an error naming the first (``error``), cut to the limit (``truncate``), cut
into consecutive chunks of at most the limit, each its own document with positions from 0
(``split``), or left out (``drop``). A document's index is its position in the resulting sequence
(the file position unless ``split`` or ``drop`` changed the sequence).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.documents import Document, check_lengths, doc_lengths
from hgraph.runtime.data.token_store import TokenStore

LONG_MODES = ("error", "truncate", "split", "drop")


class StoredTokens(Sequence):
    """The tokens of one stored document (a slice of a store's ``.bin``), read when used."""

    __slots__ = ("store", "row", "start", "length")

    def __init__(self, store: TokenStore, row: int, start: int, length: int) -> None:
        self.store, self.row, self.start, self.length = store, int(row), int(start), int(length)

    def __len__(self) -> int:
        return self.length

    def array(self) -> np.ndarray:
        return self.store.tokens(self.row, self.start, self.length)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.array()
        return a.astype(dtype) if dtype is not None else np.array(a)

    def __getitem__(self, i: Any) -> Any:
        v = self.array()[i]
        return v.tolist() if isinstance(v, np.ndarray) else int(v)

    def __iter__(self):
        return iter(self.array().tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StoredTokens):
            return (self.store.prefix, self.row, self.start, self.length) == (
                other.store.prefix, other.row, other.start, other.length)
        return isinstance(other, Sequence) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash((self.store.prefix, self.row, self.start, self.length))

    def __repr__(self) -> str:
        return (f"StoredTokens({self.store.prefix!r}, row={self.row}, start={self.start}, "
                f"length={self.length})")


class StoreDocuments(Sequence):
    """The documents of a token store, or a view of them (rows, start offsets, lengths)."""

    def __init__(self, store: TokenStore, rows: Optional[np.ndarray] = None,
                 starts: Optional[np.ndarray] = None, lengths: Optional[np.ndarray] = None,
                 note: str = "") -> None:
        self.store = store
        self.rows, self.starts = rows, starts
        self.lengths = store.lengths if lengths is None else lengths
        self.note = note           # what the view changed (part of the fingerprint)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        row = i if self.rows is None else int(self.rows[i])
        start = 0 if self.starts is None else int(self.starts[i])
        return Document(i, StoredTokens(self.store, row, start, int(self.lengths[i])))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def fingerprint(self) -> str:
        return self.store.fingerprint + (f":{self.note}" if self.note else "")


class ConcatDocuments(Sequence):
    """Several document sequences end to end; document ``i`` of part ``k`` is ``starts[k] + i``."""

    def __init__(self, parts: Sequence[Sequence[Document]]) -> None:
        self.parts = list(parts)
        sizes = [len(p) for p in self.parts]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.lengths = np.concatenate([doc_lengths(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: Any) -> Document:
        i = int(i)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        d = self.parts[k][i - int(self.starts[k])]
        return Document(i, d.input_ids)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def fingerprint(self) -> str:
        return "concat:" + ",".join(fingerprint_of(p) for p in self.parts)


def fingerprint_of(docs: Sequence[Document]) -> str:
    """SHA-256 of the documents' tokens in order, or the stored sequence's own fingerprint (a resume
    must read the same data)."""
    own = getattr(docs, "fingerprint", None)
    if isinstance(own, str):
        return own
    h = hashlib.sha256()
    for d in docs:
        arr = np.asarray(d.input_ids, dtype=np.int64)
        h.update(np.int64(arr.size).tobytes())
        h.update(arr.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class LongReport:
    """What ``--long`` did: the mode, the limit, documents over it and what became of them."""

    mode: str
    limit: int
    long_documents: int = 0
    tokens_cut: int = 0          # truncate / drop: tokens not trained
    chunks: int = 0              # split: documents the long ones became

    def summary(self) -> str:
        if not self.long_documents:
            return f"long documents: none over {self.limit} tokens"
        what = {"truncate": f"truncated ({self.tokens_cut} tokens cut)",
                "drop": f"dropped ({self.tokens_cut} tokens)",
                "split": f"split into {self.chunks} documents"}[self.mode]
        return f"long documents: {self.long_documents} over {self.limit} tokens {what}"


def merge_reports(reports: Sequence[LongReport]) -> LongReport:
    """One report for the sources of a mixture."""
    first = reports[0]
    return LongReport(first.mode, first.limit, sum(r.long_documents for r in reports),
                      sum(r.tokens_cut for r in reports), sum(r.chunks for r in reports))


def limit_long(docs: Sequence[Document], tokens_per_iter: int, max_len: Optional[int],
               mode: str = "error") -> tuple[Sequence[Document], LongReport]:
    """``docs`` with ``--long mode`` applied to documents longer than the model's context ``max_len``
    or the step's budget ``tokens_per_iter``."""
    if mode not in LONG_MODES:
        raise HGraphError(f"--long {mode!r}: allowed are {', '.join(LONG_MODES)}")
    limit = min(tokens_per_iter, max_len) if max_len is not None else tokens_per_iter
    if mode == "error":
        check_lengths(docs, tokens_per_iter, max_len)
        return docs, LongReport(mode, limit)
    lengths = doc_lengths(docs)
    over = np.flatnonzero(lengths > limit)
    if over.size == 0:
        return docs, LongReport(mode, limit)
    cut = int((lengths[over] - limit).sum())
    if mode == "truncate":
        new_lengths = np.minimum(lengths, limit)
        rows, starts, report = np.arange(len(lengths)), np.zeros(len(lengths), np.int64), LongReport(
            mode, limit, int(over.size), tokens_cut=cut)
    elif mode == "drop":
        rows = np.flatnonzero(lengths <= limit)
        if rows.size == 0:
            raise HGraphError(f"--long drop: every document is longer than {limit} tokens; none is left")
        new_lengths, starts = lengths[rows], np.zeros(rows.size, np.int64)
        report = LongReport(mode, limit, int(over.size), tokens_cut=int(lengths[over].sum()))
    else:   # split
        pieces = -(-lengths // limit)
        rows = np.repeat(np.arange(len(lengths)), pieces)
        first = np.concatenate([[0], np.cumsum(pieces)[:-1]])
        chunk = np.arange(rows.size) - np.repeat(first, pieces)
        starts = chunk * limit
        new_lengths = np.minimum(lengths[rows] - starts, limit)
        report = LongReport(mode, limit, int(over.size), chunks=int(pieces[over].sum()))
    note = f"long={mode}:{limit}"
    if isinstance(docs, StoreDocuments) and docs.rows is None:
        return StoreDocuments(docs.store, rows.astype(np.int64), starts.astype(np.int64),
                              new_lengths.astype(np.int64), note), report
    out = []
    for j, (r, s, n) in enumerate(zip(rows.tolist(), starts.tolist(), new_lengths.tolist())):
        ids = docs[r].input_ids
        ids = ids.array() if isinstance(ids, StoredTokens) else ids
        out.append(Document(j, tuple(int(t) for t in ids[s:s + n])))
    return out, report
