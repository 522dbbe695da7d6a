"""The tensors of a safetensors file, or of a directory of them, known from the headers alone.

A model directory written by ``save_pretrained`` holds ``model.safetensors``, or shards
``model-0000K-of-0000N.safetensors`` and ``model.safetensors.index.json`` (``weight_map``: tensor
name -> shard file). ``SafetensorsFiles.open(path)`` takes a file or such a directory (a directory
without an index: every ``*.safetensors`` in it) and reads only the headers: each file's first 8
bytes give the length of its JSON header, which lists every tensor's dtype, shape and byte range. So
every name and shape is known, and checked against the model, before a single tensor byte is read;
and a file cut short (a copy or download that did not finish) is found here, from its size, and
named, rather than failing half-way through a load.

``read(name, dim, lo, hi)`` then reads one segment through ``safe_open(file).get_slice(name)``:
only the bytes of those rows leave the disk (``safetensors`` memory-maps the file).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from hgraph.errors import HGraphError

INDEX = "model.safetensors.index.json"
# a header longer than this is not a safetensors header (the format's own limit is 100 MB)
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its shape, dtype name (``F32``, ``BF16``) and the file holding it."""

    shape: tuple[int, ...]
    dtype: str
    file: Path


def read_header(file: Path) -> dict[str, Any]:
    """The tensors of one safetensors file's header (``__metadata__`` left out); HGraphError naming
    the file when it is not a safetensors file or is shorter than its header says."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HGraphError(f"safetensors file {str(file)!r} is truncated: {size} bytes, not even a header")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise HGraphError(f"{str(file)!r} is not a safetensors file (its first 8 bytes give a header "
                                  f"of {length} bytes)")
            if 8 + length > size:
                raise HGraphError(f"safetensors file {str(file)!r} is truncated: {size} bytes, its header alone "
                                  f"needs {8 + length}")
            raw = f.read(length)
    except OSError as exc:
        raise HGraphError(f"safetensors file {str(file)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        for v in tensors.values():
            v["shape"] = tuple(int(d) for d in v["shape"])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise HGraphError(f"{str(file)!r} is not a safetensors file (its header is not a safetensors "
                          "header)") from None
    if 8 + length + end > size:
        raise HGraphError(f"safetensors file {str(file)!r} is truncated: {size} bytes, its header describes "
                          f"{8 + length + end}")
    return tensors


class SafetensorsFiles:
    """The tensors of a safetensors file or directory; ``entries`` by name."""

    def __init__(self, description: str, entries: dict[str, TensorEntry]) -> None:
        self.description = description
        self.entries = entries
        self.shapes = {name: e.shape for name, e in entries.items()}
        self._open: dict[Path, Any] = {}

    @classmethod
    def open(cls, path: Any) -> "SafetensorsFiles":
        path = Path(path)
        if path.is_file():
            return cls(f"safetensors file {str(path)!r}", _entries([path]))
        if not path.is_dir():
            raise HGraphError(f"{str(path)!r} does not exist")
        index = path / INDEX
        if index.is_file():
            return cls(f"safetensors index {str(index)!r}", _indexed_entries(index))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise HGraphError(f"{str(path)!r} holds no *.safetensors files (and no {INDEX})")
        return cls(f"safetensors {'file' if len(files) == 1 else 'files'} "
                   f"{str(files[0]) if len(files) == 1 else str(path / '*.safetensors')!r}", _entries(files))

    def where(self, name: str) -> str:
        """The file that holds ``name`` (for messages)."""
        return str(self.entries[name].file)

    def read(self, name: str, dim: Optional[int] = None, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """``name`` whole (``dim`` None) or its rows ``[lo, hi)`` along ``dim``, read by ``get_slice``
        (a 0-d tensor is handled as shape [1])."""
        entry = self.entries[name]
        handle = self._handle(entry.file)
        if not entry.shape:
            value = handle.get_tensor(name)
            return value if dim is None else value.reshape(1)[lo:hi]
        if dim is None:
            return handle.get_tensor(name)
        index = (slice(None),) * dim + (slice(lo, entry.shape[dim] if hi is None else hi),)
        return handle.get_slice(name)[index]

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            from safetensors import safe_open
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as exc:  # the library's own error types
                raise HGraphError(f"safetensors file {str(file)!r} cannot be opened: {exc}") from None
        return self._open[file]

    def close(self) -> None:
        """Drop the open file handles (their memory maps)."""
        self._open.clear()


def _entries(files: list[Path]) -> dict[str, TensorEntry]:
    out: dict[str, TensorEntry] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in out:
                raise HGraphError(f"tensor {name!r} is in both {str(out[name].file)!r} and {str(file)!r}")
            out[name] = TensorEntry(info["shape"], info["dtype"], file)
    return out


def _indexed_entries(index: Path) -> dict[str, TensorEntry]:
    """The tensors of the shard files an index names, each checked to be where the index says."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise HGraphError(f"{str(index)!r} is not a safetensors index (a JSON object with a weight_map)") from None
    files = sorted({index.parent / f for f in weight_map.values()})
    for file in files:
        if not file.is_file():
            raise HGraphError(f"{str(file)!r}, a shard file of {str(index)!r}, does not exist")
    entries = _entries(files)
    for name, file in weight_map.items():
        entry = entries.get(name)
        if entry is None or entry.file != index.parent / file:
            raise HGraphError(f"{str(index)!r} says {name!r} is in {file}, but "
                              + ("no shard file holds it" if entry is None else f"{entry.file.name} does"))
    return entries
