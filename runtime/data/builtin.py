"""The built-in long-tail dataset of the default ``hgraph train`` run (no data file needed).

Document lengths are drawn from a sample of real lengths shipped in the package
(``runtime/data/wikipedia_length_sample.txt``: 20,000 tokenized Wikipedia documents, made by
``hgraph.tools.report.length_sample`` from FlexSP's 1,000,000; mean 986, median 344, p99 10,174
tokens), so the run sees the long tail that makes heterogeneous strategies pay off.

Scaling for CPU: a length ``l`` becomes ``max(min_len, round(l * scale))`` and is truncated to
``max_len`` (the papers truncate to the context length too). The default ``scale = 1/16`` keeps the
shape of the distribution (median ~21, p99 ~690 tokens, 0.4% cut at a max_len of 1024) while a
step of a tiny model on 2 CPU cores takes well under a second, so the default run finishes in
minutes.

Token ids are random: drawn from a Zipf-like law over the vocabulary (probability of id ``k``
proportional to ``1/(k+1)^1.1``) so there is something to learn and the loss curve falls from
``ln(vocab)`` towards the law's entropy; ``token_law="uniform"`` gives flat ids. Everything is a
pure function of ``seed``.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from hgraph.errors import HGraphError

DEFAULT_SCALE = 1 / 16
ZIPF_EXPONENT = 1.1
SAMPLE_FILE = "wikipedia_length_sample.txt"
TOKEN_LAWS = ("zipf", "uniform")


@lru_cache(maxsize=1)
def length_sample() -> np.ndarray:
    """The shipped real document lengths (read-only int64 array, file order)."""
    text = resources.files("hgraph.runtime.data").joinpath(SAMPLE_FILE).read_text(encoding="utf-8")
    values = np.array([int(line) for line in text.splitlines() if line and not line.startswith("#")],
                      dtype=np.int64)
    values.setflags(write=False)
    return values


def _check(num_docs: int, max_len: int, scale: float, min_len: int) -> None:
    if num_docs < 1:
        raise HGraphError(f"built-in data: num_docs must be >= 1, got {num_docs}")
    if min_len < 2:
        raise HGraphError(f"built-in data: min_len must be >= 2 (a document needs a target), got {min_len}")
    if max_len < min_len:
        raise HGraphError(f"built-in data: max_len {max_len} is below min_len {min_len}")
    if not scale > 0:
        raise HGraphError(f"built-in data: scale must be > 0, got {scale}")


def scaled_lengths(num_docs: int, max_len: int, seed: int, scale: float = DEFAULT_SCALE,
                   min_len: int = 2) -> np.ndarray:
    """``num_docs`` lengths drawn (with replacement) from the sample, scaled and clipped (module doc)."""
    _check(num_docs, max_len, scale, min_len)
    rng = np.random.default_rng([seed, 0])
    raw = rng.choice(length_sample(), size=num_docs, replace=True)
    return np.clip(np.rint(raw * scale).astype(np.int64), min_len, max_len)


def _token_probabilities(vocab_size: int, law: str) -> np.ndarray:
    if law == "uniform":
        return np.full(vocab_size, 1.0 / vocab_size)
    weights = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64) ** ZIPF_EXPONENT
    return weights / weights.sum()


def synthetic_documents(num_docs: int, vocab_size: int, max_len: int, seed: int,
                        scale: float = DEFAULT_SCALE, *, min_len: int = 2,
                        token_law: str = "zipf") -> list[list[int]]:
    """``num_docs`` documents (lists of token ids in ``[0, vocab_size)``), lengths from the real sample.

    Deterministic per ``seed``; the lengths are ``scaled_lengths(num_docs, max_len, seed, scale,
    min_len)``. Write them with ``write_jsonl`` for ``hgraph train --data``.
    """
    if vocab_size < 1:
        raise HGraphError(f"built-in data: vocab_size must be >= 1, got {vocab_size}")
    if token_law not in TOKEN_LAWS:
        raise HGraphError(f"built-in data: token_law {token_law!r}; allowed: {', '.join(TOKEN_LAWS)}")
    lengths = scaled_lengths(num_docs, max_len, seed, scale, min_len)
    rng = np.random.default_rng([seed, 1])
    ids = rng.choice(vocab_size, size=int(lengths.sum()), p=_token_probabilities(vocab_size, token_law))
    bounds = np.cumsum(lengths)[:-1]
    return [part.tolist() for part in np.split(ids, bounds)]


def write_jsonl(path: Union[str, Path], docs: Sequence[Sequence[int]]) -> Path:
    """Write documents as JSONL (``{"input_ids": [...]}`` per line), the format ``read_jsonl`` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"input_ids": [int(t) for t in doc]}) + "\n")
    return path
