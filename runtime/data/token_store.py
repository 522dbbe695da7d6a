"""The token store: a corpus as two files, ``PREFIX.bin`` (every token) and ``PREFIX.idx`` (where each
document lies), read through ``numpy.memmap`` (Megatron's indexed dataset is the model).

``PREFIX.bin``: the tokens of all documents back to back, in the smallest unsigned dtype that holds
the vocabulary (``uint8`` up to 256 ids, ``uint16`` up to 65,536, else ``uint32``), native little-endian.

``PREFIX.idx``, all little-endian:

* 8 bytes magic ``HGTOKIDX``, then a ``uint32`` header length ``H`` and ``H`` bytes of UTF-8 JSON:
  ``{"version": 1, "dtype": "uint16", "vocab_size", "num_documents", "num_tokens",
  "max_token_id", "bin_sha256"}``; zero padding to a multiple of 8 bytes;
* ``uint64 offsets[num_documents]`` (token offset of each document in ``.bin``);
* ``uint32 lengths[num_documents]``.

A reader maps both arrays (the planner reads ``lengths`` only: 12 bytes per document) and the
``.bin``; ``tokens(i)`` is a view of document ``i``'s pages, so a rank touches only the documents it
trains. ``open_store`` checks the sizes (cheap, every rank); ``verify`` also hashes ``.bin`` against
the header's SHA-256 (once, before a run starts). ``fingerprint`` names the data in checkpoints.

``TokenStoreWriter`` streams: tokens go to the ``.bin`` as they come (hashed on the way), only the
lengths are kept (4 bytes per document), and both files appear atomically at ``finish``.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from hgraph.errors import HGraphError

MAGIC = b"HGTOKIDX"
VERSION = 1
BIN, IDX = ".bin", ".idx"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary of ``vocab_size``."""
    if vocab_size < 1:
        raise HGraphError(f"vocabulary size must be >= 1, got {vocab_size}")
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise HGraphError(f"vocabulary size {vocab_size} does not fit 32-bit token ids")


def store_paths(prefix: Union[str, Path]) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    p = str(prefix)
    return Path(p + BIN), Path(p + IDX)


def is_store(prefix: Union[str, Path]) -> bool:
    """Whether ``prefix`` names a token store (its ``.idx`` exists)."""
    return store_paths(prefix)[1].is_file()


class TokenStoreWriter:
    """Writes a token store one document at a time. ``add(ids, where)``: ``where``
    names the document in errors (``file:line``); ``finish()`` returns the opened store.

    ``vocab_size`` None (pre-tokenized ids of an unknown vocabulary): the ids are written as ``uint32``
    and, at ``finish``, copied chunk by chunk into the dtype of the largest id + 1."""

    def __init__(self, prefix: Union[str, Path], vocab_size: Optional[int]) -> None:
        self.prefix = str(prefix)
        self.given_vocab = vocab_size is not None
        self.vocab_size = int(vocab_size) if vocab_size is not None else 2 ** 32
        self.dtype = token_dtype(self.vocab_size)
        self.bin_path, self.idx_path = store_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.bin_path.with_name(f".{self.bin_path.name}.{os.getpid()}.tmp")
        self._file = open(self._tmp_bin, "wb")
        self._sha = hashlib.sha256()
        self._lengths = array("I")
        self.num_tokens = 0
        self.max_token_id = -1

    def add(self, ids: Any, where: str = "") -> None:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise HGraphError(f"{where or 'document'}: token ids must be a flat list of integers")
        if arr.size == 0:
            raise HGraphError(f"{where or 'document'}: a document needs at least one token")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise HGraphError(f"{where or f'document {len(self._lengths)}'}: token id {bad} is outside the "
                              f"vocabulary [0, {self.vocab_size})")
        if arr.size > np.iinfo(np.uint32).max:
            raise HGraphError(f"{where}: a document of {arr.size} tokens is longer than 2^32 - 1")
        data = arr.astype(self.dtype, copy=False).tobytes()
        self._file.write(data)
        self._sha.update(data)
        self._lengths.append(arr.size)
        self.num_tokens += int(arr.size)
        self.max_token_id = max(self.max_token_id, hi)

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def abort(self) -> None:
        """Drop what was written (a failed conversion leaves no half store)."""
        self._file.close()
        self._tmp_bin.unlink(missing_ok=True)

    def finish(self) -> "TokenStore":
        if not self._lengths:
            self.abort()
            raise HGraphError(f"no documents to write to {self.prefix}")
        self._file.close()
        if not self.given_vocab:
            self._narrow(self.max_token_id + 1)
        lengths = np.frombuffer(self._lengths, dtype=np.uint32)
        offsets = np.zeros(lengths.size, dtype=np.uint64)
        np.cumsum(lengths[:-1], dtype=np.uint64, out=offsets[1:])
        header = {"version": VERSION, "dtype": self.dtype.name, "vocab_size": self.vocab_size,
                  "num_documents": int(lengths.size), "num_tokens": self.num_tokens,
                  "max_token_id": self.max_token_id, "bin_sha256": self._sha.hexdigest()}
        tmp_idx = self.idx_path.with_name(f".{self.idx_path.name}.{os.getpid()}.tmp")
        with open(tmp_idx, "wb") as f:
            f.write(_header_bytes(header))
            f.write(offsets.astype("<u8").tobytes())
            f.write(lengths.astype("<u4").tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)
        return open_store(self.prefix)


    def _narrow(self, vocab_size: int) -> None:
        """Rewrite the uint32 ``.bin`` in the dtype of ``vocab_size`` (streamed, re-hashed)."""
        self.vocab_size, dtype = vocab_size, token_dtype(vocab_size)
        if dtype == self.dtype:
            return
        src = np.memmap(self._tmp_bin, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        tmp = self._tmp_bin.with_suffix(".narrow")
        self._sha = hashlib.sha256()
        with open(tmp, "wb") as f:
            for start in range(0, self.num_tokens, 1 << 22):
                data = np.asarray(src[start:start + (1 << 22)]).astype(dtype).tobytes()
                f.write(data)
                self._sha.update(data)
        del src
        os.replace(tmp, self._tmp_bin)
        self.dtype = dtype


def _header_bytes(header: dict) -> bytes:
    text = json.dumps(header, sort_keys=True).encode("utf-8")
    raw = MAGIC + struct.pack("<I", len(text)) + text
    return raw + b"\0" * (-len(raw) % 8)


@dataclass(frozen=True)
class TokenStore:
    """An opened token store: ``lengths`` (memmap), ``tokens(i)`` (a memmap view), the header."""

    prefix: str
    header: dict
    data_start: int          # byte offset of the offsets array in the .idx

    @property
    def num_documents(self) -> int:
        return int(self.header["num_documents"])

    @property
    def num_tokens(self) -> int:
        return int(self.header["num_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"])

    @property
    def max_token_id(self) -> int:
        return int(self.header["max_token_id"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.header["dtype"])

    @property
    def fingerprint(self) -> str:
        """What a checkpoint records of the data: the ``.bin``'s SHA-256 and the document count."""
        return f"store:{self.header['bin_sha256']}:{self.num_documents}"

    @cached_property
    def offsets(self) -> np.ndarray:
        return np.memmap(store_paths(self.prefix)[1], dtype="<u8", mode="r", offset=self.data_start,
                         shape=(self.num_documents,))

    @cached_property
    def lengths(self) -> np.ndarray:
        return np.memmap(store_paths(self.prefix)[1], dtype="<u4", mode="r",
                         offset=self.data_start + 8 * self.num_documents, shape=(self.num_documents,))

    @cached_property
    def _bin(self) -> np.ndarray:
        return np.memmap(store_paths(self.prefix)[0], dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def tokens(self, i: int, start: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Document ``i``'s tokens ``[start, start + length)`` (a read-only view of the memmap)."""
        off = int(self.offsets[i]) + start
        n = int(self.lengths[i]) - start if length is None else length
        return self._bin[off:off + n]

    def first_token_at_least(self, value: int) -> tuple[int, int]:
        """(position in ``.bin``, id) of the first token ``>= value`` (``(-1, -1)``: none), chunk by chunk."""
        step = 1 << 24
        for start in range(0, self.num_tokens, step):
            hits = np.flatnonzero(self._bin[start:start + step] >= value)
            if hits.size:
                return start + int(hits[0]), int(self._bin[start + int(hits[0])])
        return -1, -1

    def __getstate__(self) -> dict:
        # a store travels to another process as its name: the maps are opened again there
        return {"prefix": self.prefix, "header": self.header, "data_start": self.data_start}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def verify(self) -> None:
        """Hash the ``.bin`` against the header's SHA-256 (HGraphError naming both files if they differ)."""
        bin_path, idx_path = store_paths(self.prefix)
        h = hashlib.sha256()
        with open(bin_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        if h.hexdigest() != self.header["bin_sha256"]:
            raise HGraphError(f"token store {self.prefix}: the checksum of {bin_path.name} does not match "
                              f"{idx_path.name} (the files are from different writes or damaged); prepare "
                              "it again")


def open_store(prefix: Union[str, Path], *, verify: bool = False) -> TokenStore:
    """Open ``PREFIX.idx`` / ``PREFIX.bin`` (sizes checked; ``verify``: the checksum too)."""
    prefix = str(prefix)
    bin_path, idx_path = store_paths(prefix)
    where = f"token store {prefix}"
    try:
        with open(idx_path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:8] != MAGIC:
                raise HGraphError(f"{where}: {idx_path.name} is not a token store index (no {MAGIC.decode()} "
                                  "header); write one with hgraph prepare-data")
            (size,) = struct.unpack("<I", head[8:])
            header = json.loads(f.read(size).decode("utf-8"))
    except FileNotFoundError:
        raise HGraphError(f"{where}: {idx_path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise HGraphError(f"{where}: {idx_path.name} cannot be read ({exc})") from None
    if header.get("version") != VERSION:
        raise HGraphError(f"{where}: index version {header.get('version')} (this hgraph reads version "
                          f"{VERSION})")
    start = 12 + size + (-(12 + size) % 8)
    n = int(header["num_documents"])
    if idx_path.stat().st_size != start + 12 * n:
        raise HGraphError(f"{where}: {idx_path.name} has {idx_path.stat().st_size} bytes, its header "
                          f"promises {start + 12 * n} ({n} documents): the file is truncated or damaged")
    if not bin_path.is_file():
        raise HGraphError(f"{where}: {bin_path} does not exist")
    expected = int(header["num_tokens"]) * np.dtype(header["dtype"]).itemsize
    if bin_path.stat().st_size != expected:
        raise HGraphError(f"{where}: {bin_path.name} has {bin_path.stat().st_size} bytes, the index expects "
                          f"{expected}: the checksum cannot match; prepare the store again")
    store = TokenStore(prefix, header, start)
    if verify:
        store.verify()
    return store


def write_documents(prefix: Union[str, Path], docs: Any, vocab_size: int) -> TokenStore:
    """A token store of ``docs`` (token id sequences, in order)."""
    w = TokenStoreWriter(prefix, vocab_size)
    try:
        for i, d in enumerate(docs):
            w.add(d, f"document {i}")
    except BaseException:
        w.abort()
        raise
    return w.finish()
