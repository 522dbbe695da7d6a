"""Packed attention: make every attention block-diagonal per document.

A packed micro-batch holds several documents in one row with per-document ``position_ids``; the
model's ``scaled_dot_product_attention(..., is_causal=True)`` would let a document attend to the ones
before it. This pass replaces each attention op by ``ops.packed_attention``, which takes the
micro-batch's documents from the runtime's ``comm`` (known on the host) or finds them from
``position_ids`` (a document starts at position 0), so a packed step computes exactly what running
each document alone computes. With CP > 1 it becomes ``ops.cp_attention``:
this rank's queries against the CP group's gathered keys, per document (layout from the runtime); with
UL > 1 (Ulysses) a Communicate Activation subgraph around ``ops.ulysses_attention``: the all-to-alls of
q, k and v (``ulysses_heads_issue``, all three issued, then their ``comm_wait``s) to every token of the
rank's CP shard with a slice of the heads; with CP also the all-gathers of k and v over the CP group
(``cp_kv_gather_issue``: USP's 2-D); attention per document; the inverse all-to-all of the output
(``ulysses_tokens_issue`` + ``comm_wait``).
``ops.causal_attention`` (logit softcapping, a sliding window) is made per document the same way,
its ``softcap`` and ``window`` passed on. Attention with ``dropout_p`` (a train-mode model) becomes
``ops.packed_attention_dropout`` (or ``cp_attention`` / ``ulysses_attention`` with the dropout
arguments): the masks are keyed per document, head, query and key position
(``runtime/kernels/dropout``), given the model's query head count so a TP rank keys its own heads;
with the compile option ``dropout=False`` the probabilities are not dropped.
It does nothing to a graph without attention.
"""
from __future__ import annotations

import torch.fx as fx

from hgraph.dims import BindingKey
from hgraph import ops
from hgraph.errors import TraceError
from hgraph.meta import CommPoint, NodeMeta, OpKind, SlotKind, get_meta, set_meta
from hgraph.passes.context import PassContext
from hgraph.passes.dropout import dropout_site

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CAUSAL_ARGS = ("query", "key", "value", "dropout_p", "scale", "enable_gqa", "softcap", "window")


def packed_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite causal attention nodes into ``packed_attention(q, k, v, position_ids, scale, enable_gqa,
    softcap, window, comm)`` (or the CP / dropout variants); ``comm`` (None in a graph without a
    runtime) gives the micro-batch's documents as the host knows them."""
    pos = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "position_ids"), None)
    for node in list(gm.graph.nodes):
        if get_meta(node).op != OpKind.ATTENTION or node.target in (ops.packed_attention, ops.cp_attention,
                                                                     ops.packed_attention_dropout,
                                                                     ops.ulysses_attention):
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
            _check_ulysses(q, k, ctx)
            q, k, v = _ulysses_inputs(gm.graph, node, comm, q, k, v, ctx.role.scheme.cp > 1)
            node.target, node.args = ops.ulysses_attention, (comm, q, k, v, scale, gqa, p, dropout_site(node),
                                                             heads, *variant)
            _ulysses_output(gm.graph, node, comm)
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


def _mark(node: fx.Node, attention: fx.Node, point: CommPoint, part: str, name: str) -> fx.Node:
    """``node`` (named ``name``) in the Communicate Activation subgraph ``part`` of ``attention``."""
    m = get_meta(attention)
    set_meta(node, NodeMeta(block=m.block, layer=m.layer, slot=SlotKind.COMM_ACTIVATION, comm_point=point,
                            subgraph=f"{point.value}:{attention.name}_{part}"))
    node.name = f"{name}_{attention.name}"
    return node


def _ulysses_inputs(g: fx.Graph, node: fx.Node, comm: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node,
                    cp: bool) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Before ``node``: the all-to-alls of q, k, v issued together, then waited (three in flight on the
    comm stream); with CP, the all-gathers of k and v over the CP group after them."""
    a2a = CommPoint.UL_A2A
    with g.inserting_before(node):
        issued = [(_mark(g.call_function(ops.ulysses_heads_issue, (comm, x, BindingKey.UL, kv)), node, a2a, "in",
                         f"all_to_all_{c}"), c) for x, kv, c in ((q, False, "q"), (k, True, "k"), (v, True, "v"))]
        q, k, v = (_mark(g.call_function(ops.comm_wait, (comm, i)), node, a2a, "in", f"wait_{c}") for i, c in issued)
        if cp:           # the keys and values of every CP shard, with this rank's heads (dim 2: tokens)
            issued = [(_mark(g.call_function(ops.cp_kv_gather_issue, (comm, x, BindingKey.CP, 2)), node, CommPoint.CP_KV,
                             "kv", f"cp_all_gather_{c}"), c) for x, c in ((k, "k"), (v, "v"))]
            k, v = (_mark(g.call_function(ops.comm_wait, (comm, i)), node, CommPoint.CP_KV, "kv", f"cp_wait_{c}")
                    for i, c in issued)
    return q, k, v


def _ulysses_output(g: fx.Graph, node: fx.Node, comm: fx.Node) -> None:
    """After ``node``: the inverse all-to-all of its output, issued and waited; its users read the wait."""
    with g.inserting_after(node):
        issue = _mark(g.call_function(ops.ulysses_tokens_issue, (comm, node, BindingKey.UL)), node, CommPoint.UL_A2A, "out",
                      "all_to_all_out")
    with g.inserting_after(issue):
        wait = _mark(g.call_function(ops.comm_wait, (comm, issue)), node, CommPoint.UL_A2A, "out", "wait_out")
    node.replace_all_uses_with(wait, delete_user_cb=lambda user: user is not issue)


def _check_ulysses(q: fx.Node, k: fx.Node, ctx: PassContext) -> None:
    """One clear line when a Ulysses scheme cannot run an attention of ``q``, ``k``: query heads must divide by
    TP x UL, key/value heads by TP (fewer key/value heads than UL are repeated at run time)."""
    scheme = ctx.role.scheme
    heads = [ctx.shapes[x.name][0][1] if x.name in ctx.shapes else None for x in (q, k)]
    if isinstance(heads[0], int) and heads[0] % (scheme.tp * scheme.ul):
        raise TraceError(f"scheme {scheme}: the model's {heads[0]} attention heads do not divide by TP x UL = "
                         f"{scheme.tp * scheme.ul}; UL must divide heads / TP")
    if isinstance(heads[1], int) and heads[1] % scheme.tp:
        raise TraceError(f"scheme {scheme}: the model's {heads[1]} key/value heads do not divide by TP = "
                         f"{scheme.tp}")
