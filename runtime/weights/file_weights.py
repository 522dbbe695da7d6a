"""A ``WeightSource`` reading a model's values from files: safetensors, a torch state_dict, a checkpoint.

The files are a ``TensorTable``: every tensor's name and shape known up front (headers, a
memory-mapped state_dict, a checkpoint's manifest), and ``read(name, dim, lo, hi)`` for one segment.
``FileWeights(table, model, default)`` matches the table against the model (on the meta device), by
fully qualified name, before anything is read:

* a parameter is found under its own name or, for tied weights, under any of its aliases
  (``named_parameters(remove_duplicate=False)``: a Hugging Face file of a tied model holds
  ``model.embed_tokens.weight`` and no ``lm_head.weight``, a state_dict holds both); it is read once;
* a buffer the file holds (a persistent buffer of a state_dict) is taken from it; any other buffer
  is the model's own, from ``default`` (the seeded construction: non-persistent rotary tables, masks);
* any parameter missing, any name of the file that is neither a parameter (or alias) nor a buffer,
  and any shape that differs is an error: ONE line listing the first few of each kind and naming
  the file, raised while nothing has been read, so a run never starts half-loaded. Every rank checks
  the same headers, so every rank raises the same error before any collective.

``shards(layouts)`` then reads this rank's segment of every parameter (``layout.dim``,
``[lo, hi)``) and nothing else.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Protocol

import torch
import torch.nn as nn

from hgraph.errors import HGraphError
from hgraph.runtime.weights.sources import WeightSource
from hgraph.shard_rule import ShardLayout

_SHOWN = 3      # names shown per kind of mismatch


class TensorTable(Protocol):
    """Tensors in files, known by name and shape before any is read."""

    #: what and where the files are, for messages (``"safetensors index '/m/model.safetensors.index.json'"``)
    description: str
    shapes: Mapping[str, tuple[int, ...]]

    def where(self, name: str) -> str: ...

    def read(self, name: str, dim: Optional[int] = None, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor: ...

    def close(self) -> None: ...


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter's canonical name (``named_parameters()``) -> all its names, canonical first."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


class FileWeights:
    """The values of ``table`` for the model of ``record``."""

    def __init__(self, table: TensorTable, model: nn.Module, default: WeightSource) -> None:
        self.table = table
        self.description = table.description
        self.default = default          # buffers the files lack are the model's own (e.g. rotary tables)
        self.param_keys, self.buffer_keys = match(table, model)
        self._buffer_dtypes = {name: b.dtype for name, b in model.named_buffers()}

    def shards(self, layouts: Mapping[str, ShardLayout]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, layout in layouts.items():
            key = self.param_keys.get(name)
            if key is None:      # matching covers every parameter of the model the layouts come from
                raise HGraphError(f"{self.description}: {name!r} is not a parameter of the model it was matched with")
            yield name, self.table.read(key, layout.dim, layout.lo, layout.hi).reshape(layout.shard_shape)
        self.table.close()

    def buffers(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        rest = []
        for name in names:
            if name in self.buffer_keys:
                yield name, self.table.read(self.buffer_keys[name]).to(self._buffer_dtypes[name])
            else:
                rest.append(name)
        if rest:
            yield from self.default.buffers(rest)


def match(table: TensorTable, model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """(parameter -> its key in ``table``, buffer -> its key) for ``model``; one-line HGraphError listing
    missing, unexpected and mis-shaped keys when the table does not fit."""
    shapes = table.shapes
    params = dict(model.named_parameters())
    param_keys: dict[str, str] = {}
    missing, misshaped = [], []
    known: set[str] = set()
    for canonical, names in tied_aliases(model).items():
        known.update(names)
        want = tuple(params[canonical].shape)
        present = [n for n in names if n in shapes]
        if not present:
            missing.append(canonical)
            continue
        bad = [n for n in present if tuple(shapes[n]) != want]
        misshaped.extend(f"{n} {list(shapes[n])} in {_file(table, n)}, the model's {list(want)}" for n in bad)
        param_keys[canonical] = present[0]
    buffer_keys: dict[str, str] = {}
    for name, buf in model.named_buffers():
        known.add(name)
        if name in shapes:
            if tuple(shapes[name]) != tuple(buf.shape):
                misshaped.append(f"{name} {list(shapes[name])} in {_file(table, name)}, the model's {list(buf.shape)}")
            else:
                buffer_keys[name] = name
    unexpected = [f"{n} in {_file(table, n)}" for n in shapes if n not in known]
    if missing or unexpected or misshaped:
        parts = [f"{len(items)} {kind} ({'; '.join(items[:_SHOWN])}{'; ...' if len(items) > _SHOWN else ''})"
                 for kind, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                 if items]
        raise HGraphError(f"{table.description} does not fit {type(model).__name__}: {', '.join(parts)}; "
                          "nothing was loaded")
    return param_keys, buffer_keys


def _file(table: TensorTable, name: str) -> str:
    """The name of the file holding ``name`` (its folder is in the table's description)."""
    return Path(table.where(name)).name
