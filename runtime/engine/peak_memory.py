"""This process's measured peak memory, step by step: what every training step reports per rank.

On a GPU it is the CUDA caching allocator's peak of allocated bytes on the rank's device; on CPU the
peak resident set size of the process (``VmHWM`` of ``/proc/self/status``), which is what the
operating system charges a rank for: tensors, the framework, buffers, allocator slack. Each reading
starts the next period (``torch.cuda.reset_peak_memory_stats``; on Linux writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM``), so a step's figure is its own peak, the first one's
since the process started. Where the peak cannot be reset (no ``/proc``: other systems report
``ru_maxrss``) the figure is the process's peak so far and ``source`` says so.
"""
from __future__ import annotations

import os
import resource
import sys
from typing import Optional

import torch

CUDA = "cuda-allocator"       # torch.cuda.max_memory_allocated since the last reading
RSS = "rss"                   # VmHWM since the last reading
RSS_SINCE_START = "rss-since-start"   # the process's peak resident set so far (cannot be reset here)
CLEAR_REFS = "/proc/self/clear_refs"


def _vm_hwm() -> Optional[int]:
    """``VmHWM`` in bytes, None without ``/proc``."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_vm_hwm() -> bool:
    try:
        with open(CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss() -> int:
    """``ru_maxrss`` in bytes (kilobytes on Linux, bytes on macOS)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value) if sys.platform == "darwin" else int(value) * 1024


class PeakMemory:
    """Reads (and restarts) the peak memory of this process on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.source = CUDA
        else:
            # asked, not tried: a reset now would drop the peak of the set-up (the first step reports it)
            resettable = _vm_hwm() is not None and os.access(CLEAR_REFS, os.W_OK)
            self.source = RSS if resettable else RSS_SINCE_START

    def read(self) -> int:
        """The peak in bytes since the last ``read``, and start a new period."""
        if self.source == CUDA:
            peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        if self.source == RSS:
            peak = _vm_hwm()
            if peak is not None and _reset_vm_hwm():
                return peak
            self.source = RSS_SINCE_START
        return _max_rss()
