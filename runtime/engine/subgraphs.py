"""Cutting runs of a rank graph's nodes out into graphs of their own (recompute's outlined blocks, the
compiled regions of ``--compile``)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch.fx as fx


def comm_placeholder(graph: fx.Graph) -> Optional[fx.Node]:
    """The graph's ``comm`` input (the rank's communication context), None when it has none."""
    return next((n for n in graph.nodes if n.op == "placeholder" and n.name == "comm"), None)


def extract_subgraph(nodes: Sequence[fx.Node]) -> tuple[fx.Graph, list[fx.Node], list[fx.Node]]:
    """A graph computing ``nodes`` (in graph order): its placeholders are the values they read from
    outside (``inputs``, in first-use order), its output the tuple of those of ``nodes`` used outside
    (``outputs``)."""
    inside = set(nodes)
    body, env, inputs = fx.Graph(), {}, []
    for m in nodes:
        for a in m.all_input_nodes:
            if a not in inside and a not in env:
                env[a] = body.placeholder(a.name)
                inputs.append(a)
        env[m] = body.node_copy(m, lambda x: env[x])
    outputs = [m for m in nodes if any(u not in inside for u in m.users)]
    body.output(tuple(env[m] for m in outputs))
    return body, inputs, outputs
