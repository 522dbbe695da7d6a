"""Reading document lengths and cutting them into mini-batches (``docs/architecture.md``, data order)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hgraph.errors import HGraphError


def _parse_line(text: str, path: str, lineno: int) -> int:
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HGraphError(f"{path}: line {lineno}: malformed JSON ({exc.msg})") from None
        ids = obj.get("input_ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list):
            raise HGraphError(f"{path}: line {lineno}: JSON object has no 'input_ids' list")
        return len(ids)
    try:
        value = int(text)
    except ValueError:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise HGraphError(
            f"{path}: line {lineno}: {shown!r} is not a length (expected one integer per line, "
            "or JSONL objects with 'input_ids')") from None
    if value < 1:
        raise HGraphError(f"{path}: line {lineno}: length {value} must be a positive integer")
    return value


def read_lengths(path: str | Path) -> np.ndarray:
    """Document lengths of a file: one integer per line, or JSONL objects with ``input_ids``.

    Blank lines are skipped (line numbers in errors count them). An empty file, a non-numeric or
    non-positive length, or a malformed JSON line raises HGraphError naming the file and line.
    Returns an int64 array in file order.
    """
    p = Path(path)
    try:
        handle = p.open("r", encoding="utf-8")
    except OSError as exc:
        raise HGraphError(f"cannot read lengths file {str(p)!r}: {exc.strerror or exc}") from None
    with handle:
        first = handle.readline()
        if not first.lstrip().startswith("{"):
            # Fast path for plain integer files (the common case, a million lines).
            rest = handle.read()
            text = first + rest
            lines = text.split("\n")
            try:
                values = [int(s) for s in lines if s.strip()]
            except ValueError:
                values = None
            if values is not None:
                arr = np.asarray(values, dtype=np.int64)
                if arr.size == 0:
                    raise HGraphError(f"lengths file {str(p)!r} is empty: expected one length per line")
                if (arr < 1).any():
                    bad = int(np.argmax(arr < 1))
                    lineno = [i for i, s in enumerate(lines, 1) if s.strip()][bad]
                    raise HGraphError(f"{p}: line {lineno}: length {int(arr[bad])} must be a positive integer")
                return arr
            all_lines = lines
        else:
            all_lines = [first.rstrip("\n")] + handle.read().split("\n")
    out = [_parse_line(s.strip(), str(p), i) for i, s in enumerate(all_lines, 1) if s.strip()]
    if not out:
        raise HGraphError(f"lengths file {str(p)!r} is empty: expected one length per line")
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
