"""Reading document lengths and cutting them into mini-batches (``docs/architecture.md``, data order)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.jsonl import jsonl_values, not_utf8


_FIRST_CHAR = re.compile(rb"^[ \t\r\f\v]*([^#\s])", re.M)
LENGTH_LINES = "one integer per line ('#' starts a comment line), or JSONL objects with 'input_ids'"


def _plain_length(text: str, name: str, lineno: int) -> int:
    try:
        value = int(text)
    except ValueError:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise HGraphError(f"{name}:{lineno}: {shown!r} is not a length (expected {LENGTH_LINES})") from None
    if value < 1:
        raise HGraphError(f"{name}:{lineno}: length {value} must be a positive integer")
    return value


def read_lengths(path: str | Path) -> np.ndarray:
    """Document lengths of a file: one integer per line (lines starting with ``#`` are comments), or
    JSONL objects with ``input_ids`` (read by ``jsonl.jsonl_values``).

    Blank lines are skipped (line numbers in errors count them). An empty file, a non-numeric or
    non-positive length, a byte that is not UTF-8 or a malformed JSON line raises HGraphError naming
    the file and line. Returns an int64 array in file order.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise HGraphError(f"cannot read lengths file {str(p)!r}: {exc.strerror or exc}") from None
    first = _FIRST_CHAR.search(data)        # of the first line that is neither blank nor a comment
    if first is not None and first.group(1) == b"{":
        out = []
        for where, obj in jsonl_values(p, expect="each line must be an object with 'input_ids'"):
            ids = obj.get("input_ids") if isinstance(obj, dict) else None
            if not isinstance(ids, list):
                raise HGraphError(f"{where}: JSON object has no 'input_ids' list")
            out.append(len(ids))
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line_start = data.rfind(b"\n", 0, exc.start) + 1
            raise not_utf8(p.name, data.count(b"\n", 0, exc.start) + 1, data[line_start:], exc.start - line_start,
                           line_start, f"expected {LENGTH_LINES}") from None
        lines = text.split("\n")
        try:      # the fast path of a plain integer file (the common case, a million lines)
            out = [int(s) for s in lines if s.strip() and not s.lstrip().startswith("#")]
        except ValueError:
            out = [_plain_length(s.strip(), p.name, i) for i, s in enumerate(lines, 1)
                   if s.strip() and not s.lstrip().startswith("#")]
        if any(v < 1 for v in out):
            bad = next(i for i, s in enumerate(lines, 1)
                       if s.strip() and not s.lstrip().startswith("#") and int(s) < 1)
            _plain_length(lines[bad - 1].strip(), p.name, bad)
    if not out:
        raise HGraphError(f"lengths file {str(p)!r} is empty: expected {LENGTH_LINES}")
    return np.asarray(out, dtype=np.int64)


def minibatches(lengths: np.ndarray, tokens_per_iter: int) -> list[np.ndarray]:
    """Split documents, in file order, into mini-batches of at most ``tokens_per_iter`` tokens.

    A mini-batch takes whole documents until the next one would pass ``tokens_per_iter``; a single
    document longer than that forms a mini-batch of its own. Returns arrays of document indices.
    """
    if not isinstance(tokens_per_iter, (int, np.integer)) or tokens_per_iter < 1:
        raise HGraphError(f"tokens per iteration must be a positive integer, got {tokens_per_iter!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    out: list[np.ndarray] = []
    n = lengths.size
    csum = np.concatenate([[0], np.cumsum(lengths)])
    start = 0
    while start < n:
        # Last end with csum[end] - csum[start] <= tokens_per_iter; at least one document.
        end = int(np.searchsorted(csum, csum[start] + tokens_per_iter, side="right")) - 1
        end = max(end, start + 1)
        out.append(np.arange(start, end, dtype=np.int64))
        start = end
    return out
