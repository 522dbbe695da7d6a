"""What every simulated system is measured in and priced with (``research/simulator``,
``research/moe_baselines``): an iteration's and a system's results, the comparison of systems
(``Simulation``), the 1F1B critical path of a pipeline, micro-batch times under the cost model (an EP
micro-batch per replica), fixed-length packing, the homogeneous schemes that hold a length, the
tuning of a static system, and the iterations a planner plans over given candidates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.strategy import Scheme, Strategy


@dataclass
class IterationResult:
    latency_ms: float
    tokens: int
    spread: float  # 1 - min/max busy time over pipelines/groups


@dataclass
class SystemResult:
    """One system over all iterations."""

    system: str
    config: str
    iterations: list[IterationResult]
    solve_ms: float = 0.0
    notes: dict = field(default_factory=dict)

    @property
    def total_ms(self) -> float:
        return float(sum(i.latency_ms for i in self.iterations))

    @property
    def tokens(self) -> int:
        return int(sum(i.tokens for i in self.iterations))

    @property
    def throughput(self) -> float:
        """Tokens per second."""
        return self.tokens / (self.total_ms / 1e3) if self.total_ms > 0 else 0.0

    def to_json(self) -> dict:
        lat = [i.latency_ms for i in self.iterations]
        return {"system": self.system, "config": self.config, "iterations": len(self.iterations),
                "mean_latency_ms": float(np.mean(lat)) if lat else 0.0,
                "std_latency_ms": float(np.std(lat)) if lat else 0.0,
                "latency_ms": lat, "throughput_tokens_per_s": self.throughput,
                "mean_spread": float(np.mean([i.spread for i in self.iterations])) if lat else 0.0,
                "solve_ms": self.solve_ms, **({"notes": self.notes} if self.notes else {})}


@dataclass
class Simulation:
    results: dict[str, SystemResult]
    iterations: int
    tokens_per_iter: int
    gpus: int
    max_len: int
    skipped: dict[str, str] = field(default_factory=dict)   # system -> why it cannot run this setting

    def best_baseline(self) -> Optional[SystemResult]:
        base = [r for s, r in self.results.items() if s != "hgraph"]
        return max(base, key=lambda r: r.throughput) if base else None

    def speedup(self) -> Optional[float]:
        """hgraph's throughput over the best baseline's."""
        best = self.best_baseline()
        if "hgraph" not in self.results or best is None or best.throughput <= 0:
            return None
        return self.results["hgraph"].throughput / best.throughput

    def speedups(self) -> dict[str, float]:
        """hgraph's throughput over each baseline's."""
        h = self.results.get("hgraph")
        if h is None:
            return {}
        return {s: h.throughput / r.throughput for s, r in self.results.items() if s != "hgraph" and r.throughput > 0}

    def to_json(self) -> dict:
        best = self.best_baseline()
        return {"gpus": self.gpus, "max_len": self.max_len, "tokens_per_iter": self.tokens_per_iter,
                "iterations": self.iterations,
                "systems": {s: r.to_json() for s, r in self.results.items()},
                "best_baseline": best.system if best else None, "speedup_over_best_baseline": self.speedup(),
                "speedups": self.speedups(), "skipped": self.skipped}


def pipeline_ms(mb_times: Sequence[float], scheme: Scheme, cost=None) -> float:
    """1F1B critical path (WLB-LLM §3.1): every micro-batch on the first stage plus the largest one
    through the remaining ``PP - 1`` stages: ``sum + (PP - 1) * max`` (just the sum when PP = 1); with
    a ``cost`` that prices the push, plus the part of it the last backward does not hide
    (``CostModel.exposed_push_ms``: every system reduces its gradients inside the backward, as
    Megatron-LM's ``overlap_grad_reduce`` and DeepSpeed do)."""
    if len(mb_times) == 0:
        return 0.0
    push = cost.exposed_push_ms(scheme, mb_times) if cost is not None else 0.0
    return float(np.sum(mb_times)) + (scheme.pp - 1) * float(np.max(mb_times)) + push


def microbatch_times(cost, scheme: Scheme, mbs: Sequence[Sequence[int]]) -> np.ndarray:
    """Each micro-batch's time (ms) under the cost model (``mbs``: documents' lengths)."""
    if cost.prices_replicas(scheme):        # an EP micro-batch: its slowest replica (``moe_cost``)
        return np.asarray([cost.microbatch_time(m, scheme) for m in mbs])
    a, b, c = cost.coeffs(scheme)
    return np.asarray([float(np.sum(a * np.square(np.asarray(m, dtype=np.float64)) + b * np.asarray(m))) + c
                       for m in mbs])


def fixed_length_pack(lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Documents in order into micro-batches of at most ``cap`` tokens (closed when the next won't fit)."""
    out: list[list[int]] = []
    cur: list[int] = []
    tok = 0
    for l in lengths.tolist():
        if cur and tok + l > cap:
            out.append(cur)
            cur, tok = [], 0
        cur.append(l)
        tok += l
    if cur:
        out.append(cur)
    return out


def spread(busy: Sequence[float]) -> float:
    """``1 - min / max`` of the busy times (0: every pipeline or group finishes together)."""
    busy = [b for b in busy]
    mx = max(busy) if busy else 0.0
    return 0.0 if mx <= 0 else 1.0 - min(busy) / mx


def homogeneous_space(cost, gpus: int, longest: int, pp1_only: bool = False,
                      keep: Callable[[Scheme], bool] = lambda s: s.ul == 1) -> list[Scheme]:
    """Schemes of the cost model that tile ``gpus``, hold ``longest`` tokens and that ``keep`` takes
    (default: no Ulysses, which the papers' baselines do not have)."""
    return [s for s in cost.schemes if gpus % s.num_ranks == 0 and cost.max_len(s) >= longest
            and (not pp1_only or s.pp == 1) and keep(s)]


def tune(space: Sequence, run: Callable[[object], SystemResult], what: str) -> SystemResult:
    """The configuration of ``space`` whose run takes the least total time (the best in hindsight)."""
    best = None
    for cfg in space:
        r = run(cfg)
        if best is None or r.total_ms < best.total_ms:
            best = r
    if best is None:
        raise HGraphError(f"no {what} configuration holds the context length")
    return best


def planned(name: str, batches, cost, candidates: Sequence[Strategy], config: str, propose_ms: float) -> SystemResult:
    """Every iteration planned by ``plan_iteration`` over ``candidates`` and re-estimated with the
    simulator's pipeline formula."""
    iters, chosen, solve = [], {}, 0.0
    previous = None
    for i, b in enumerate(batches):
        plan = plan_iteration(b, candidates, cost, index=i, previous=previous)
        previous = plan.strategy
        solve += plan.solve_ms
        # Re-estimated with the simulator's pipeline formula, the same for every system.
        busy = [pipeline_ms(microbatch_times(cost, p.scheme, [[plan.doc_lengths[d] for d in mb] for mb in p.microbatches]),
                            p.scheme, cost) for p in plan.pipelines]
        iters.append(IterationResult(max(busy), int(b.sum()), spread(busy)))
        chosen[str(plan.strategy)] = chosen.get(str(plan.strategy), 0) + 1
    return SystemResult(name, config, iters, solve,
                        {"candidates": [str(s) for s in candidates], "chosen": chosen,
                         "propose_ms": propose_ms})
