"""The plan of one training iteration and its cost-model estimate."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hgraph.errors import HGraphError
from hgraph.strategy import Scheme, Strategy


@dataclass
class PipelinePlan:
    """One pipeline of a plan: its scheme, ranks, micro-batches (document indices) and estimate."""

    scheme: Scheme
    ranks: list[int]
    microbatches: list[list[int]]
    est_latency_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"scheme": str(self.scheme), "ranks": list(self.ranks),
                "microbatches": [list(map(int, mb)) for mb in self.microbatches],
                "est_latency_ms": float(self.est_latency_ms)}


@dataclass
class Plan:
    """Strategy, per-pipeline micro-batches and estimates of one iteration.

    ``doc_lengths`` maps every document index of the plan to its (possibly truncated) length, so a
    plan can be re-estimated on its own (``estimate_plan``).
    """

    strategy: Strategy
    pipelines: list[PipelinePlan]
    est_latency_ms: float
    solve_ms: float
    doc_lengths: dict[int, int]
    index: int = 0
    candidates_evaluated: int = 0
    candidates_pruned: int = 0
    candidates_skipped: list[str] = field(default_factory=list)

    @property
    def num_docs(self) -> int:
        return len(self.doc_lengths)

    @property
    def tokens(self) -> int:
        return int(sum(self.doc_lengths.values()))

    def documents(self) -> list[int]:
        return [d for p in self.pipelines for mb in p.microbatches for d in mb]

    def to_json(self) -> dict[str, Any]:
        """One entry of ``hgraph plan --json``'s ``iterations`` (``docs/architecture.md``, command line)."""
        return {"index": int(self.index), "num_docs": self.num_docs, "tokens": self.tokens,
                "strategy": str(self.strategy), "est_latency_ms": float(self.est_latency_ms),
                "solve_ms": float(self.solve_ms), "pipelines": [p.to_json() for p in self.pipelines]}


def estimate_plan(plan: Plan, cost) -> float:
    """Latency of ``plan`` recomputed from the cost model: the slowest pipeline's 1F1B time.

    Also checks the plan is well formed: every document appears once, every micro-batch fits its
    scheme's MaxLen (an EP micro-batch its replicas', ``CostModel.microbatch_capacity``), pipelines
    match the strategy. Raises HGraphError otherwise.
    """
    if [p.scheme for p in plan.pipelines] != list(plan.strategy.pipelines):
        raise HGraphError(f"plan pipelines do not match strategy {plan.strategy}")
    seen: set[int] = set()
    worst = 0.0
    for p in plan.pipelines:
        mb_times = []
        for mb in p.microbatches:
            if not mb:
                raise HGraphError(f"plan has an empty micro-batch on a {p.scheme} pipeline")
            lens = [plan.doc_lengths[d] for d in mb]
            cap = cost.microbatch_capacity(p.scheme, max(lens))
            if sum(lens) > cap:
                raise HGraphError(f"micro-batch of {sum(lens)} tokens exceeds MaxLen {cap} of {p.scheme}")
            for d in mb:
                if d in seen:
                    raise HGraphError(f"document {d} appears twice in the plan")
                seen.add(d)
            mb_times.append(cost.microbatch_time(lens, p.scheme))
        worst = max(worst, cost.pipeline_time(mb_times, p.scheme))
    if seen != set(plan.doc_lengths):
        missing = sorted(set(plan.doc_lengths) - seen)[:5]
        raise HGraphError(f"plan misses documents {missing}")
    return worst
