"""MoE router: give each MoE op of a rank's graph the rank's ``comm``, through which the run's router
losses (load balancing, z-loss: ``runtime/engine/router_losses``) see its router logits and add their
gradient. A run without router losses has a context that hands the op's output back unchanged; a graph
run without a context (``comm=None``) computes what it computed before.
"""
from __future__ import annotations

import torch.fx as fx

from hgraph import moe
from hgraph.passes.context import PassContext


def moe_router_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """``moe_layer(x, router, *experts, ...)`` -> ``moe_layer(..., comm=comm)``; does nothing to a graph
    without MoE ops."""
    comm = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "comm"), None)
    for node in gm.graph.nodes:
        if node.target is moe.moe_layer and comm is not None:
            node.kwargs = {**node.kwargs, "comm": comm}
    return gm
