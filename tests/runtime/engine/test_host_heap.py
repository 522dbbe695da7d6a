"""A CPU rank's freed large blocks go back to the system (``engine/host_heap``).

In a fresh process: a 16 MiB tensor freed (after which glibc serves every block below 16 MiB from
the heap), then 64 tensors of 2 MiB, every other one freed. From the heap, the freed holes stay
resident; after ``return_large_blocks`` each freed block is unmapped and the resident size falls by
their 64 MiB. One process measures glibc's default, another the setting (in one process the second
measurement would reuse the first one's heap holes)."""
import subprocess
import sys

import pytest

from hgraph.runtime.engine import host_heap

SCRIPT = """
import sys
import torch
from hgraph.runtime.engine import host_heap


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


if sys.argv[1] == "fixed":
    host_heap.return_large_blocks()
big = torch.ones(4 << 20)          # 16 MiB
del big
blocks = [torch.ones(512 << 10) for _ in range(64)]      # 2 MiB each
before = rss()
del blocks[::2]
print((before - rss()) >> 20)
"""


def _freed_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_freed_large_blocks_leave_the_resident_set():
    if not host_heap.return_large_blocks():
        pytest.skip("not glibc: the C library has no mallopt")
    assert _freed_mib("fixed") >= 56
    assert _freed_mib("default") < 16     # glibc's default: the holes stay resident (what the setting is for)
