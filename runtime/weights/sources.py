"""Where a run's initial weights come from: a ``WeightSource`` hands each rank its optimizer segments.

A source is asked for ``shards(layouts)``: ``(name, segment)`` for every parameter of ``layouts``
(the rank's ``ShardLayout`` per parameter, ``hgraph.shard_rule``), each segment of the
layout's ``shard_shape``, fp32 or any float dtype (the optimizer copies it into its fp32 master); and
for ``buffers(names)``: full buffers by name (small: rotary tables, masks). A source never hands the
whole model at once: it reads (or computes) one tensor, yields this rank's part, and moves on.

``SeededInit``: the model's own initialisation, replayed from its meta-device construction
(``hgraph.runtime.weights.deferred_init``), bitwise equal to building it after
``torch.manual_seed(seed)``; the default of every run. ``EagerInit``: the same values from a model
built whole, for the rare model whose construction cannot be recorded (it reads tensor values).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Protocol

import torch
import torch.nn as nn

from hgraph.runtime.weights.deferred_init import InitRecord
from hgraph.shard_rule import ShardLayout


class WeightSource(Protocol):
    """Initial values of a model's parameters (segments) and buffers (whole)."""

    #: what the values are, for messages (``"seeded init (seed 0)"``, a path)
    description: str

    def shards(self, layouts: Mapping[str, ShardLayout]) -> Iterator[tuple[str, torch.Tensor]]: ...

    def buffers(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]: ...


class SeededInit:
    """The model's own initialisation after ``torch.manual_seed(seed)``, one tensor at a time."""

    def __init__(self, record: InitRecord) -> None:
        self.record = record
        self.description = f"the seeded initialisation of {type(record.model).__name__} (seed {record.seed})"

    def shards(self, layouts: Mapping[str, ShardLayout]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in self.record.replay(set(layouts)):
            yield name, layouts[name].slice_of(full).clone()

    def buffers(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in self.record.replay(set(names)):
            yield name, full.clone()


class EagerInit:
    """The parameters and buffers of a model built eagerly (whole, on CPU)."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.description = f"the initialisation of {type(model).__name__} built whole (seed {seed})"

    def shards(self, layouts: Mapping[str, ShardLayout]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, layout in layouts.items():
            yield name, layout.slice_of(self.tensors[name].detach()).clone()

    def buffers(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.tensors[name].detach().clone()


def install_buffers(model: nn.Module, source: WeightSource, device: torch.device) -> None:
    """Replace the model's (meta) buffers by real ones from ``source``, on ``device``."""
    names = [name for name, _ in model.named_buffers()]
    for name, value in source.buffers(names):
        *path, leaf = name.split(".")
        owner = model.get_submodule(".".join(path))
        owner._buffers[leaf] = value.to(device)
