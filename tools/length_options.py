"""Length handling shared by ``hgraph propose``, ``pack`` and ``simulate``.

Documents longer than the context ``--max-len`` are truncated to it (the papers' practice; ``plan``
does the same) except where a command says otherwise; documents that no scheme can hold are an
error naming the longest one and the largest MaxLen, unless ``--long truncate|drop`` asks to cut
them to the largest MaxLen or to leave them out.
"""
from __future__ import annotations

import numpy as np

from hgraph.errors import HGraphError

LONG_CHOICES = ("error", "truncate", "drop")


def add_long_option(p, what: str) -> None:
    p.add_argument("--long", choices=LONG_CHOICES, default="error",
                   help=f"documents longer than {what}: error (default), truncate them to it, or drop them")


def limit_lengths(lengths: np.ndarray, limit: int, policy: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Apply ``policy`` to documents longer than ``limit``: (lengths, their indices in the file)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    index = np.arange(lengths.size, dtype=np.int64)
    over = lengths > limit
    if not over.any():
        return lengths, index
    if policy == "truncate":
        return np.minimum(lengths, limit), index
    if policy == "drop":
        if over.all():
            raise HGraphError(f"every document is longer than {what} ({limit} tokens); nothing left after --long drop")
        return lengths[~over], index[~over]
    i = int(np.argmax(lengths))
    raise HGraphError(f"document {i} has {int(lengths[i])} tokens, more than {what} ({limit}); "
                      "pass --long truncate or --long drop to cut or skip such documents")
