"""The simulated baselines of a mixture-of-experts model (``simulator.MOE_SYSTEMS``; the EP schemes and
their per-replica price are the cost model's, ``planner/cost/moe_cost``):

- ``homogeneous-ep``: the best homogeneous strategy among the EP schemes (``auto_candidates
  .best_homogeneous`` over them, chosen on mini-batches sampled from the dataset, as hgraph's own
  floor is), planned every iteration by hgraph's dispatch and packing.
- ``megatron-ep``: Megatron-LM's MoE setup: one static scheme with ``EP = gpus_per_node`` (8: the
  experts of a layer spread over a node, as Megatron users configure it) sized for the longest
  sequence (its MaxLen per EP replica holds the context), tuned over TP, PP and CP, kept inside a
  node (TP = CP = UL = 1) where such a scheme holds the context and spanning nodes otherwise;
  fixed-length packing into sequences of the context, each EP replica one sequence of a micro-batch
  (the micro-batch ``EP`` consecutive sequences), micro-batches round-robin over the DP replicas.

A dense model (or a cost model without EP schemes) skips both, with the reason.
"""
from __future__ import annotations

import time
from typing import Sequence, Union

import numpy as np

from hgraph import dims
from hgraph.errors import HGraphError
from hgraph.runtime.planner.auto_candidates import best_homogeneous
from hgraph.runtime.research.system_results import (IterationResult, SystemResult, fixed_length_pack,
                                                    homogeneous_space, pipeline_ms, planned, spread, tune)
from hgraph.strategy import Scheme, Strategy

MOE_SYSTEMS = ("homogeneous-ep", "megatron-ep")


def simulate_homogeneous_ep(batches, cost, gpus: int, max_len: int, dataset, tokens_per_iter: int) -> SystemResult:
    """``homogeneous-ep`` (module docstring); HGraphError when no EP scheme holds the context."""
    t0 = time.perf_counter()
    best = best_homogeneous(dataset, cost.restricted(lambda s: s.ep > 1), gpus, max_len, tokens_per_iter)
    if best is None:
        raise HGraphError(f"no homogeneous EP strategy of {gpus} GPUs holds {max_len} tokens")
    return planned("homogeneous-ep", batches, cost, [best], str(best), (time.perf_counter() - t0) * 1e3)


def megatron_ep_space(cost, gpus: int, max_len: int) -> list[Scheme]:
    """``megatron-ep``'s schemes: ``EP = gpus_per_node`` holding ``max_len`` per replica, inside a node
    where any is (module docstring)."""
    ep = cost.gpus_per_node
    space = [s for s in homogeneous_space(cost, gpus, max_len) if s.ep == ep]
    inside = [s for s in space if s.stride(dims.EP) * ep <= cost.gpus_per_node]
    return inside or space


def simulate_megatron_ep(batches, cost, gpus: int, max_len: int, space: Sequence[Scheme]) -> SystemResult:
    def run(s: Scheme) -> SystemResult:
        dp = gpus // s.num_ranks
        its = []
        for b in batches:
            sequences = fixed_length_pack(b, max_len)
            mbs = [sequences[i:i + s.ep] for i in range(0, len(sequences), s.ep)]   # a sequence per EP replica
            t = np.asarray([cost.replicas_microbatch_time(m, s) for m in mbs])
            lat = [pipeline_ms(t[r::dp], s, cost) for r in range(dp)]
            its.append(IterationResult(max(lat), int(b.sum()), spread(lat)))
        return SystemResult("megatron-ep", f"{Strategy.homogeneous(dp, s)}, fixed-length packing", its)
    return tune(space, run, "megatron-ep")


def simulate_moe_system(name: str, batches, cost, gpus: int, max_len: int, dataset,
                        tokens_per_iter: int) -> Union[SystemResult, str]:
    """The result of MoE system ``name`` (``MOE_SYSTEMS``), or why it is skipped in this setting."""
    if cost.model.experts is None or not any(s.ep > 1 for s in cost.schemes):
        return "the model has no experts (or the cost model no EP scheme)"
    if name == "homogeneous-ep":
        if not any(s.ep > 1 and cost.max_len(s) >= max_len for s in cost.schemes):
            return f"no EP scheme holds {max_len} tokens"
        return simulate_homogeneous_ep(batches, cost, gpus, max_len, dataset, tokens_per_iter)
    space = megatron_ep_space(cost, gpus, max_len)
    if not space:
        return f"no EP{cost.gpus_per_node} scheme of {gpus} GPUs holds {max_len} tokens per replica"
    return simulate_megatron_ep(batches, cost, gpus, max_len, space)
