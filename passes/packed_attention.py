"""Packed attention: make every attention block-diagonal per document.

A packed micro-batch holds several documents in one row with per-document ``position_ids``; the
model's ``scaled_dot_product_attention(..., is_causal=True)`` would let a document attend to the ones
before it. This pass replaces each attention op by ``ops.packed_attention``, which finds the
documents from ``position_ids`` (a document starts at position 0), so a packed step computes exactly
what running each document alone computes. With CP > 1 it becomes ``ops.cp_attention``:
this rank's queries against the CP group's gathered keys, per document (layout from the runtime).
It does nothing to a graph without attention.
"""
from __future__ import annotations

import torch.fx as fx

from hgraph import ops
from hgraph.errors import TraceError
from hgraph.meta import OpKind, get_meta
from hgraph.passes.context import PassContext

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def packed_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite causal SDPA nodes into ``packed_attention(q, k, v, position_ids, scale, enable_gqa)``."""
    pos = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "position_ids"), None)
    for node in gm.graph.nodes:
        if get_meta(node).op != OpKind.ATTENTION or node.target in (ops.packed_attention, ops.cp_attention):
            continue
        bound = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
        if bound.get("attn_mask") is not None or not bound.get("is_causal", False) or bound.get("dropout_p", 0.0):
            raise TraceError(f"attention {node.name} is not plain causal SDPA (mask, non-causal or dropout): "
                             "packed documents need is_causal=True without a mask or dropout")
        if pos is None:
            raise TraceError("packing needs a model that takes position_ids")
        q, k, v, scale, gqa = (bound["query"], bound["key"], bound["value"], bound.get("scale"),
                               bool(bound.get("enable_gqa", False)))
        if ctx.role.scheme.cp > 1:   # local queries against the CP group's gathered keys
            comm = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "comm")
            node.target, node.args = ops.cp_attention, (comm, q, k, v, scale, gqa)
        else:
            node.target, node.args = ops.packed_attention, (q, k, v, pos, scale, gqa)
        node.kwargs = {}
    return gm
