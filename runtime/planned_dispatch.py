"""Planner-driven dispatch for the trainer: a cost model, candidate strategies and, every iteration,
``plan_iteration``'s choice of strategy and of the documents' pipelines and micro-batches.

Every rank must run the same plan. Rank 0 computes it (and the candidate set, once) and broadcasts
it with ``dist.broadcast_object_list``: the planner's fast method is deterministic, but a broadcast
keeps the ranks consistent even if a future method is time-boxed (CP-SAT) or seeded per process.

Inside a plan, documents are named by their position in the mini-batch (``0..n-1``), not by their
file index: a mini-batch that wraps around a small dataset may hold one file document twice, and a
plan needs every id once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.data import Document, MiniBatch
from hgraph.runtime.executor import MicroBatch
from hgraph.strategy import Strategy, parse_strategy_list

ANALYTIC = "analytic"


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def model_cost_model(profile: str, model: Any, world_size: int, gpus_per_node: int = 8):
    """The cost model for ``--profile``: ``analytic`` = the analytic prior for ``model``'s shape
    (TP degrees dividing its attention and KV heads, PP degrees dividing its layers) on
    ``world_size`` GPUs; anything else is a built-in profile name, a profile FILE or ``FILE:NAME``."""
    from hgraph.runtime.planner.cost_model import analytic_cost_model, load_cost_model

    if profile != ANALYTIC:
        return load_cost_model(profile, world_size, gpus_per_node)
    cfg = getattr(model, "config", None)
    try:
        hidden, layers, vocab = int(cfg.hidden_size), int(cfg.num_layers), int(cfg.vocab_size)
    except AttributeError:
        raise HGraphError("--profile analytic needs a zoo Llama-style model (hidden_size, num_layers, "
                          "vocab_size); give a measured profile with --profile NAME|FILE") from None
    heads = math.gcd(int(getattr(cfg, "num_heads", 1)), int(getattr(cfg, "num_kv_heads", 0) or 0)) \
        or int(getattr(cfg, "num_heads", 1))
    tps = _divisors(heads, min(world_size, gpus_per_node))
    pps = _divisors(layers, world_size)
    ffn = getattr(cfg, "intermediate_size", None)
    return analytic_cost_model(hidden=hidden, layers=layers, vocab=vocab, world_size=world_size,
                               ffn_hidden=int(ffn) if ffn else None, gpus_per_node=gpus_per_node,
                               tps=tps, pps=pps)


def parse_candidates(text: str, world_size: int) -> list[Strategy]:
    """``"S1;S2;..."`` -> distinct strategies of exactly ``world_size`` ranks (one-line error otherwise)."""
    return list(dict.fromkeys(parse_strategy_list(text, world_size, "--strategies", alternatives="'auto' or ")))


def _on_rank0(compute: Callable[[], Any], rank: int) -> Any:
    """``compute()`` run on rank 0, its result broadcast to every rank. Bad input (HGraphError) on
    rank 0 is broadcast too and raised on every rank, so no rank is left waiting."""
    value, error = None, None
    if rank == 0:
        try:
            value = compute()
        except HGraphError as exc:
            error = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [(value, error) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        value, error = box[0]
    if error is not None:
        raise HGraphError(error)
    return value


@dataclass
class PlannedStep:
    """One iteration's plan turned into the executor's input, with the time it took to get it."""

    plan: Any                                   # hgraph.runtime.planner.plan.Plan
    microbatches: list[list[MicroBatch]]
    wait_s: float


class IterationPlanner:
    """Plans each mini-batch on rank 0 and shares the plan with every rank (module docstring)."""

    def __init__(self, cost: Any, candidates: Sequence[Strategy], rank: int, *, source: str = "given",
                 method: str = "fast") -> None:
        self.cost, self.candidates, self.rank = cost, list(candidates), rank
        self.source, self.method = source, method

    @classmethod
    def create(cls, strategies: str, profile: str, model: Any, documents: Sequence[Document],
               tokens_per_iter: int, rank: int, world_size: int, gpus_per_node: int = 8) -> "IterationPlanner":
        """``strategies``: ``auto`` (``auto_candidates`` for the lengths of ``documents``) or
        ``"S1;S2"``. The candidate set is computed on rank 0 and broadcast."""
        from hgraph.runtime.planner.selection import auto_candidates

        cost = model_cost_model(profile, model, world_size, gpus_per_node)
        if strategies.strip() != "auto":
            return cls(cost, parse_candidates(strategies, world_size), rank, source="given")
        lengths = [len(d) for d in documents]
        max_len = int(getattr(getattr(model, "config", None), "max_seq_len", 0) or max(lengths))
        candidates, source = _on_rank0(lambda: auto_candidates(lengths, cost, world_size, max_len, tokens_per_iter),
                                       rank)
        return cls(cost, candidates, rank, source=source)

    def plan(self, batch: MiniBatch) -> PlannedStep:
        """The plan of ``batch`` (the same on every rank) and its packed micro-batches per pipeline."""
        from hgraph.runtime.planner.selection import plan_iteration

        t0 = time.perf_counter()
        plan = _on_rank0(lambda: plan_iteration([len(d) for d in batch.docs], self.candidates, self.cost,
                                                method=self.method, index=batch.step), self.rank)
        wait = time.perf_counter() - t0
        return PlannedStep(plan, microbatches_of_plan(plan, batch.docs), wait)


def microbatches_of_plan(plan: Any, docs: Sequence[Document]) -> list[list[MicroBatch]]:
    """Per pipeline of ``plan``, its packed micro-batches; plan ids are positions in ``docs``.

    Checks that every document of the mini-batch is in the plan exactly once.
    """
    seen = sorted(plan.documents())
    if seen != list(range(len(docs))):
        raise HGraphError(f"plan {plan.index} does not hold each of the {len(docs)} documents exactly once")
    return [[MicroBatch.pack([docs[i].input_ids for i in mb], [docs[i].index for i in mb])
             for mb in p.microbatches if mb] for p in plan.pipelines]


def pipeline_metrics(plan: Any, compute_s_per_rank: Sequence[float]) -> list[dict]:
    """``{scheme, est_latency_ms, measured_latency_ms}`` per pipeline; measured = the slowest of its
    ranks' compute time (forward, backward and in-pipeline communication of the step)."""
    return [{"scheme": str(p.scheme), "est_latency_ms": float(p.est_latency_ms),
             "measured_latency_ms": 1e3 * max(compute_s_per_rank[r] for r in p.ranks)}
            for p in plan.pipelines]


def all_gather_floats(value: float, world_size: int, device: Any = None) -> list[float]:
    """``value`` of every rank, in rank order (a list of one value without a process group);
    ``device``: where the collective's buffers live (the rank's GPU under NCCL)."""
    if not dist.is_initialized() or world_size == 1:
        return [float(value)]
    import torch
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return [float(t[0]) for t in out]
