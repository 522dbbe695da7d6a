"""Write tensors into safetensors files the way ``save_pretrained`` does, streaming one tensor at a time.

``plan_shards(sizes, max_bytes)`` cuts the tensors, in order, into shards of at most ``max_bytes``
(a tensor larger than that gets a shard of its own, as in transformers) from their byte sizes alone,
so the file names (``model-0000K-of-0000N.safetensors``) are known before anything is read.
``write_shards(directory, plan, specs, read)`` writes each shard as the safetensors format lays it
out: the 8-byte header length, the JSON header (every tensor's dtype, shape and byte range, known
from ``specs`` before any tensor exists; padded with spaces to 8 bytes as the reference writer does),
then each tensor's bytes in that order, asking ``read(key)`` for one tensor, writing it and dropping
it before the next. So a process holds one tensor, never a shard (``save_file`` would need the
whole shard in memory) and never the model. Each file goes to a temporary name and is renamed when
complete. One shard is ``model.safetensors``; several get ``model.safetensors.index.json``
(``metadata.total_size``, ``weight_map``), written last. Files of an earlier save into the same
folder under these names are removed, as ``save_pretrained`` does, so the folder never mixes two saves.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from pathlib import Path
from typing import BinaryIO, Callable, Mapping, Sequence

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.weights.safetensors_files import INDEX

SINGLE = "model.safetensors"
_OURS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``123`` -> bytes (KB/MB/GB decimal as in transformers, KiB/MiB/GiB binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise HGraphError(f"{option} {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """The keys of ``sizes`` (key, bytes), in order, cut into shards of at most ``max_bytes``."""
    shards: list[list[str]] = []
    used = 0
    for key, size in sizes:
        if not shards or (used + size > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def write_shards(directory: Path, plan: list[list[str]], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 read: Callable[[str], torch.Tensor]) -> list[Path]:
    """Write the shards of ``plan``; ``specs``: each key's shape and dtype. Returns
    the files written (index last)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HGraphError(f"cannot make the output folder {str(directory)!r}: {exc.strerror or exc}") from None
    names = shard_names(len(plan))
    weight_map, total, written = {}, 0, []
    for name, keys in zip(names, plan):
        header, size = _header(keys, specs)
        tmp = directory / f".{name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                for key in keys:
                    _write_tensor(f, key, read(key), specs[key])
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise HGraphError(f"cannot write {str(directory / name)!r}: {exc.strerror or exc}") from None
        os.replace(tmp, directory / name)
        written.append(directory / name)
        weight_map.update((key, name) for key in keys)
        total += size
    stale = [f for f in directory.iterdir() if _OURS.match(f.name) and f.name not in names]
    if len(plan) > 1:
        index = directory / INDEX
        tmp = directory / f".{INDEX}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n",
                       encoding="utf-8")
        os.replace(tmp, index)
        written.append(index)
    else:
        stale.append(directory / INDEX)
    for f in stale:
        f.unlink(missing_ok=True)
    return written


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _header(keys: Sequence[str], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[bytes, int]:
    """The JSON header of a file holding ``keys`` in this order (padded to 8 bytes) and its data size."""
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        shape, dtype = specs[key]
        if dtype not in _DTYPES:
            raise HGraphError(f"{key!r} has dtype {dtype}, which safetensors export does not write")
        size = nbytes(shape, dtype)
        entries[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), offset


def _write_tensor(f: BinaryIO, key: str, t: torch.Tensor, spec: tuple[tuple[int, ...], torch.dtype]) -> None:
    """``t``'s bytes (C order, little-endian) after checking it is what the header announced."""
    shape, dtype = spec
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise HGraphError(f"{key!r} is {t.dtype} {list(t.shape)}, its header says {dtype} {list(shape)}")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:
        raise HGraphError("safetensors files are little-endian; writing them on a big-endian machine is not supported")
    f.write(memoryview(data.numpy()))
