"""A stacked ``[E, ...]`` expert tensor seen as ``E`` per-expert pieces for Pull Parameter and Push Gradient.

Under EP an EP rank holds only its own experts of a stacked or fused expert tensor (Hugging Face's
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), each TP-sharded inside along another axis. The LNK
plans describe ranges along one dimension, so the tensor is planned as ``E`` parameters ``name[e]`` of
shape ``shape[1:]``, sharded along ``shard_dim - 1``: expert ``e``'s pull reaches, and its push reduces
over, exactly the ranks holding it. The optimizer's layout does not change (and does not depend on the
strategy): its shard of ``name`` is rows ``shard_bounds(S, r, N)`` along ``shard_dim`` of every expert,
which is exactly its shard of each piece, so a piece's master is a view of the stacked master. A
Program whose strategy has no EP pipeline plans the tensor whole, as before.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, NamedTuple, Optional

import torch

from hgraph.program import ParamShard


class ExpertPiece(NamedTuple):
    """Expert ``expert`` of the stacked parameter ``param``."""

    param: str
    expert: int


def piece_name(param: str, expert: int) -> str:
    """The name a stacked parameter's expert is planned under."""
    return f"{param}[{expert}]"


def pieces_of(stacked: Mapping[str, int]) -> dict[str, ExpertPiece]:
    """Every piece name of the stacked parameters ``stacked`` (name -> number of experts), in order."""
    return {piece_name(name, e): ExpertPiece(name, e) for name, experts in stacked.items() for e in range(experts)}


def holds(shard: ParamShard, expert: int) -> bool:
    """Whether a rank with ``shard`` of a stacked parameter holds ``expert``."""
    return shard.experts is None or shard.experts[0] <= expert < shard.experts[1]


def piece_shard(shard: ParamShard, expert: int) -> Optional[ParamShard]:
    """The rank's shard of ``expert`` of a stacked parameter (None when it does not hold it)."""
    if not holds(shard, expert):
        return None
    return replace(shard, name=piece_name(shard.name, expert), full_shape=tuple(shard.full_shape[1:]),
                   shard_dim=shard.shard_dim - 1, experts=None)


def split_shards(shards: Mapping[str, ParamShard], stacked: Mapping[str, int]) -> dict[str, ParamShard]:
    """``shards`` (name -> shard, model order) with each stacked parameter replaced by its held pieces."""
    out: dict[str, ParamShard] = {}
    for name, shard in shards.items():
        if name not in stacked:
            out[name] = shard
            continue
        for e in range(stacked[name]):
            piece = piece_shard(shard, e)
            if piece is not None:
                out[piece.name] = piece
    return out


def piece_view(t: torch.Tensor, shard: Optional[ParamShard], expert: int) -> torch.Tensor:
    """Expert ``expert``'s part of ``t``, a tensor laid out as ``shard`` (a working tensor or gradient;
    ``shard`` None: a tensor holding every expert, such as the fp32 master): a view."""
    return t[expert - (shard.experts[0] if shard is not None and shard.experts is not None else 0)]
