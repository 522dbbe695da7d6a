"""The tensors of a torch ``state_dict`` file, read memory-mapped and safely.

``torch.load(path, weights_only=True, mmap=True)`` only: ``weights_only`` unpickles nothing but
tensors and plain containers (a state_dict from elsewhere cannot run code), and ``mmap`` leaves the
tensor data in the file, so knowing every name and shape costs no memory and ``read`` copies only
the rows it is asked for. A file in torch's legacy (non-zip) format cannot be memory-mapped: the error
says to re-save it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from hgraph.errors import HGraphError


class StateDictFile:
    """The tensors of one ``torch.save``d state_dict (a flat mapping of names to tensors)."""

    def __init__(self, path: Any) -> None:
        self.path = Path(path)
        self.description = f"state_dict file {str(self.path)!r}"
        self.tensors: Optional[Mapping[str, torch.Tensor]] = self._load()
        self.shapes = {name: tuple(t.shape) for name, t in self.tensors.items()}

    def _load(self) -> Mapping[str, torch.Tensor]:
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # unpickling, zip and mmap errors alike
            text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise HGraphError(f"{str(self.path)!r} cannot be read with torch.load(weights_only=True, mmap=True) "
                              f"(a torch.save file of the zip format is needed): {text}") from None
        if not isinstance(state, Mapping) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise HGraphError(f"{str(self.path)!r} is not a state_dict (a mapping of parameter names to tensors)")
        return state

    def where(self, name: str) -> str:
        return str(self.path)

    def read(self, name: str, dim: Optional[int] = None, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """``name`` whole (``dim`` None) or its rows ``[lo, hi)`` along ``dim``, copied out of the file."""
        if self.tensors is None:
            self.tensors = self._load()
        t = self.tensors[name]
        if dim is None:
            return t.clone()
        t = t.reshape(t.shape or (1,))
        return t.narrow(dim, lo, (t.shape[dim] if hi is None else hi) - lo).clone()

    def close(self) -> None:
        """Drop the memory map (``read`` maps the file again if asked)."""
        self.tensors = None
