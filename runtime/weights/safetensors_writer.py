"""Write tensors into safetensors files the way ``save_pretrained`` does, one output shard at a time.

``plan_shards(sizes, max_bytes)`` cuts the tensors, in order, into shards of at most ``max_bytes``
(a tensor larger than that gets a shard of its own, as in transformers) from their byte sizes alone,
so the file names (``model-0000K-of-0000N.safetensors``) are known before anything is read.
``write_shards(directory, plan, read)`` then asks ``read(key)`` for each tensor of one shard, writes
that shard (``safetensors.torch.save_file`` to a temporary name, then renamed) and lets it go: a
process holds at most one shard, never the model. One shard is ``model.safetensors``; several get
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), written last. Files of an
earlier save into the same folder under these names are removed, as ``save_pretrained`` does, so the
folder never mixes two saves.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Sequence

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.weights.safetensors_files import INDEX

SINGLE = "model.safetensors"
_OURS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
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


def write_shards(directory: Path, plan: list[list[str]], read: Callable[[str], torch.Tensor]) -> list[Path]:
    """Write the shards of ``plan`` (module docstring); returns the files written (index last)."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    names = shard_names(len(plan))
    weight_map, total, written = {}, 0, []
    for name, keys in zip(names, plan):
        tensors = {}
        for key in keys:
            t = read(key).contiguous()
            tensors[key] = t
            total += t.numel() * t.element_size()
            weight_map[key] = name
        tmp = directory / f".{name}.tmp-{os.getpid()}"
        try:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise HGraphError(f"cannot write {str(directory / name)!r}: {exc.strerror or exc}") from None
        os.replace(tmp, directory / name)
        written.append(directory / name)
        del tensors
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
