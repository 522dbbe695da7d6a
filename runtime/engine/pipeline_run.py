"""One rank's 1F1B over its pipeline's micro-batches in a step (Megatron's schedule: ``warmup =
min(PP - stage - 1, m)`` forwards, then one forward / one backward alternately, then the remaining
backwards; ``runtime/comm/order/pipeline``). Each forward runs the rank's graph on a micro-batch view of
its communication context; the last stage backpropagates ``stage_loss_sum / num_targets``."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Union

import torch

from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.order.pipeline import one_f_one_b
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.memory import LayerChoice
from hgraph.runtime.engine.rank_state import RankState
from hgraph.runtime.engine.sequence_inputs import MicroBatchFeed


def run_one_f_one_b(state: RankState, mbs: list[MicroBatch], num_targets: int, feed: MicroBatchFeed,
                    issuer: CollectiveIssuer, last_backward: Callable[[float], None]) -> float:
    """The rank's 1F1B over its pipeline's micro-batches ``mbs`` under ``state``, each fed by ``feed`` and
    its collectives labelled through ``issuer``; ``last_backward(loss_sum)`` runs before its last backward
    (every forward done, so ``loss_sum`` is final). Returns this rank's loss sum (0 off the last stage)."""
    rp, gm, comm, memory = state.rank_program, state.graph, state.comm, state.memory
    last = rp.stage == rp.scheme.pp - 1
    pending: dict[int, Union[torch.Tensor, list[torch.Tensor]]] = {}
    loss_sum = 0.0
    # the micro-batches' loss sums added on the device in float64 (as Python adds floats), read once
    # at the last backward: a read per micro-batch would wait for the GPU after every forward
    loss_acc: Optional[torch.Tensor] = None
    order = one_f_one_b(len(mbs), rp.scheme.pp, rp.stage)
    for n, (kind, i) in enumerate(order):
        mb = mbs[i]
        if kind == "F":
            ids, pos, targets, layout, keys = feed.inputs(mb)
            choice = memory.before_forward(i, mb, layout) if memory is not None else LayerChoice(None, None)
            # a backward follows: the activation sends go with its gradient receive (flush_deferred)
            then_backward = not last and n + 1 < len(order) and order[n + 1][0] == "B"
            mb_comm = comm.for_microbatch(cp_layout=layout, token_keys=keys, recompute_layers=choice.recompute,
                                          documents=feed.documents(mb, layout),
                                          offload=choice.offload, activation_meter=choice.meter,
                                          defer_sends=then_backward, num_targets=num_targets)
            with (memory.meter.hooks() if memory is not None else contextlib.nullcontext(),
                  issuer.scope(f"mb {i} F")):
                out = gm(feed.to_device(ids), feed.to_device(pos), mb_comm)
                if last:
                    s = feed.loss_sum(out, ids, targets, mb, mb_comm)
                    part = s.detach().double()
                    loss_acc = part if loss_acc is None else loss_acc + part
                    pending[i] = s / num_targets
                else:
                    pending[i] = list(out)
            if memory is not None:
                memory.after_forward()
        else:
            out = pending.pop(i)
            if n == len(order) - 1:     # gradients finished by this backward start their push
                loss_sum = float(loss_acc) if loss_acc is not None else 0.0
                last_backward(loss_sum)
            with issuer.scope(f"mb {i} B"):
                if last:
                    out.backward()
                else:
                    torch.autograd.backward(out)
            del out
            if memory is not None:
                memory.after_backward(i)
    return loss_sum
