"""A run's corpus and the order its documents are trained in.

``--data`` names one source or a weighted mixture ``"0.7:A,0.3:B"`` (``parse_data_spec``). A source
is a token store prefix (``PREFIX.idx`` + ``PREFIX.bin``, ``hgraph.runtime.data.token_store``) or a
JSONL file of ``input_ids`` (read into memory, the small-data path); raw text (JSONL ``text``,
parquet, a ``datasets`` folder) is converted to a store before the run starts
(``hgraph.runtime.data.prepare.resolve_raw_sources``), so every rank reads a store.

``open_corpus`` gives ``Corpus``: every document of every source end to end (``docs``; a document's
index is its position there) and the sources' extents and weights.

``DataOrder`` maps a position (documents read since the run's start, all epochs) to a document:

* one source: epoch ``e = position // n`` and slot ``position % n``; the slot is the document itself
  (file order) or, with ``shuffle``, slot ``k`` of a permutation drawn from ``(seed, 0, e)``, a new
  one each epoch. Every document is read exactly once per epoch.
* a mixture: Megatron's blend. Position ``p`` reads from the source ``k`` whose count lags its
  weight most (``argmax_k w_k (p + 1) - c_k``, ties to the first), then that source's next
  document in its own order (its epochs and permutations, seeds ``(seed, k, e)``). Deterministic
  under the seed; each source's documents are read exactly once per epoch of that source.

``state(position)`` is the JSON a checkpoint keeps (epoch, shuffle and seed, per-source counts and
epochs); ``check_state`` refuses a resume whose order would differ.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.documents import Document, read_jsonl
from hgraph.runtime.data.stored import ConcatDocuments, StoreDocuments, fingerprint_of
from hgraph.runtime.data.token_store import is_store, open_store


@dataclass(frozen=True)
class SourceSpec:
    """One ``--data`` source and its mixture weight (1 for a single source)."""

    path: str
    weight: float = 1.0


def parse_data_spec(text: str) -> list[SourceSpec]:
    """``"SRC"`` or ``"W1:SRC1,W2:SRC2"`` -> sources (HGraphError for weights that do not parse, are
    negative or sum to zero)."""
    text = str(text).strip()
    if not text:
        raise HGraphError("--data is empty: give a token store prefix, a JSONL file or 'W1:SRC1,W2:SRC2'")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1 and not _weighted(parts[0]):
        return [SourceSpec(parts[0])]
    out = []
    for part in parts:
        w, sep, path = part.partition(":")
        try:
            weight = float(w) if sep else math.nan
        except ValueError:
            weight = math.nan
        if not sep or not path.strip() or not math.isfinite(weight) or weight < 0:
            raise HGraphError(f"--data {text!r}: {part!r} is not WEIGHT:SOURCE with a weight >= 0 "
                              "(a mixture is 'W1:SRC1,W2:SRC2', e.g. '0.7:web,0.3:code')")
        out.append(SourceSpec(path.strip(), weight))
    if sum(s.weight for s in out) <= 0:
        raise HGraphError(f"--data {text!r}: the mixture weights sum to zero; at least one must be > 0")
    return out


def _weighted(part: str) -> bool:
    w, sep, _ = part.partition(":")
    if not sep:
        return False
    try:
        float(w)
    except ValueError:
        return False
    return True


def format_data_spec(sources: Sequence[SourceSpec]) -> str:
    if len(sources) == 1 and sources[0].weight == 1.0:
        return sources[0].path
    return ",".join(f"{s.weight:g}:{s.path}" for s in sources)


def open_source(path: str, vocab_size: Optional[int] = None, *, verify: bool = False) -> Sequence[Document]:
    """The documents of one source: a token store (lazy) or a JSONL file of ``input_ids`` (in memory).
    ``vocab_size``: the model's; a token at or beyond it is an error naming the document."""
    p = str(path)
    if is_store(p) or p.endswith(".idx"):
        store = open_store(p[:-4] if p.endswith(".idx") else p, verify=verify)
        if vocab_size is not None and store.max_token_id >= vocab_size:
            pos, token = store.first_token_at_least(vocab_size)
            i = int(np.searchsorted(store.offsets, pos, side="right")) - 1
            raise HGraphError(f"token store {store.prefix}: document {i} holds token id {token}, beyond the "
                              f"model's vocabulary [0, {vocab_size}) (ids up to {store.max_token_id})")
        return StoreDocuments(store)
    if Path(p).is_file() and p.endswith((".jsonl", ".json")):
        return read_jsonl(p, vocab_size)
    if Path(p).exists():
        raise HGraphError(f"--data {p!r}: neither a token store prefix (PREFIX.idx + PREFIX.bin) nor a "
                          "JSONL file of input_ids; raw text is converted with --tokenizer or hgraph "
                          "prepare-data")
    raise HGraphError(f"--data {p!r}: no such token store ({p}.idx) or file")


@dataclass
class Corpus:
    """Every document of the run's sources end to end, and the sources (start, size, weight)."""

    docs: Sequence[Document]
    parts: list[tuple[int, int, float]]
    names: list[str]

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self.docs)

    @property
    def weights(self) -> list[float]:
        return [w for _, _, w in self.parts]


def corpus_of(parts: Sequence[Sequence[Document]], weights: Sequence[float], names: Sequence[str]) -> Corpus:
    if len(parts) == 1:
        return Corpus(parts[0], [(0, len(parts[0]), float(weights[0]))], list(names))
    docs = ConcatDocuments(parts)
    extents = [(int(docs.starts[k]), len(p), float(w)) for k, (p, w) in enumerate(zip(parts, weights))]
    return Corpus(docs, extents, list(names))


class DataOrder:
    """Position -> document."""

    def __init__(self, corpus: Union[Corpus, Sequence[Document]], *, shuffle: bool = False,
                 seed: int = 0) -> None:
        if not isinstance(corpus, Corpus):
            corpus = Corpus(corpus, [(0, len(corpus), 1.0)], ["data"])
        if not len(corpus.docs):
            raise HGraphError("no documents to train on")
        self.corpus, self.docs, self.shuffle, self.seed = corpus, corpus.docs, bool(shuffle), int(seed)
        self.parts = [(s, n, w) for s, n, w in corpus.parts]
        self.mixed = len(self.parts) > 1
        if self.mixed and any(n == 0 for _, n, w in self.parts if w > 0):
            raise HGraphError("a mixture source with a weight > 0 has no documents")
        total = sum(w for _, _, w in self.parts)
        self.weights = [w / total for _, _, w in self.parts]
        self._perms: OrderedDict = OrderedDict()
        self._cursor = (0, [0] * len(self.parts))        # (position, per-source counts before it)
        self._recent: OrderedDict = OrderedDict()        # position -> (source, count): looking back

    def copy(self) -> "DataOrder":
        """The same order, with its own cursor (another reader of the stream: the planner process)."""
        return DataOrder(self.corpus, shuffle=self.shuffle, seed=self.seed)

    @property
    def epoch_size(self) -> int:
        """Documents of one pass over the data (all sources)."""
        return len(self.docs)

    # -- one source's order ----------------------------------------------------------------------
    def _perm(self, k: int, epoch: int) -> np.ndarray:
        key = (k, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([self.seed, k, epoch]).permutation(self.parts[k][1])
            self._perms[key] = perm
            while len(self._perms) > 2 * len(self.parts) + 2:   # the current and previous epochs
                self._perms.popitem(last=False)
        return perm

    def _slot(self, k: int, count: int) -> int:
        start, n, _ = self.parts[k]
        epoch, slot = divmod(count, n)
        return start + (int(self._perm(k, epoch)[slot]) if self.shuffle else slot)

    # -- the mixture -----------------------------------------------------------------------------
    def _counts_at(self, position: int) -> list[int]:
        """Documents read from each source before ``position`` (the blend replayed from the nearest
        point; a resume replays it once)."""
        pos, counts = self._cursor
        if position < pos:
            pos, counts = 0, [0] * len(self.parts)
        counts = list(counts)
        w = self.weights
        while pos < position:
            k = self._pick(pos, counts, w)
            counts[k] += 1
            pos += 1
        self._cursor = (pos, counts)
        return list(counts)

    @staticmethod
    def _pick(pos: int, counts: list[int], w: list[float]) -> int:
        best, err = 0, -math.inf
        for k, wk in enumerate(w):
            e = wk * (pos + 1) - counts[k]
            if e > err:
                best, err = k, e
        return best

    def source_of(self, position: int) -> tuple[int, int]:
        """(source, that source's count) of the document at ``position``."""
        if not self.mixed:
            return 0, position
        hit = self._recent.get(position)
        if hit is not None:
            return hit
        counts = self._counts_at(position)
        k = self._pick(position, counts, self.weights)
        self._recent[position] = (k, counts[k])
        while len(self._recent) > 1 << 16:     # documents held by outlier delay look back this far at most
            self._recent.popitem(last=False)
        return k, counts[k]

    def at(self, position: int) -> Document:
        k, count = self.source_of(int(position))
        return self.docs[self._slot(k, count)]

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self, position: int) -> dict:
        """The order's part of a checkpoint's data position before ``position``."""
        n = self.epoch_size
        out = {"order": "shuffle" if self.shuffle else "file", "seed": self.seed, "epoch": position // n,
               "index_in_epoch": position % n}
        if self.mixed:
            counts = self._counts_at(position)
            out["mixture"] = {"weights": self.weights, "sources": self.corpus.names, "counts": counts,
                              "epochs": [c // n for c, (_, n, _) in zip(counts, self.parts)]}
        return out

    def check_state(self, saved: dict, folder: str) -> None:
        """A resume continues this order: same shuffle, seed and mixture weights (one-line HGraphError)."""
        order = saved.get("order", "file")
        if order != ("shuffle" if self.shuffle else "file"):
            raise HGraphError(f"--resume: {folder!r} was trained in {order} order; give "
                              f"{'--shuffle' if order == 'shuffle' else '--no-shuffle'} to continue it")
        if self.shuffle and int(saved.get("seed", self.seed)) != self.seed:
            raise HGraphError(f"--resume: {folder!r} shuffled with seed {saved.get('seed')}, this run's "
                              f"--seed is {self.seed}")
        mix = saved.get("mixture")
        same = (mix is None) if not self.mixed else (mix is not None
                                                     and np.allclose(mix["weights"], self.weights))
        if not same:
            raise HGraphError(f"--resume: {folder!r} was trained on another mixture "
                              f"({mix['weights'] if mix else 'one source'}); give the same --data weights")
        if mix is not None and "counts" in mix and "next_document" in saved:
            if self._counts_at(int(saved["next_document"])) != list(mix["counts"]):
                raise HGraphError(f"--resume: {folder!r}'s mixture counts do not replay; give the same "
                                  "--data")


def open_corpus(spec: str, vocab_size: Optional[int] = None, *,
                verify: bool = False) -> tuple[list[SourceSpec], list[Sequence[Document]]]:
    """The sources of ``--data`` and their documents (``Corpus`` after ``--long``: ``corpus_of``)."""
    sources = parse_data_spec(spec)
    return sources, [open_source(s.path, vocab_size, verify=verify) for s in sources]

