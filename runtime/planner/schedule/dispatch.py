"""Dispatching a mini-batch's documents across the pipelines of one strategy (Hydraulis Eq. 3).

The load of a pipeline is its packed latency (``packing.pack_pipeline``). Three methods:

- ``fast`` (default): longest document first onto the pipeline whose *packed-latency surrogate*
  after taking it is smallest (identical pipelines share a heap, so a step costs one heap operation
  per distinct scheme), then move/swap local search between the most and least loaded pipelines on
  the real packing. The surrogate is the packing bound ``min_V (PP-1+V) * (max(S/V, t_max) + c)`` over
  the App. C range of ``V``: a lower bound of the real packing that is tight when documents are small.
- ``greedy``: the paper's randomized greedy (Alg. 1) with the lower bound of Eq. 2 and ``trials``
  random orders; the best trial's dispatch is packed.
- ``cpsat``: dispatch and packing jointly in ortools CP-SAT (every pipeline gets up to ``Vcap``
  micro-batch slots), time-boxed and hinted with the fast solution; the yardstick, and an improver
  for small cases.

A document only goes to pipelines whose MaxLen holds it. ``dispatch_sequences`` picks the method; each
has its module (``dispatch_fast``, ``dispatch_alg1``, ``dispatch_cpsat``) and all return a
``dispatch_result.DispatchResult``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.schedule.dispatch_alg1 import dispatch_randomized_greedy
from hgraph.runtime.planner.schedule.dispatch_cpsat import dispatch_cpsat
from hgraph.runtime.planner.schedule.dispatch_fast import dispatch_fast
from hgraph.runtime.planner.schedule.dispatch_result import DispatchResult
from hgraph.strategy import Scheme


def dispatch_sequences(lengths, pipelines: Sequence[Scheme], cost, *, method: str = "fast", trials: int = 100,
                       seed: int = 0, time_limit_s: float = 10.0, workers: int = 1,
                       improve_rounds: int | None = None) -> DispatchResult:
    """Assign every document (``lengths``) to one pipeline and pack each pipeline (Eq. 3 + Eq. 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not pipelines:
        raise HGraphError("dispatch needs at least one pipeline")
    if method == "fast":
        return dispatch_fast(lengths, pipelines, cost, improve_rounds=improve_rounds, seed=seed)
    if method == "greedy":
        return dispatch_randomized_greedy(lengths, pipelines, cost, trials=trials, seed=seed)
    if method == "cpsat":
        return dispatch_cpsat(lengths, pipelines, cost, time_limit_s=time_limit_s, workers=workers)
    raise HGraphError(f"unknown dispatch method {method!r}: expected fast, greedy or cpsat")
