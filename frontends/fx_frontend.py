"""The torch.fx frontend: trace an nn.Module and canonicalise it into the HGraph input form.

``trace(model)`` = ``tracer.trace_graph`` (torch.fx, leaf policy in ``hgraph.frontends.tracer``)
then ``canonicalize.canonicalize_graph`` (the canonical form is documented there). The returned
GraphModule shares the model's parameters (it holds references, not copies). The model is traced in
train mode, as it trains (the caller's mode is restored).

Mixture-of-experts blocks (whose routing is data-dependent) are recognised and traced as
``hgraph.moe.moe_layer`` (``hgraph.frontends.moe_blocks``). Other models fx cannot trace
(data-dependent control flow, ...) raise ``hgraph.TraceError`` with one line
naming the module and the line of code where tracing stopped.
"""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx
import torch.nn as nn

from hgraph.errors import TraceError
from hgraph.frontends.canonicalize import canonicalize_graph
from hgraph.frontends.moe_blocks import swapped_moe_blocks
from hgraph.frontends.tracer import LeafSpec, concrete_args_for, trace_graph

__all__ = ["trace"]


def trace(model: nn.Module, *, leaf_modules: Iterable[LeafSpec] = ()) -> fx.GraphModule:
    """The canonical GraphModule of ``model`` (placeholders ``input_ids``, ``position_ids``).

    ``leaf_modules``: module classes or qualified names the tracer must not trace into.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"hgraph traces nn.Module instances, got {type(model).__name__}")
    traced_inputs, _ = concrete_args_for(model)
    modes = {m: m.training for m in model.modules()}
    model.train()            # trace what training runs (train-mode branches, dropout)
    try:
        with swapped_moe_blocks(model):       # MoE blocks compute through hgraph's MoE op
            graph, _ = trace_graph(model, leaf_modules)
        canonicalize_graph(graph, model, traced_inputs)
    finally:
        for m, training in modes.items():
            m.training = training
    gm = fx.GraphModule(model, graph, class_name=f"{type(model).__name__}HGraph")
    if hasattr(model, "config"):
        gm.config = model.config
    return gm
