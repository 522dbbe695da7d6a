"""Packed attention: make every attention block-diagonal per document.

A packed micro-batch holds several documents in one row with per-document ``position_ids``; the
model's ``scaled_dot_product_attention(..., is_causal=True)`` would let a document attend to the ones
before it. This pass replaces each attention op by ``graph_ops.packed_attention``, which finds the
documents from ``position_ids`` (a document starts at position 0), so a packed step computes exactly
what running each document alone computes. It does nothing to a graph without attention.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from hgraph.errors import TraceError
from hgraph.meta import OpKind, get_meta
from hgraph.runtime import graph_ops

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def packed_attention_pass(gm: fx.GraphModule, ctx: Any) -> fx.GraphModule:
    """Rewrite causal SDPA nodes into ``packed_attention(q, k, v, position_ids, scale, enable_gqa)``."""
    pos = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "position_ids"), None)
    for node in gm.graph.nodes:
        if get_meta(node).op != OpKind.ATTENTION or node.target is graph_ops.packed_attention:
            continue
        bound = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
        if bound.get("attn_mask") is not None or not bound.get("is_causal", False) or bound.get("dropout_p", 0.0):
            raise TraceError(f"attention {node.name} is not plain causal SDPA (mask, non-causal or dropout): "
                             "packed documents need is_causal=True without a mask or dropout")
        if pos is None:
            raise TraceError("packing needs a model that takes position_ids")
        node.target = graph_ops.packed_attention
        node.args = (bound["query"], bound["key"], bound["value"], pos, bound.get("scale"),
                     bool(bound.get("enable_gqa", False)))
        node.kwargs = {}
    return gm
