"""How a step's strategy and micro-batches are chosen: three step modes behind one interface.

The training loop (``hgraph.runtime.train.trainer``) hands every mini-batch to its mode's
``step(batch)``, which picks the step's strategy, packs the documents into micro-batches per pipeline
and runs the executor's step of that strategy (the executor finds or builds its Program; collective:
every rank calls it with the same mini-batch):

* ``FixedSchedule`` (``planner.strategy_schedule``): step ``k`` runs ``S_(k mod n)``; the documents
  are dispatched and packed by a simple built-in rule (``dispatch_and_pack``): longest first (ties
  by file order), each goes to the pipeline with the least tokens per rank after adding it (LPT
  weighted by the pipeline's ranks); inside a pipeline they are packed first-fit-decreasing into
  micro-batches of at most ``microbatch_tokens`` tokens (default: the larger of the pipeline's
  longest document and its tokens divided by its PP degree, so a PP pipeline gets about PP
  micro-batches). An EP pipeline's micro-batches hold at least its EP degree ``n`` of documents where it
  has them (``fill_ep_microbatches``), so no EP rank runs a placeholder unless the pipeline has fewer
  documents than EP ranks. A pipeline may get no document; it still takes part in pull and push.
* ``PlannerDriven`` (no schedule): the planner (``hgraph.runtime.planner.service``) chooses the
  strategy and the documents' pipelines and micro-batches; rank 0 plans and broadcasts the plan.
* ``SpAccumulation`` (``planner.balance`` ``sp-accumulation``, ``hgraph.runtime.train.sp_accumulation``): a
  homogeneous schedule whose sequence-parallel size is chosen per mini-batch, balanced by gradient
  accumulation.

Before a step runs, a mode hands the executor the strategies of the next steps it knows (a fixed
schedule's next ``plan_ahead``, the plans the planner process has delivered; not the step's own):
the new ones are built ahead, during the step (``Executor.build_ahead``). DCP-inter chooses each
step's strategy with its batch, so it builds nothing ahead.

A mode's ``step(batch, extras)`` returns the step's ``StepRecord`` (``runtime.train.step_record``),
built once when the step has run: the executor's result, the cache's counts, what the mode adds (the
planner's figures, which the step line also shows, or DCP-inter's balance) and what the caller's
``extras`` adds once the result is known (the trainer's learning rate, evaluation, throughput and
memory figures). A mode also says what a checkpoint stores of the strategy choice
(``checkpoint_state``) and which candidates it chose among (``candidates``).
"""
from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch.nn as nn

from hgraph.errors import HGraphError
from hgraph.runtime.data.documents import Document, MiniBatch, first_fit
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor, StepResult
from hgraph.runtime.planner.cost.cost_model import CostModel, with_activation_budget, with_offload
from hgraph.runtime.planner.schedule.offload import engine_layer_ms
from hgraph.runtime.planner.service.iteration import (ANALYTIC, MEASURE, IterationPlanner, all_gather_floats,
                                                      model_cost_model, pipeline_metrics)
from hgraph.runtime.planner.service.setup import PlannerSetup, planner_state
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.sp_accumulation import (BALANCE_MODES, SP_ACCUMULATION, balances_accumulation,
                                                  sp_accumulation_step)
from hgraph.runtime.train.step_record import CacheCounts, StepExtras, StepRecord
from hgraph.strategy import Scheme, Strategy, parse_strategy_list


def parse_schedule(text: str, world_size: int) -> list[Strategy]:
    """``"S1;S2;..."`` -> strategies; each must use exactly ``world_size`` ranks (one-line error)."""
    return parse_strategy_list(text, world_size, "--strategy-schedule")


def dispatch_and_pack(strategy: Strategy, docs: Sequence[Document],
                      microbatch_tokens: Optional[int] = None) -> list[list[list[Document]]]:
    """The built-in rule: per pipeline, its micro-batches, each a list of documents."""
    n = len(strategy.pipelines)
    load = [0] * n
    assigned: list[list[Document]] = [[] for _ in range(n)]
    for d in sorted(docs, key=lambda d: (-len(d), d.index)):
        best = min(range(n), key=lambda i: ((load[i] + len(d)) / strategy.pipelines[i].num_ranks, i))
        assigned[best].append(d)
        load[best] += len(d)
    out = []
    for i, mine in enumerate(assigned):
        if not mine:
            out.append([])
            continue
        scheme = strategy.pipelines[i]
        longest = max(len(d) for d in mine)
        cap = microbatch_tokens or max(longest, math.ceil(load[i] / scheme.pp))
        if cap < longest:
            d = max(mine, key=len)
            raise HGraphError(f"document {d.index} has {len(d)} tokens, more than the micro-batch limit {cap}")
        bins = first_fit(mine, cap)        # already longest first
        if scheme.doc_ranks > 1:
            bins = fill_ep_microbatches(mine, bins, scheme.doc_ranks, microbatch_tokens)
        out.append([sorted(b, key=lambda d: d.index) for b in bins])
    return out


def fill_ep_microbatches(docs: Sequence[Document], bins: list[list[Document]], n: int,
                         limit: Optional[int]) -> list[list[Document]]:
    """An EP pipeline's micro-batches: as many as first-fit made (``bins``) but at most one per ``n``
    documents, so each holds ``n`` documents at least and ``split_documents`` gives every EP rank one
    (an EP rank without a document runs a placeholder: wasted work). The documents (``docs``, longest
    first) go onto ``V x n`` replica slots, each to the one with the fewest tokens (ties: the lowest;
    slot ``s`` in micro-batch ``s mod V``): the first ``V x n`` fill every slot, and the slots (what the
    EP ranks run) are balanced. A user's ``limit`` on a micro-batch's tokens wins: where the slots'
    micro-batches would break it, first-fit's ``bins`` stay."""
    count = max(1, min(len(bins), len(docs) // n))
    slots: list[list[Document]] = [[] for _ in range(count * n)]
    heap = [(0, s) for s in range(count * n)]
    for d in docs:
        load, s = heapq.heappop(heap)
        slots[s].append(d)
        heapq.heappush(heap, (load + len(d), s))
    mbs = [[d for s in range(j, count * n, count) for d in slots[s]] for j in range(count)]
    if limit is not None and any(sum(len(d) for d in mb) > limit for mb in mbs):
        return bins
    return mbs


def packed(plan: Sequence[Sequence[Sequence[Document]]]) -> list[list[MicroBatch]]:
    """Per pipeline, its micro-batches (lists of documents) packed into rows."""
    return [[MicroBatch.pack([d.input_ids for d in mb], [d.index for d in mb]) for mb in pipe] for pipe in plan]


StepExtrasOf = Callable[[StepResult], StepExtras]
"""What the caller adds to a step once its result is known (collective where it evaluates or gathers)."""


class StepMode:
    """The interface the training loop calls."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def step(self, batch: MiniBatch, extras: StepExtrasOf) -> StepRecord:
        """Run ``batch``'s step (collective) and return its record."""
        raise NotImplementedError

    def record(self, batch: MiniBatch, result: StepResult, extras: StepExtrasOf, *,
               plan: Optional[Mapping[str, Any]] = None, balance: Optional[Mapping[str, Any]] = None
               ) -> StepRecord:
        """The step's record, once: the cache's counts after it, then the caller's extras."""
        programs = self.executor.programs
        return StepRecord(batch, result, CacheCounts(programs.hits, programs.misses), extras(result),
                          plan=plan, balance=balance)

    def checkpoint_state(self) -> dict:
        """What a resume needs of the strategy choice (``planner.service.setup.planner_state``)."""
        raise NotImplementedError

    def candidates(self) -> list[str]:
        """The strategies the planner chose among (none without a planner)."""
        return []

    def close(self) -> None:
        """The run is over (or failed): stop what the mode started."""
        self.executor.close()


class FixedSchedule(StepMode):
    """Step ``k`` runs ``schedule[k mod n]``, packed by ``dispatch_and_pack``."""

    def __init__(self, schedule: Sequence[Strategy], executor: Executor, config: TrainConfig) -> None:
        super().__init__(executor)
        self.schedule, self.config = list(schedule), config

    def step(self, batch: MiniBatch, extras: StepExtrasOf) -> StepRecord:
        strategy = self.schedule[batch.step % len(self.schedule)]
        # the next --plan-ahead steps' strategies are known: the ones not built yet build during this step
        last = min(batch.step + 1 + self.config.planner.plan_ahead, self.config.data.steps)
        coming = (self.schedule[k % len(self.schedule)] for k in range(batch.step + 1, last))
        self.executor.build_ahead([s for s in coming if s != strategy])
        mbs = packed(dispatch_and_pack(strategy, batch.docs, self.config.planner.microbatch_tokens))
        # a plain data-parallel step pulls the next step's parameters only if that step runs the same
        # strategy (with a planner the next strategy is not known yet: the executor's default)
        again = (batch.step + 1 < self.config.data.steps
                 and self.schedule[(batch.step + 1) % len(self.schedule)] == strategy)
        result = self.executor.step(strategy, mbs, batch.num_targets, batch.step, prefetch=again)
        return self.record(batch, result, extras)

    def checkpoint_state(self) -> dict:
        return planner_state(None, None, self.schedule, self.executor.world_size)


class PlannerDriven(StepMode):
    """Every step on the planner's plan; its planner figures go to the step's record (``plan``)."""

    def __init__(self, planner: IterationPlanner, setup: PlannerSetup, executor: Executor,
                 config: TrainConfig) -> None:
        super().__init__(executor)
        self.planner, self.setup, self.config = planner, setup, config

    def step(self, batch: MiniBatch, extras: StepExtrasOf) -> StepRecord:
        ex = self.executor
        planned = self.planner.plan(batch)
        # the next steps' new strategies build during this one (this one's, if new, is built by its step)
        ex.build_ahead([s for s in planned.upcoming if s != planned.plan.strategy])
        result = ex.step(planned.plan.strategy, planned.microbatches, batch.num_targets, batch.step)
        busy = all_gather_floats(result.compute_s, ex.world_size, ex.device)
        # a compiling step says nothing about later ones, nor one that first allocates its working tensors
        if ex.rank == 0 and result.cache_hit and not result.built_ahead:
            self.planner.observe(planned.model_est_ms, 1e3 * result.time_s)
        figures = {
            "est_latency_ms": float(planned.plan.est_latency_ms), "est_model_ms": planned.model_est_ms,
            "planner_source": planned.source, "planner_queue_wait_s": planned.queue_wait_s,
            "pipelines": pipeline_metrics(planned.plan, busy), "rank_busy_s": busy,
            "planner_wait_s": planned.wait_s, "planner_solve_ms": float(planned.plan.solve_ms),
            "plan_documents": sorted(batch.docs[i].index for i in planned.plan.documents())}
        return self.record(batch, result, extras, plan=figures)

    def checkpoint_state(self) -> dict:
        return planner_state(self.setup, self.planner, self.planner.candidates, self.executor.world_size)

    def candidates(self) -> list[str]:
        return [str(s) for s in self.planner.candidates]

    def close(self) -> None:
        super().close()
        if self.planner.ahead is not None:
            self.planner.ahead.stop()


class SpAccumulation(FixedSchedule):
    """DCP-inter: per mini-batch the SP size, micro-batches balanced over the replicas
    (``sp_accumulation.sp_accumulation_step``) with the cost model's micro-batch times; its figures go
    to the step's record (``balance``)."""

    def __init__(self, schedule: Sequence[Strategy], cost: CostModel, executor: Executor,
                 config: TrainConfig) -> None:
        super().__init__(schedule, executor, config)
        self.cost = cost

    def step(self, batch: MiniBatch, extras: StepExtrasOf) -> StepRecord:
        world_size, cfg = self.executor.world_size, self.config
        rank_tokens = cfg.planner.microbatch_tokens or math.ceil(cfg.data.tokens_per_iter / world_size)
        planned = sp_accumulation_step(batch.docs, world_size, rank_tokens, self.cost.microbatch_time)
        result = self.executor.step(planned.strategy, packed(planned.plan), batch.num_targets, batch.step)
        return self.record(batch, result, extras, balance=planned.metrics())


def sp_accumulation_cost(config: TrainConfig, schedule: Sequence[Strategy], model: nn.Module,
                         world_size: int) -> Optional[CostModel]:
    """``planner.balance``: checked; for ``sp-accumulation`` (a homogeneous data-parallel schedule) the cost
    model whose micro-batch times it balances, else None."""
    balance = config.planner.balance
    if balance not in BALANCE_MODES:
        raise HGraphError(f"--balance {balance!r}: expected one of {', '.join(BALANCE_MODES)}")
    if not balances_accumulation(balance):
        return None
    homogeneous = (not config.planner_driven and len(set(schedule)) == 1
                   and all((p.tp, p.pp, p.seq) == (1, 1, 1) for p in schedule[0].pipelines))
    if not homogeneous:
        raise HGraphError(f"--balance {SP_ACCUMULATION} runs homogeneous data parallelism: give "
                          f"--strategy-schedule {world_size}xTP1PP1 (the SP size is chosen per batch)")
    cost = model_cost_model(config.planner.profile, model, world_size, config.cluster.gpus_per_node)
    return with_offload(with_activation_budget(cost, config.planner.memory_budget), config.planner.offload,
                        config.planner.host_memory_budget)


def engine_memory_budget(config: TrainConfig, planner: Optional[IterationPlanner] = None
                         ) -> Union[float, Callable[[Scheme], Optional[float]], None]:
    """The activation budget the engine relieves micro-batches under: ``--memory-budget``, else, for
    ``--offload auto`` with a planner, per scheme the planner's relief budget (the device's room for
    activations, ``CostModel.relief_budget``), so that a micro-batch the planner placed past a
    scheme's plain MaxLen is relieved as the planner priced it; else None."""
    if config.planner.memory_budget is not None or config.planner.offload != "auto" or planner is None:
        return config.planner.memory_budget

    def budget(scheme: Scheme) -> Optional[float]:
        cost = planner.cost
        return cost.relief_budget(scheme) if cost.has(scheme) else None
    return budget


def offload_prices(config: TrainConfig, model: nn.Module, world_size: int,
                   planner: Optional[IterationPlanner] = None) -> Optional[Callable]:
    """The engine's per-layer prices for ``--offload auto`` (``schedule.offload.engine_layer_ms``):
    from the planner's cost model, else from ``--profile`` (its analytic prior when it is
    ``measure``: a fixed schedule measures nothing); None when offload is not ``auto`` or the model
    has no cost model (the engine then offloads before it recomputes)."""
    if config.planner.offload != "auto":
        return None
    if planner is not None:
        return engine_layer_ms(planner.cost)
    profile = config.planner.profile
    try:
        cost = model_cost_model(ANALYTIC if profile == MEASURE else profile, model, world_size,
                                config.cluster.gpus_per_node)
    except HGraphError:
        return None
    return engine_layer_ms(cost)
