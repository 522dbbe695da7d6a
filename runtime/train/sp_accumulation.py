"""DCP-inter as a trainer mode (``--balance sp-accumulation``, formerly ``dcp-inter``): homogeneous data
parallelism whose sequence-parallel size is chosen per mini-batch, balanced by gradient accumulation
(the Data-Centric Parallel paper's §3.3).

What was chosen (DCP adapted to hgraph's data contract: a mini-batch is whole documents in file
order, all trained in its step):

1. **Per-batch sequence-parallel size** ``c``: the smallest power of two dividing the world whose
   ranks can hold the mini-batch's longest document, ``max(l) <= c * rank_tokens``
   (``rank_tokens``: tokens one rank takes per micro-batch, ``--microbatch-tokens``, default
   ``ceil(tokens_per_iter / world)``). The step runs the homogeneous strategy ``(W/c) x TP1PP1CPc``:
   ``W/c`` identical replicas, each a CP group of ``c`` ranks (per-document / per-sequence sharding
   inside, as for any CP pipeline).
2. **Micro-batches** (the accumulation unit): documents, longest first, packed first-fit into
   micro-batches of at most ``c * rank_tokens`` tokens (one with fewer than ``c`` tokens joins the
   roomiest other one, so no CP rank is left without tokens); each has the cost model's time ``T_j``
   (quadratic in its documents' lengths, so micro-batches of equal tokens differ in time).
3. **Gradient-accumulation balancing**: instead of equal accumulation counts (what a fixed batch
   size per replica gives), every replica gets as many micro-batches ``g_i`` as keeps its
   accumulated time ``sum T`` level with the others (longest-processing-time first), which is DCP's
   Eq. 3 objective (the GPU-weighted idle proportion, ``data_centric.idle_fraction``) under the
   constraint that every micro-batch of the mini-batch runs once. DCP's free search over ``g_i``
   (``data_centric.data_centric_accumulation``) assumes an unbounded stream of bucket batches per
   length class, which this data contract does not give; its Eq. 3 is reported for the balanced and
   the equal-count split.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from hgraph.errors import HGraphError
from hgraph.runtime.data.documents import first_fit
from hgraph.runtime.planner.schedule.data_centric import idle_fraction
from hgraph.strategy import Scheme, Strategy

# the method's name says what it does (a sequence-parallel size per mini-batch, replicas balanced by
# gradient accumulation); "dcp-inter", after the Data-Centric Parallel paper, reads like
# torch.distributed.checkpoint to a user and stays accepted as the old spelling
SP_ACCUMULATION = "sp-accumulation"
DCP_INTER = "dcp-inter"
BALANCE_MODES = ("none", SP_ACCUMULATION, DCP_INTER)


def balances_accumulation(balance: str) -> bool:
    """Whether ``--balance`` asks for this method (under its name or its old spelling)."""
    return balance in (SP_ACCUMULATION, DCP_INTER)


@dataclass
class SpAccumulationStep:
    """One step: its strategy, per replica the micro-batches (lists of documents), and figures."""

    strategy: Strategy
    plan: list
    sp_size: int
    accumulation: list[int]
    est_ms: list[float]                  # per replica, accumulated micro-batch time
    idle_fraction: float                 # Eq. 3 proportion with the balanced counts
    equal_count_idle_fraction: float     # the same with equal accumulation counts (in order)
    info: dict = field(default_factory=dict)

    def metrics(self) -> dict:
        return {"balance": SP_ACCUMULATION, "sp_size": self.sp_size, "accumulation": self.accumulation,
                "replica_est_ms": self.est_ms, "idle_fraction": self.idle_fraction,
                "equal_count_idle_fraction": self.equal_count_idle_fraction}


def sp_size_for(longest: int, world_size: int, rank_tokens: int) -> int:
    """The smallest power-of-two CP size dividing ``world_size`` whose ranks hold ``longest`` tokens."""
    c = 1
    while c <= world_size:
        if world_size % c == 0 and longest <= c * rank_tokens:
            return c
        c *= 2
    raise HGraphError(f"a document of {longest} tokens does not fit {world_size} ranks of {rank_tokens} "
                      "tokens each; raise --microbatch-tokens")


def _idle(loads: Sequence[float], gpus: int) -> float:
    """Eq. 3 proportion for replicas with accumulated times ``loads`` (one 'step' of ``load`` each)."""
    loads = [max(x, 1e-12) for x in loads]
    return idle_fraction(loads, [1] * len(loads), [gpus] * len(loads))


def sp_accumulation_step(docs: Sequence[Any], world_size: int, rank_tokens: int, time_ms: Any) -> SpAccumulationStep:
    """Plan one mini-batch. ``docs``: objects with ``len()`` and ``index``;
    ``time_ms(lengths, scheme)``: a micro-batch's time (the cost model's ``microbatch_time``)."""
    if not docs:
        raise HGraphError("--balance sp-accumulation: the mini-batch has no documents")
    if rank_tokens < 1:
        raise HGraphError(f"--balance sp-accumulation: tokens per rank must be positive, got {rank_tokens}")
    c = sp_size_for(max(len(d) for d in docs), world_size, rank_tokens)
    scheme = Scheme(1, 1, c)
    replicas = world_size // c
    cap = c * rank_tokens
    bins = first_fit(sorted(docs, key=lambda d: (-len(d), d.index)), cap)
    room = [cap - sum(len(d) for d in b) for b in bins]
    for j in [j for j, b in enumerate(bins) if sum(len(d) for d in b) < c]:
        # fewer tokens than CP ranks would leave a rank without any: join the roomiest other bin
        need = sum(len(d) for d in bins[j])
        k = max((k for k in range(len(bins)) if k != j and bins[k]), key=lambda k: room[k], default=None)
        if k is None or room[k] < need:
            raise HGraphError(f"--balance sp-accumulation: a micro-batch of {need} tokens cannot be spread "
                              f"over CP{c}; raise --microbatch-tokens")
        bins[k] += bins[j]
        room[k] -= need
        bins[j] = []
    mbs = [sorted(b, key=lambda d: d.index) for b in bins if b]
    times = [float(time_ms([len(d) for d in mb], scheme)) for mb in mbs]
    order = sorted(range(len(mbs)), key=lambda j: (-times[j], j))
    loads = [0.0] * replicas
    plan: list[list[list[Any]]] = [[] for _ in range(replicas)]
    for j in order:                                   # LPT: accumulation counts follow the times
        i = min(range(replicas), key=lambda i: (loads[i], i))
        plan[i].append(mbs[j])
        loads[i] += times[j]
    equal = [0.0] * replicas                          # equal counts, micro-batches in packing order
    per = math.ceil(len(mbs) / replicas)
    for j, t in enumerate(times):
        equal[j // per] += t
    strategy = Strategy.parse(f"{replicas}xTP1PP1" + (f"CP{c}" if c > 1 else ""))
    return SpAccumulationStep(strategy, plan, c, [len(p) for p in plan], loads, _idle(loads, c), _idle(equal, c))
