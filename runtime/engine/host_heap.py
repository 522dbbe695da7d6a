"""The C heap of a CPU rank: large blocks go back to the system when freed.

glibc's malloc serves a block below its mmap threshold from the heap, and raises that threshold
(up to 32 MiB) each time a mapped block is freed. A training step frees and re-allocates
activations, gradients and working weights of a few MiB each; once the threshold has risen they
come from the heap, whose freed pages a later step need not reuse in place, and the process's
resident peak drifts above what is live (measured on the 168M Llama of issue 14, 2xTP2PP1 on 4 CPU
ranks: 2.30-2.49 GiB by default, 2.05-2.26 GiB with a fixed 1 MiB threshold, 2.04-2.24 GiB with
64 KiB, which also maps a small model's activations; the run times were within the machine's noise).
``return_large_blocks`` fixes the threshold; elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

M_MMAP_THRESHOLD = -3          # mallopt parameter (glibc malloc.h)
MMAP_THRESHOLD_BYTES = 64 << 10


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def return_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve blocks of ``threshold`` bytes or more by mmap (freed straight back to the system);
    True when the C library took the setting."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1)


def trim() -> None:
    """Hand freed heap pages back to the system (glibc's ``malloc_trim``)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
