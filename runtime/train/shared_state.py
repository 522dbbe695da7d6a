"""Rank 0's trained parameters handed to the process that spawned the run, through shared memory.

A spawned rank returns its result through a pipe, pickled; the trained parameters would double
the model's bytes in that pipe. Instead ``SharedState.publish`` copies them into one block of POSIX
shared memory (``multiprocessing.shared_memory``) and returns a small handle (the block's name and,
per key, dtype, shape and offset), and the caller's ``take`` maps the block, copies it once into one
tensor of its own (the key's tensors are views of it), closes and unlinks it. No ``torch.save`` /
``torch.load``, no pickling of tensor data. A block that is never taken (its run failed on another
rank after rank 0 published) is removed by multiprocessing's resource tracker when the caller ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Mapping

import torch

_ALIGN = 64          # every tensor starts on a 64-byte boundary, so its bytes view as its dtype


@dataclass(frozen=True)
class SharedEntry:
    """One tensor of the block: its key, dtype (``torch`` attribute name), shape and byte range."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SharedState:
    """A state dict in a shared memory block named ``name`` of ``size`` bytes."""

    name: str
    size: int
    entries: tuple[SharedEntry, ...]

    @classmethod
    def publish(cls, state: Mapping[str, torch.Tensor]) -> "SharedState":
        """Copy ``state``'s tensors (on any device) into a new block; the caller of ``take`` frees it."""
        entries, offset = [], 0
        for key, value in state.items():
            nbytes = value.numel() * value.element_size()
            entries.append(SharedEntry(key, str(value.dtype).removeprefix("torch."), tuple(value.shape), offset,
                                       nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        block = shared_memory.SharedMemory(create=True, size=max(offset, 1))
        try:
            flat = torch.frombuffer(block.buf, dtype=torch.uint8, count=max(offset, 1))
            for entry, value in zip(entries, state.values()):
                if entry.nbytes:
                    flat[entry.offset:entry.offset + entry.nbytes].copy_(
                        value.detach().reshape(-1).contiguous().view(torch.uint8).cpu())
            del flat                  # the block's buffer is released only without views of it
        finally:
            block.close()
        return cls(block.name, max(offset, 1), tuple(entries))

    def take(self) -> dict[str, torch.Tensor]:
        """The state dict, in this process's memory (one copy of the block), and the block removed."""
        block = shared_memory.SharedMemory(name=self.name)
        try:
            mapped = torch.frombuffer(block.buf, dtype=torch.uint8, count=self.size)
            data = mapped.clone()
            del mapped
        finally:
            block.close()
            block.unlink()
        return {e.key: data[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
                for e in self.entries}
