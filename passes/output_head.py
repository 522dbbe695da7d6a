"""Make the last stage's output head one op, so the runtime can compute the loss without the logits.

The graph of a last stage ends ``linear(h, w, b)`` -> (under TP: ``tp_gather_issue`` -> ``comm_wait``
-> the ``narrow`` cutting the vocabulary padding) -> output. This pass replaces that chain by
``ops.output_head(comm, h, w, b, "tp", sizes, vocab)``: called as a plain module it computes the same
logits; under the runtime it returns the head's inputs (``ops.HeadInputs``) and the loss is made chunk
by chunk from them, vocabulary-parallel under TP (``runtime/kernels/head_cross_entropy``).

It does nothing on other stages, or when the output is not a linear's value through exactly that chain
(e.g. a logit soft-cap or a scale after the head): those graphs return their logits as before.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from hgraph.dims import BindingKey
from hgraph import ops
from hgraph.meta import get_meta, set_meta
from hgraph.passes.context import PassContext

_LINEAR = torch.nn.functional.linear


def _single_use(node: object) -> bool:
    return isinstance(node, fx.Node) and len(node.users) == 1


def _head_chain(out: fx.Node) -> Optional[tuple[list[fx.Node], Optional[tuple[int, ...]], Optional[int]]]:
    """``(nodes from out back to the linear, sizes, vocab)`` when ``out`` is a head's logits
    (a linear; under TP then its gather, wait and padding narrow), each node used only by the one after it;
    else None."""
    node, vocab, sizes, chain = out, None, None, []
    if node.op == "call_function" and node.target is torch.narrow:
        x, dim, start, length = (tuple(node.args) + (None,) * 4)[:4]
        if dim != -1 or start != 0 or not isinstance(length, int) or not _single_use(x):
            return None
        chain.append(node)
        node, vocab = x, length
    if node.op == "call_function" and node.target is ops.comm_wait:
        issue = node.args[1]
        if not (_single_use(issue) and issue.target is ops.tp_gather_issue):
            return None
        _, x, key, dim, issue_sizes = issue.args[:5]
        if key != BindingKey.TP or dim != -1 or issue_sizes is None or not _single_use(x):
            return None
        chain += [node, issue]
        node, sizes = x, tuple(int(s) for s in issue_sizes)
    elif vocab is not None:        # a narrow without a gather: not the padding cut of a head
        return None
    if node.op != "call_function" or node.target is not _LINEAR or node.kwargs:
        return None
    if len(node.args) not in (2, 3) or any(not isinstance(a, fx.Node) for a in node.args[:2]):
        return None
    return chain + [node], sizes, vocab


def output_head_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace the last stage's head chain by ``ops.output_head``."""
    g = gm.graph
    output = next(n for n in reversed(g.nodes) if n.op == "output")
    out = output.args[0]
    if not _single_use(out):
        return gm
    found = _head_chain(out)
    if found is None:
        return gm
    chain, sizes, vocab = found
    linear = chain[-1]
    comm = next(n for n in g.nodes if n.op == "placeholder" and n.target == "comm")
    h, w = linear.args[:2]
    b = linear.args[2] if len(linear.args) == 3 else None
    with g.inserting_before(output):
        head = g.call_function(ops.output_head, (comm, h, w, b, BindingKey.TP, sizes, vocab))
    set_meta(head, get_meta(linear))
    if "nn_module_stack" in linear.meta:
        head.meta["nn_module_stack"] = linear.meta["nn_module_stack"]
    head.name = "output_head"
    output.replace_input_with(out, head)
    for node in chain:            # from the output back: each is unused once the one after is gone
        g.erase_node(node)
    return gm
