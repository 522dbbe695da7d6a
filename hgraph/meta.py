"""Typed node metadata: one frozen dataclass under ``node.meta["hgraph"]``, read through accessors.

Every node of an HGraph carries a ``NodeMeta``. Passes never write loose string keys into
``node.meta``; they replace the dataclass with ``dataclasses.replace`` through ``update_meta``.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

META_KEY = "hgraph"


class SlotKind(str, enum.Enum):
    """The three kinds of subgraph a strategy may put into a slot (Hydraulis §5.3)."""

    PULL_PARAMETER = "pull_parameter"
    PUSH_GRADIENT = "push_gradient"
    COMM_ACTIVATION = "comm_activation"


class CommPoint(str, enum.Enum):
    """Where a ``comm_activation`` slot sits, i.e. what a strategy may need to do there."""

    TP_ENTER = "tp_enter"            # input of a column-parallel group (Megatron f: identity fwd / all-reduce bwd)
    TP_EXIT = "tp_exit"              # output of a row-parallel linear or vocab-parallel embedding (all-reduce fwd)
    TP_GATHER = "tp_gather"          # output of a column-parallel linear whose full output is needed (lm head)
    CP_KV = "cp_kv"                  # key / value entering attention (all-gather across CP)
    UL_A2A = "ul_a2a"                # q / k / v entering and the output leaving Ulysses attention (all-to-all)
    PP_BOUNDARY = "pp_boundary"      # hidden state leaving a block (send / recv between stages)
    EP_DISPATCH = "ep_dispatch"      # an MoE op's token rows to their experts' EP ranks (counts, all-to-all)
    EP_COMBINE = "ep_combine"        # the experts' outputs back to their tokens' EP ranks (all-to-all)


class TPRole(str, enum.Enum):
    """How tensor parallelism treats a parameterised op (Megatron conventions)."""

    COLUMN = "column"                # weight [out, in] split on out (dim 0)
    ROW = "row"                      # weight [out, in] split on in (dim 1); bias added after the all-reduce
    VOCAB = "vocab"                  # embedding table [vocab, hidden] split on vocab (dim 0)
    REPLICATED = "replicated"        # every TP rank holds the whole tensor (norm weights, ...)
    EXPERTS = "experts"              # hgraph's MoE op: a column/row pair inside each expert (gate/up by
    #                                  output row, down by input column), whole tokens in, partial sums out


class OpKind(str, enum.Enum):
    """Computational ops the passes care about (everything else is OTHER)."""

    LINEAR = "linear"
    EMBEDDING = "embedding"
    ATTENTION = "attention"
    OTHER = "other"


@dataclass(frozen=True)
class NodeMeta:
    """What hgraph knows about one FX node.

    block: the module path of the block the node belongs to (``"layers.3"``), ``"pre"`` for nodes
        before the first block (embedding), ``"post"`` after the last one (final norm, head), or None
        for nodes that only depend on graph inputs (e.g. rotary tables), which every stage may recompute.
    layer: index of the block among the repeated blocks, or None.
    op: the op kind of a computational node.
    tp_role: for parameterised ops and for parameter nodes, how TP shards them.
    param: for ``get_attr`` nodes and parameter slots, the parameter's fully qualified name.
    shard_dim: for parameter nodes, the dimension TP (and the optimizer layout) splits, or None.
    slot: for slot nodes, the slot kind; ``comm_point`` says where a comm_activation slot sits.
    subgraph: after instantiation, an id grouping the nodes of one filled subgraph.
    comm: after instantiation, the communication a node performs (a runtime CommSpec), or None.
    tp_reason: for a linear TP replicates although it is in a block, the node that blocked sharding.
    tp_rewrite: for a view/reshape of a TP-sharded value that writes out a size TP divides: (position of
        that size in the target shape, the column-parallel weight whose shard gives the local size);
        position -1: the node cuts a fused projection into parts (split, chunk, slice); position -2: a
        sum or mean over the whole (TP-sharded) feature dim, kept for the broadcast (a full-width norm):
        each rank reduces its slice and the partial results are all-reduced.
    tp_parts: for a column-parallel linear whose output is cut into parts (fused q/k/v, gate/up), the
        parts' output row ranges: each TP rank holds its slice of every part.
    tp_partial: an op reading a whole parameter on TP-sharded heads (a per-head norm's weight), or
        computing the scale of a partial sum reduced later (``passes/partial_sums``): each TP rank's
        gradient of that parameter is its part only, so the push sums them.
    """

    block: Optional[str] = None
    layer: Optional[int] = None
    op: OpKind = OpKind.OTHER
    tp_role: Optional[TPRole] = None
    param: Optional[str] = None
    shard_dim: Optional[int] = None
    slot: Optional[SlotKind] = None
    comm_point: Optional[CommPoint] = None
    subgraph: Optional[str] = None
    comm: Any = None
    tp_reason: Optional[str] = None
    tp_rewrite: Optional[tuple[int, str]] = None
    tp_parts: Optional[tuple[tuple[int, int], ...]] = None
    tp_partial: bool = False


def get_meta(node: fx.Node) -> NodeMeta:
    """The node's NodeMeta (an empty one if it has none yet)."""
    m = node.meta.get(META_KEY)
    return m if isinstance(m, NodeMeta) else NodeMeta()


def set_meta(node: fx.Node, meta: NodeMeta) -> None:
    node.meta[META_KEY] = meta


def update_meta(node: fx.Node, **changes: Any) -> NodeMeta:
    """Replace fields of the node's NodeMeta; returns the new value."""
    new = dataclasses.replace(get_meta(node), **changes)
    node.meta[META_KEY] = new
    return new


def is_slot(node: fx.Node, kind: Optional[SlotKind] = None) -> bool:
    m = get_meta(node)
    return m.slot is not None and (kind is None or m.slot == kind)
