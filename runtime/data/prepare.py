"""Raw corpora to token stores: what ``hgraph prepare-data`` runs, and what ``hgraph train --data RAW
--tokenizer TOK`` runs before its processes start (so a run from raw text trains exactly the tokens
``prepare-data`` would have written).

``prepare(inputs, prefix, tokenizer=...)`` streams the records of every input in order
(``hgraph.runtime.data.sources``), encodes their text in batches (``workers`` processes, in order),
and writes each document to a ``TokenStoreWriter``: memory holds a few batches, whatever the input's
size. A record whose text encodes to no token is skipped (counted); a bad record stops the
conversion with one line naming its file and line, and leaves no store behind.

``resolve_raw_sources(spec, ...)``: ``--data``'s sources with every raw one (text JSONL, parquet, a
``datasets`` folder, plain text) replaced by a store prepared under ``cache_dir`` (named by the
input's path, size and modification time and the tokenizer, so a second run reuses it).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from hgraph.errors import HGraphError
from hgraph.runtime.data.corpus import SourceSpec, format_data_spec, parse_data_spec
from hgraph.runtime.data.jsonl import jsonl_values
from hgraph.runtime.data.sources import Record, TextTokenizer, input_kind, input_size, load_tokenizer, records
from hgraph.runtime.data.token_store import TokenStoreWriter, is_store

BATCH_DOCS = 256
FORMAT = 1          # of the cache key: a change of the conversion prepares cached stores again


@dataclass(frozen=True)
class PrepareResult:
    """What ``prepare`` wrote."""

    prefix: str
    documents: int
    tokens: int
    skipped_empty: int
    seconds: float
    vocab_size: int
    dtype: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# ---- workers ----------------------------------------------------------------------------------------
_WORKER_TOKENIZER: Optional[TextTokenizer] = None


def _init_worker(path: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(path)


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode(texts)


def _batches(items: Iterator[Record], size: int) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for r in items:
        batch.append(r)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class _Encoder:
    """Encodes batches of records in order: inline, or in ``workers`` processes with a bounded window."""

    def __init__(self, tokenizer: Optional[TextTokenizer], workers: int) -> None:
        self.tokenizer, self.pool = tokenizer, None
        if tokenizer is not None and workers > 1:
            # fork: a worker needs only the tokenizer, not a fresh interpreter importing torch (seconds)
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                              else "spawn")
            self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.path,))
        self.window = 2 * max(workers, 1)

    def _texts(self, batch: list[Record]) -> list[str]:
        texts = [t for _, t, _ in batch if t is not None]
        if texts and self.tokenizer is None:
            where = next(w for w, t, _ in batch if t is not None)
            raise HGraphError(f"{where}: a text record needs --tokenizer (a tokenizer.json or a local "
                              "Hugging Face tokenizer folder); records of 'input_ids' need none")
        return texts

    @staticmethod
    def _merge(batch: list[Record], encoded: list[list[int]]) -> list[tuple[str, list]]:
        it = iter(encoded)
        return [(w, next(it) if t is not None else ids) for w, t, ids in batch]

    def run(self, batches: Iterator[list[Record]]) -> Iterator[list[tuple[str, list]]]:
        if self.pool is None:
            for batch in batches:
                texts = self._texts(batch)
                yield self._merge(batch, self.tokenizer.encode(texts) if texts else [])
            return
        pending: deque = deque()
        for batch in batches:
            texts = self._texts(batch)
            pending.append((batch, self.pool.apply_async(_encode_in_worker, (texts,)) if texts else None))
            while len(pending) >= self.window:
                b, job = pending.popleft()
                yield self._merge(b, job.get() if job is not None else [])
        while pending:
            b, job = pending.popleft()
            yield self._merge(b, job.get() if job is not None else [])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


# ---- prepare ----------------------------------------------------------------------------------------
def prepare(inputs: Sequence[str], prefix: str, *, tokenizer: Optional[str] = None, text_key: str = "text",
            text_per_line: bool = False, append_eos: bool = False, workers: int = 1,
            vocab_size: Optional[int] = None,
            progress: Optional[Callable[[int, int, int, int], None]] = None) -> PrepareResult:
    """Write ``inputs`` (files or ``datasets`` folders, in order) to the token store ``prefix``.

    ``vocab_size``: of pre-tokenized ids without a tokenizer (default: the largest id + 1);
    ``progress(bytes_done, bytes_total, documents, tokens)`` after every batch.
    """
    if not inputs:
        raise HGraphError("no input: give files (JSONL, parquet, text) or a saved datasets folder")
    if workers < 1:
        raise HGraphError(f"--workers must be >= 1, got {workers}")
    paths = [Path(p) for p in inputs]
    for p in paths:
        input_kind(p)                              # a missing input fails before any work
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    vocab = tok.vocab_size if tok is not None else vocab_size
    eos = None
    if append_eos:
        if tok is None or tok.eos_id is None:
            raise HGraphError("--append-eos: " + ("the tokenizer has no end-of-document token (none of "
                                                  "<|endoftext|>, </s>, <eos>, ...)" if tok is not None
                                                  else "needs --tokenizer (its end-of-document token)"))
        eos = int(tok.eos_id)
    total = sum(input_size(p) for p in paths)
    done = [0]

    def read(n: int) -> None:
        done[0] += n

    def all_records() -> Iterator[Record]:
        for p in paths:
            yield from records(p, text_key=text_key, text_per_line=text_per_line, progress=read)

    t0 = time.perf_counter()
    writer = TokenStoreWriter(prefix, vocab)
    encoder = _Encoder(tok, workers)
    skipped = 0
    try:
        for batch in encoder.run(_batches(all_records(), BATCH_DOCS)):
            for where, ids in batch:
                if not ids:
                    skipped += 1
                    continue
                writer.add(list(ids) + [eos] if eos is not None else ids, where)
            if progress is not None:
                progress(done[0], total, writer.num_documents, writer.num_tokens)
        store = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        encoder.close()
    return PrepareResult(store.prefix, store.num_documents, store.num_tokens, skipped,
                         time.perf_counter() - t0, store.vocab_size, store.dtype.name)


# ---- raw sources of a run ---------------------------------------------------------------------------
def needs_tokenizer(path: str, text_key: str = "text") -> bool:
    """Whether ``--data``'s source ``path`` is raw text (not a store, not JSONL of ``input_ids``)."""
    if is_store(path) or path.endswith(".idx"):
        return False
    p = Path(path)
    kind = input_kind(p)
    if kind != "jsonl":
        return True
    try:
        first = next(jsonl_values(p), None)
    except HGraphError:
        return False              # read_jsonl names the line
    return first is not None and isinstance(first[1], dict) and "input_ids" not in first[1]


def _cache_key(path: Path, tokenizer: str, text_key: str) -> str:
    def stamp(p: Path) -> list:
        if p.is_dir():
            return [str(p.resolve())] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                        for f in sorted(p.rglob("*")) if f.is_file()]
        st = p.stat()
        return [str(p.resolve()), st.st_size, st.st_mtime_ns]
    raw = json.dumps([FORMAT, stamp(path), stamp(Path(tokenizer)), text_key], default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def resolve_raw_sources(spec: str, tokenizer: Optional[str], text_key: str, cache_dir: Path,
                        say: Optional[Callable[[str], None]] = None, what: str = "--data") -> str:
    """``spec`` with each raw source replaced by a token store under ``cache_dir``."""
    out = []
    for src in parse_data_spec(spec):
        if not needs_tokenizer(src.path, text_key):
            out.append(src)
            continue
        if tokenizer is None:
            raise HGraphError(f"{what} {src.path}: raw text; give --tokenizer (a tokenizer.json or a local "
                              "Hugging Face tokenizer folder), or convert it first with hgraph prepare-data")
        load_tokenizer(tokenizer)            # an unknown or broken tokenizer: its one line, first
        p = Path(src.path)
        prefix = cache_dir / f"{p.stem or 'data'}-{_cache_key(p, tokenizer, text_key)}"
        if not is_store(prefix):
            result = prepare([src.path], str(prefix), tokenizer=tokenizer, text_key=text_key)
            if say is not None:
                say(f"{what} {src.path}: tokenized {result.documents} documents, {result.tokens} tokens "
                    f"({result.tokens_per_s:.0f} tokens/s) into {prefix}")
        out.append(SourceSpec(str(prefix), src.weight))
    return format_data_spec(out)
