"""Dynamic recomputation of transformer blocks: outlining a stage graph's blocks and running them.

``outline_blocks(gm)`` rewrites a rank's stage graph so that the nodes of every block (the node range
from the first to the last node whose ``NodeMeta.layer`` is ``k``, including the parameter-slot and
rotary nodes interleaved there) become one ``GraphModule`` called through ``run_block``. Values
flowing into the range (hidden state, parameters, ``comm``, rotary tables) are its inputs; values
used after it are its outputs. The rewritten graph computes exactly the same ops in the same order.

``run_block`` runs a block normally; when its layer is in ``comm.offload.layers`` under the offload's
saved-tensor hooks (``engine.offload``: its stash waits in host memory); or, when its layer is in
``comm.recompute_layers`` (chosen per micro-batch by the executor), under non-reentrant
``torch.utils.checkpoint``: only the block's
inputs stay alive, and its forward runs again inside backward. The recomputation replays the
block's communication (CP all-gather of K/V, TP all-reduces), so every rank of a stage's TP x CP
group must recompute the same layers (the executor agrees on them with one small all-reduce);
early stop is disabled so a replay always issues all of the block's collectives. The block's
``comm`` is its micro-batch's context (``CommContext.for_microbatch``), kept with the checkpointed
inputs, so the replay runs with that micro-batch's CP layout and dropout keys even though 1F1B ran
forwards of later micro-batches before this backward.

What a block stashes is counted by ``comm.activation_meter`` (the micro-batch's ``engine.memory.MicroBatchMeter``,
when the executor tracks memory); which layers recompute is ``engine.memory.StageMemory``'s choice.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, ContextManager, Union

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from hgraph.meta import CommPoint, get_meta
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.engine.subgraphs import comm_placeholder, extract_subgraph

BLOCK_PREFIX = "hgraph_block_"


# ---- the graph rewrite ----------------------------------------------------------------------------
def block_ranges(graph: fx.Graph) -> list[tuple[int, list[fx.Node]]]:
    """Per layer (in graph order): the nodes from its first to its last node, contiguous; the
    pipeline send / receive at a stage boundary (tagged with the layer it leaves) are not part of it."""
    nodes = list(graph.nodes)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    pp_at = set()
    for i, n in enumerate(nodes):
        meta = get_meta(n)
        if meta.comm_point == CommPoint.PP_BOUNDARY:
            pp_at.add(i)        # a stage's send / receive: never replayed (the peer expects it once)
            continue
        if meta.layer is not None and n.op not in ("placeholder", "output"):
            first.setdefault(meta.layer, i)
            last[meta.layer] = i
    out = []
    prev_end = -1
    for layer in sorted(first, key=first.get):
        lo, hi = first[layer], last[layer]
        if lo <= prev_end or any(lo < i < hi for i in pp_at):
            return []       # interleaved layers (not a plain stack of blocks): leave the graph alone
        out.append((layer, nodes[lo:hi + 1]))
        prev_end = hi
    return out


def run_block(comm: CommContext, block: fx.GraphModule, layer: int, *inputs: Any) -> tuple:
    """Run one outlined block; offloaded when ``layer`` is in ``comm.offload.layers``, recomputed in
    backward when it is in ``comm.recompute_layers``."""
    recompute = comm.recompute_layers
    meter = comm.activation_meter      # the micro-batch's engine.memory.MicroBatchMeter, or None
    offload = comm.offload             # an engine.offload.MicroBatchOffload, or None
    if (offload is not None and layer in offload.layers and torch.is_grad_enabled()
            and not (recompute and layer in recompute)):
        before = meter.live_bytes if meter is not None else 0
        with offload.hooks(layer):
            out = block(*inputs)
        offload.watch(layer, out)
        if meter is not None:          # what the block still saved on the device
            meter.observe("kept", meter.live_bytes - before, in_forward=True)
        return out
    if not recompute or layer not in recompute or not torch.is_grad_enabled():
        before = meter.live_bytes if meter is not None else 0
        out = block(*inputs)
        if meter is not None:
            meter.observe("layer", meter.live_bytes - before, in_forward=True)
        return out
    token = meter.hold(inputs) if meter is not None else None
    # the block's differentiable input (the hidden state its first norm saves) is counted in a forward
    # block's stash; in the replay it is the checkpoint, already held: the replay's stash adds it back
    stashed_input = meter.activation_input_bytes(inputs) if meter is not None else 0

    def replay(*xs: Any) -> tuple:
        _ = token              # the checkpointed inputs are counted while this closure lives
        # compiled regions (--compile) run eagerly here: dynamo does not trace under checkpoint
        with torch.compiler.set_stance("force_eager"):
            return block(*xs)

    def contexts() -> tuple[ContextManager[None], ContextManager[object]]:
        recompute_ctx = meter.replay_tracker(stashed_input) if meter is not None else contextlib.nullcontext()
        if comm.router_losses is not None:     # the replay's MoE router losses are the forward's: not counted again
            return contextlib.nullcontext(), _both(recompute_ctx, comm.router_losses.replaying(layer))
        return contextlib.nullcontext(), recompute_ctx

    with set_checkpoint_early_stop(False):
        return checkpoint(replay, *inputs, use_reentrant=False, context_fn=contexts)


@contextlib.contextmanager
def _both(first: ContextManager[Any], second: ContextManager[Any]) -> Any:
    with first, second:
        yield


def outline_blocks(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule (sharing ``gm``'s parameters) whose blocks are calls of ``run_block``.

    Does nothing (returns ``gm``) when the graph has no blocks, no ``comm`` input, or its layers
    interleave.
    """
    graph = gm.graph
    comm_node = comm_placeholder(graph)
    ranges = block_ranges(graph)
    if comm_node is None or not ranges:
        return gm
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    in_range: dict[fx.Node, int] = {}
    for k, (_, nodes) in enumerate(ranges):
        for n in nodes:
            if n.op != "get_attr":
                in_range[n] = k
    starts = {id(nodes[0]): k for k, (_, nodes) in enumerate(ranges)}
    # qualified name -> object, the new module's attributes
    owner: dict[str, Union[torch.nn.Module, torch.Tensor]] = {}
    for n in graph.nodes:
        k = starts.get(id(n))
        if k is not None:
            layer, nodes = ranges[k]
            body = [m for m in nodes if m.op != "get_attr"]
            for m in nodes:                        # parameters stay outside: inputs of the block
                if m.op == "get_attr":
                    env[m] = new.node_copy(m, lambda x: env[x])
            sub, inputs, outputs = extract_subgraph(body)
            name = f"{BLOCK_PREFIX}{layer}"
            owner[name] = fx.GraphModule(torch.nn.Module(), sub)
            attr = new.get_attr(name)
            call = new.call_function(run_block, (env[comm_node], attr, layer, *[env[a] for a in inputs]))
            for i, m in enumerate(outputs):
                env[m] = new.call_function(operator.getitem, (call, i))
                env[m].meta = dict(m.meta)
            continue
        if n in env or in_range.get(n) is not None:
            continue
        env[n] = new.node_copy(n, lambda x: env[x])
    for n in new.nodes:
        if n.op == "get_attr" and n.target not in owner:
            owner[n.target] = operator.attrgetter(n.target)(gm)    # the same Parameter objects
    out = fx.GraphModule(owner, new)
    out.graph.lint()
    return out
