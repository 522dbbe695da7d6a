"""The parameters of one rank for one Program, as Pull Parameter and Push Gradient work on them.

``RankParams`` holds what the pull (``runtime/comm/pull``), the push (``runtime/comm/push``) and the
overlapped update (``runtime/comm/overlapped_update``) share: the Program, this rank's fp32 optimizer
shards (the masters; sharded over the rank's shard group, ``group_size`` ranks, and replicated across
the groups), the working tensors its graph holds, their ``ParamShard``, and the model order
of the parameters (``Program.param_names``, which is ``list(hgraph.params)``), which fixes the
order of every message. ``SyncStats`` counts the bytes of one step.

A rank reads only its own part of the Program: its LNK ops (``rank_program``, ``Program.rank``), the
parameters' layouts and what each one's pull and push are across the world (``exchange``:
``Program.exchange``), never the world's plans (``Program.pull_plans``), whose cost grows with the
world.

Work is layout "rows first": the shard dimension is moved to dimension 0 (``rows``), so a range of
rows is a ``narrow(0, ...)``; received and reduced rows are held as ``((lo, hi), rows)`` pairs in
full-parameter coordinates (``lookup``). A stacked expert tensor that the Program plans per expert is
held here as its pieces (``ExpertPieces``: views of the stacked tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Mapping, Sequence

import torch

from hgraph.expert_pieces import holds, piece_name, piece_view, split_shards
from hgraph.program import Program
from hgraph.shard_rule import group_shard_bounds, replica_ranks, shard_group_ranks

Range = tuple[int, int]


def rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its shard dimension first (a 0-d tensor becomes one row of one element)."""
    return t.reshape(1) if t.dim() == 0 else t.movedim(dim, 0)


def laid_out_rows(flat: torch.Tensor, n: int, rest: Sequence[int], dim: int) -> torch.Tensor:
    """``n`` rows (row shape ``rest``) of a parameter sharded along ``dim`` in the buffer ``flat``,
    stored as the parameter lays them out (along ``dim``) and viewed rows first: ``movedim(0, dim)``
    of all ``n`` is then contiguous, as torch's fused optimizer kernels need their tensors."""
    rest = list(rest)
    return flat.view(*rest[:dim], n, *rest[dim:]).movedim(dim, 0)


def lookup(held: Sequence[tuple[Range, torch.Tensor]], lo: int, hi: int, name: str) -> torch.Tensor:
    """Rows ``[lo, hi)`` from the one held buffer that contains them."""
    for (a, b), t in held:
        if a <= lo and hi <= b:
            return t.narrow(0, lo - a, hi - lo)
    raise AssertionError(f"{name}: rows [{lo}, {hi}) are in no buffer this rank holds")


class ExpertPieces:
    """A Program's stacked expert tensors as the per-expert pieces its plans name (``Program.pieces``,
    ``hgraph.expert_pieces``) on one rank: the masters, working tensors and shards by piece (views of the
    stacked ones), its gradients by piece, and the pushed gradient shards stacked back for the optimizer.
    Nothing is changed where the Program names no piece."""

    def __init__(self, program: Program, shards: Mapping[str, Any]) -> None:
        self.pieces = dict(program.pieces)
        self.experts: dict[str, int] = {}
        for piece in self.pieces.values():
            self.experts[piece.param] = max(self.experts.get(piece.param, 0), piece.expert + 1)
        self.stacked_shards = shards
        # stacked tensor -> its pieces this rank holds, with their experts
        self.held = {name: [(piece_name(name, e), e) for e in range(n) if holds(shards[name], e)]
                     for name, n in self.experts.items() if name in shards}

    def masters(self, masters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fp32 masters by piece: expert ``e``'s is ``master[e]`` (the optimizer's shard of a stacked
        tensor holds every expert's rows of its segment)."""
        return self._split(masters, lambda name, t, e: piece_view(t, None, e), every=True)

    def working(self, working: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The working tensors (or gradients, ``None`` kept) of the pieces this rank holds, as views."""
        return self._split(working, lambda name, t, e: None if t is None
                           else piece_view(t.detach(), self.stacked_shards[name], e))

    def shards(self) -> dict[str, Any]:
        return split_shards(self.stacked_shards, {n: k for n, k in self.experts.items() if n in self.stacked_shards})

    def _split(self, by_name: Mapping[str, Any], view, every: bool = False) -> dict[str, Any]:
        if not self.experts:
            return dict(by_name)
        out: dict[str, Any] = {}
        for name, t in by_name.items():
            if name not in self.experts:
                out[name] = t
            elif every:
                out.update((piece_name(name, e), view(name, t, e)) for e in range(self.experts[name]))
            else:
                out.update((piece, view(name, t, e)) for piece, e in self.held.get(name, ()))
        return out

    def stacked(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The pushed gradient shards by piece made whole again (one copy of the rank's 1/N of each stacked
        tensor), by the names the optimizer holds."""
        if not self.experts:
            return shards
        out = {}
        for name, t in shards.items():
            piece = self.pieces.get(name)
            if piece is None:
                out[name] = t
            elif piece.expert == 0:
                out[piece.param] = torch.stack([shards[piece_name(piece.param, e)]
                                                for e in range(self.experts[piece.param])])
        return out


@dataclass
class SyncStats:
    """Bytes this rank moved in the last step (point-to-point and collective payloads it received)."""

    pull_recv_bytes: int = 0
    pull_send_bytes: int = 0
    pull_all_gather_bytes: int = 0
    push_recv_bytes: int = 0
    push_send_bytes: int = 0
    push_reduce_scatter_bytes: int = 0
    push_replica_bytes: int = 0          # the shards all-reduced across the shard groups (--shard-group)

    def reset(self) -> None:
        """Zero every counter (a step begins; the pull and the push count into the same object)."""
        for f in fields(self):
            setattr(self, f.name, 0)


@dataclass(frozen=True)
class RankParams:
    """The parameters of ``rank`` for ``program``.

    ``masters``: this rank's fp32 optimizer shards (name -> tensor, shard dimension as in the
    optimizer, ``[1]`` for a 0-d parameter); ``working``: the working tensors of the parameters this
    rank's graph holds (shard shape, working dtype); ``shards``: their ``ParamShard``; ``aliased``:
    working tensors that share their fp32 master's storage (one rank, fp32: nothing to move).
    """

    program: Program
    rank: int
    masters: Mapping[str, torch.Tensor]
    working: Mapping[str, torch.Tensor]
    shards: Mapping[str, Any]
    working_dtype: torch.dtype
    aliased: frozenset

    @property
    def world_size(self) -> int:
        return self.program.cluster.world_size

    @property
    def group_size(self) -> int:
        """Ranks over which the optimizer shards (``--shard-group``; the world by default)."""
        return self.program.cluster.group_size

    @property
    def shard_group(self) -> tuple[int, ...]:
        """The ranks sharing this rank's copy of the optimizer states (its Pull and Push stay inside)."""
        return shard_group_ranks(self.rank, self.group_size)

    @property
    def replicas(self) -> tuple[int, ...]:
        """The ranks holding the same optimizer shards as this one, one per shard group."""
        return replica_ranks(self.rank, self.group_size, self.world_size)

    @cached_property
    def order(self) -> list[str]:
        """Every parameter in model order."""
        return self.program.param_names

    @cached_property
    def rank_program(self) -> Any:
        """This rank's part of the Program (``RankProgram``: its LNK ops, its contributions)."""
        return self.program.rank(self.rank)

    @cached_property
    def _exchanges(self) -> dict[str, Any]:
        return {name: self.program.exchange(name) for name in self.order}

    def exchange(self, name: str) -> Any:
        """What ``name``'s pull and push are across the world (``ParamExchange``: its layout, whether
        the pull is an all-gather and the push a plain reduce-scatter)."""
        return self._exchanges[name]

    def layout(self, name: str) -> Any:
        """``name``'s ``ParamLayout`` (shape, shard dimension)."""
        return self._exchanges[name].param

    def segment(self, param: Any) -> Range:
        """This rank's optimizer segment (rows) of ``param``."""
        return group_shard_bounds(param.size, self.rank, self.group_size)
