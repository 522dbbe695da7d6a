"""The one JSONL reader of hgraph: one JSON value per non-blank line, read as bytes and decoded line by
line, so that a byte that is not UTF-8 (or a binary file named ``.jsonl``) and a malformed line are one
``HGraphError`` naming the file, the line and the byte offset in the file, never a decoder's traceback.

Every command that reads JSONL goes through ``jsonl_values``: training data (``documents.read_jsonl``),
raw corpora (``sources``), document lengths (``lengths.read_lengths``) and run metrics
(``hgraph report``, ``hgraph dump --run-dir``). ``not_utf8`` words the same error for readers of plain
text lines.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from hgraph.errors import HGraphError


def not_utf8(name: str, lineno: int, line: bytes, column: int, line_start: int, expect: str = "") -> HGraphError:
    """The error of the undecodable byte ``line[column]`` of line ``lineno``, which starts at byte
    ``line_start`` of the file."""
    return HGraphError(f"{name}:{lineno}: not UTF-8 text (byte 0x{line[column]:02x} at byte offset "
                       f"{line_start + column} of the file)" + (f"; {expect}" if expect else ""))


def jsonl_values(path: Union[str, Path], *, expect: str = "each line must be one JSON value",
                 progress: Optional[Callable[[int], Any]] = None) -> Iterator[tuple[str, Any]]:
    """``(where, value)`` of every non-blank line of ``path``; ``where`` is ``name:line`` for the
    caller's own errors about the value. ``expect`` ends the errors of this reader (what a line must
    hold); ``progress(n)``: ``n`` more bytes read. A file that cannot be opened is an HGraphError too."""
    path = Path(path)
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise HGraphError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with handle:
        offset = 0
        for lineno, raw in enumerate(handle, start=1):
            start, offset = offset, offset + len(raw)
            if progress is not None:
                progress(len(raw))
            if not raw.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise not_utf8(path.name, lineno, raw, exc.start, start, expect) from None
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                at = start + len(text[:exc.pos].encode("utf-8"))
                raise HGraphError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno}, byte offset {at} "
                                  f"of the file); {expect}") from None
            yield where, value
