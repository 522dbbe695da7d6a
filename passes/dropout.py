"""Dropout: give each train-mode dropout of the model its runtime context and its site.

The frontends turn a model's train-mode dropout into ``ops.keyed_dropout(x, p)`` (and keep SDPA's
``dropout_p``, which the packed-attention pass handles). Masks are keyed by what each element is
(``runtime/kernels/dropout``); this pass adds the two things the op needs to draw them: the rank's
``comm`` (the micro-batch's token keys) and the dropout's *site*, a number that tells the model's
dropouts apart and is the same on every rank and in every strategy (a hash of the node's name,
which the instantiation passes keep); under sequence parallelism a dropout of a token-sliced value
also gets ``tokens="tp"``, so it draws the masks of the rank's tokens. With the compile option
``dropout=False`` every dropout becomes the identity (``p = 0``).
"""
from __future__ import annotations

import zlib

import torch.fx as fx

from hgraph.dims import BindingKey
from hgraph import ops
from hgraph.passes.context import PassContext


def dropout_site(node: fx.Node) -> int:
    """The site number of a dropout node (stable across ranks, roles and strategies)."""
    return zlib.crc32(node.name.encode())


def dropout_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """``keyed_dropout(x, p)`` -> ``keyed_dropout(x, p, comm=comm, site=...)`` (``p = 0`` when off)."""
    comm = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "comm"), None)
    for node in gm.graph.nodes:
        if node.target is not ops.keyed_dropout:
            continue
        x, p = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        node.args = (x, float(p) if ctx.options.dropout else 0.0)
        node.kwargs = {"comm": comm, "site": dropout_site(node)}
        if ctx.sp is not None and node.name in ctx.sp.sliced:     # x holds this TP rank's token slice
            node.kwargs = {**node.kwargs, "tokens": BindingKey.TP}
    return gm
