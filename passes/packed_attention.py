"""Packed attention: make every attention block-diagonal per document.

A packed micro-batch holds several documents in one row with per-document ``position_ids``; the
model's ``scaled_dot_product_attention(..., is_causal=True)`` would let a document attend to the ones
before it. This pass replaces each attention op by ``ops.packed_attention``, which takes the
micro-batch's documents from the runtime's ``comm`` (known on the host) or finds them from
``position_ids`` (a document starts at position 0), so a packed step computes exactly what running
each document alone computes. With CP > 1 it becomes ``ops.cp_attention``:
this rank's queries against the CP group's gathered keys, per document (layout from the runtime); with
UL > 1 (Ulysses) ``ops.ulysses_attention``: all-to-all to every token of the rank's CP shard with a
slice of the heads, attention per document (against the CP group's gathered keys when the scheme also
has CP: the K/V all-gather then happens inside that op, after the all-to-all), and back.
``ops.causal_attention`` (logit softcapping, a sliding window) is made per document the same way,
its ``softcap`` and ``window`` passed on. Attention with ``dropout_p`` (a train-mode model) becomes ``ops.packed_attention_dropout`` (or
``cp_attention`` / ``ulysses_attention`` with the dropout arguments): the masks are keyed per document, head, query and key
position (``runtime/kernels/dropout``), given the model's query head count so a TP rank keys its own
heads; with the compile option ``dropout=False`` the probabilities are not dropped.
It does nothing to a graph without attention.
"""
from __future__ import annotations

import torch.fx as fx

from hgraph import ops
from hgraph.errors import TraceError
from hgraph.meta import OpKind, get_meta
from hgraph.passes.context import PassContext
from hgraph.passes.dropout import dropout_site

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CAUSAL_ARGS = ("query", "key", "value", "dropout_p", "scale", "enable_gqa", "softcap", "window")


def packed_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite causal attention nodes into ``packed_attention(q, k, v, position_ids, scale, enable_gqa,
    softcap, window, comm)`` (or the CP / dropout variants); ``comm`` (None in a graph without a
    runtime) gives the micro-batch's documents as the host knows them."""
    pos = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "position_ids"), None)
    for node in gm.graph.nodes:
        if get_meta(node).op != OpKind.ATTENTION or node.target in (ops.packed_attention, ops.cp_attention,
                                                                     ops.packed_attention_dropout):
            continue
        if node.target is ops.causal_attention:     # softcap / sliding window: causal by definition
            bound = dict(zip(_CAUSAL_ARGS, node.args)) | dict(node.kwargs) | {"is_causal": True}
        else:
            bound = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
        if bound.get("attn_mask") is not None or not bound.get("is_causal", False):
            raise TraceError(f"attention {node.name} is not plain causal SDPA (mask or non-causal): "
                             "packed documents need is_causal=True without a mask")
        if pos is None:
            raise TraceError("packing needs a model that takes position_ids")
        q, k, v, scale, gqa = (bound["query"], bound["key"], bound["value"], bound.get("scale"),
                               bool(bound.get("enable_gqa", False)))
        p = float(bound.get("dropout_p") or 0.0) if ctx.options.dropout else 0.0
        comm = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "comm"), None)
        heads = ctx.shapes[q.name][0][1] if p else 0     # the HGraph's (whole model's) query heads
        variant = (bound.get("softcap"), bound.get("window"))
        if ctx.role.scheme.ul > 1:   # Ulysses: all-to-all to a head slice of every token, and back
            node.target, node.args = ops.ulysses_attention, (comm, q, k, v, "ul", scale, gqa, p, dropout_site(node),
                                                             heads, *variant)
            _check_ulysses(node, ctx)
        elif ctx.role.scheme.cp > 1:   # local queries against the CP group's gathered keys
            node.target, node.args = ops.cp_attention, (comm, q, k, v, scale, gqa, p, dropout_site(node), heads,
                                                        *variant)
        elif p:
            node.target, node.args = ops.packed_attention_dropout, (comm, q, k, v, p, dropout_site(node), scale,
                                                                    gqa, heads, *variant)
        else:
            node.target, node.args = ops.packed_attention, (q, k, v, pos, scale, gqa, *variant, comm)
        node.kwargs = {}
    return gm


def _check_ulysses(node: fx.Node, ctx: PassContext) -> None:
    """One clear line when a Ulysses scheme cannot run this attention: query heads must divide by
    TP x UL, key/value heads by TP (fewer key/value heads than UL are repeated at run time)."""
    scheme = ctx.role.scheme
    q, k = node.args[1], node.args[2]
    heads = [ctx.shapes[x.name][0][1] if x.name in ctx.shapes else None for x in (q, k)]
    if isinstance(heads[0], int) and heads[0] % (scheme.tp * scheme.ul):
        raise TraceError(f"scheme {scheme}: the model's {heads[0]} attention heads do not divide by TP x UL = "
                         f"{scheme.tp * scheme.ul}; UL must divide heads / TP")
    if isinstance(heads[1], int) and heads[1] % scheme.tp:
        raise TraceError(f"scheme {scheme}: the model's {heads[1]} key/value heads do not divide by TP = "
                         f"{scheme.tp}")
