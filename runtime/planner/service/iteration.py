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

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama, llama_moe
from hgraph.runtime.data.documents import Document, MiniBatch, doc_lengths
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.process.run_log import run_log
from hgraph.runtime.planner import selection
from hgraph.runtime.planner.auto_candidates import auto_candidates
from hgraph.runtime.planner.cost.analytic_prior import analytic_cost_model
from hgraph.runtime.planner.cost.calibration import StepCorrection, calibrate_cost_model, scaled_plan
from hgraph.runtime.planner.cost.cost_model import load_cost_model, with_activation_budget
from hgraph.runtime.planner.cost.moe_cost import expert_shape_of
from hgraph.runtime.planner.cost.profiler import measure_host_link
from hgraph.runtime.planner.cost.runtime_memory import (check_documents_fit, counted_states,
                                                        default_device_memory, is_runtime_model,
                                                        with_device_memory)
from hgraph.runtime.planner.cost.ulysses import ulysses_degrees
from hgraph.runtime.planner.schedule.offload import with_host_link
from hgraph.runtime.planner.service.plan_ahead import PlannerLost
from hgraph.strategy import Strategy, parse_strategy_list

log = run_log(__name__)

ANALYTIC = "analytic"
MEASURE = "measure"      # the analytic prior's schemes, timed on this machine at the start of the run


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def model_cost_model(profile: str, model: Any, world_size: int, gpus_per_node: int = 8):
    """The cost model for ``--profile``: ``analytic`` = the analytic prior for ``model``'s shape
    (TP degrees dividing its attention and KV heads, PP degrees dividing its layers, Ulysses degrees
    dividing its heads per TP rank; a MoE model's experts, ``moe_cost.expert_shape_of``) on
    ``world_size`` GPUs; anything else is a built-in profile name, a profile FILE or ``FILE:NAME``.
    (``measure`` is resolved by ``measured_cost_model``, collectively.)"""
    if profile not in (ANALYTIC, MEASURE):
        return load_cost_model(profile, world_size, gpus_per_node)
    return config_cost_model(getattr(model, "config", None), world_size, gpus_per_node, profile)


def config_cost_model(cfg: Any, world_size: int, gpus_per_node: int = 8, profile: str = ANALYTIC):
    """The analytic prior of a model config's shape (``model_cost_model``): no model is built, so a
    16B-class config is priced in a second."""
    try:
        hidden, layers, vocab = int(cfg.hidden_size), int(cfg.num_layers), int(cfg.vocab_size)
    except AttributeError:
        raise HGraphError(f"--profile {profile} needs a zoo Llama-style model (hidden_size, num_layers, "
                          "vocab_size); give a measured profile with --profile NAME|FILE") from None
    heads = math.gcd(int(getattr(cfg, "num_heads", 1)), int(getattr(cfg, "num_kv_heads", 0) or 0)) \
        or int(getattr(cfg, "num_heads", 1))
    tps = _divisors(heads, min(world_size, gpus_per_node))
    pps = _divisors(layers, world_size)
    ffn = getattr(cfg, "intermediate_size", None)
    return analytic_cost_model(hidden=hidden, layers=layers, vocab=vocab, world_size=world_size,
                               ffn_hidden=int(ffn) if ffn else None, gpus_per_node=gpus_per_node,
                               tps=tps, pps=pps, heads=int(getattr(cfg, "num_heads", 0) or 0),
                               kv_heads=getattr(cfg, "num_kv_heads", None), experts=expert_shape_of(cfg))


def bounded_cost_model(cost: Any, model: Any, device_memory: Any, working_bytes: int,
                       compiled: Any = None, compiled_step: bool = False,
                       shard_group: int | None = None) -> tuple[Any, float | None]:
    """``cost`` under ``device_memory`` (bytes, ``"auto"`` or None) and the limit in bytes; the model
    states the runtime's ranks hold are counted once, from ``compiled`` when given; ``compiled_step``:
    the activations a ``--compile`` step keeps; ``shard_group``: the optimizer states are sharded over
    groups of that many ranks (None: the world)."""
    if device_memory is None:
        return cost, None
    # the TP>1 schemes' activations: a token slice between TP regions under sequence parallelism
    sp = compiled.sequence_parallel_status() == "on" if compiled is not None else True
    states = counted_states(cost, model, working_bytes=working_bytes, compiled=compiled, group_size=shard_group) \
        if is_runtime_model(cost, model) else None
    if device_memory == "auto":
        sized = with_device_memory(cost, model, float(2 ** 50), working_bytes=working_bytes, states=states,
                                   sequence_parallel=sp, compiled_step=compiled_step)
        context = int(getattr(getattr(model, "config", None), "max_seq_len", 0) or 0)
        if not context:
            raise HGraphError("--device-memory auto needs a model with max_seq_len; give BYTES")
        device_memory = default_device_memory(sized, cost.model, cost.world_size, context)
    return (with_device_memory(cost, model, float(device_memory), working_bytes=working_bytes, states=states,
                               sequence_parallel=sp, compiled_step=compiled_step), float(device_memory))


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


def measured_cost_model(model: Any, rank: int, world_size: int, groups: Any = None, gpus_per_node: int = 8,
                        tp_slots: int = 0, progress: Callable[[str], None] | None = None, *,
                        device: Any = None, dtype: Any = None, ulysses: bool | None = None):
    """``--profile measure``: the analytic prior's schemes timed on this machine by every rank at once
    (``hgraph.runtime.planner.cost.calibration``; collective), on the run's ``device`` in its working
    ``dtype`` (CPU, fp32 by default), with the host link's bandwidth measured there. Needs a zoo
    Llama-style model (a MoE one's shards are MoE decoders, and its EP all-to-all is timed for the
    degrees dividing its experts up to a node). ``ulysses``: time the all-to-all of the Ulysses
    degrees the model's heads allow and derive its UL schemes (None: on a GPU only)."""
    prior = model_cost_model(MEASURE, model, world_size, gpus_per_node)
    cfg = model.config
    if not isinstance(cfg, llama.LlamaConfig):
        raise HGraphError("--profile measure needs a zoo Llama model (it times 1- and 2-layer copies); "
                          "give --profile analytic or a profile FILE")
    experts = prior.model.experts
    with torch.random.fork_rng(devices=[]):     # the run's RNG stream does not depend on the profile
        cost, _ = calibrate_cost_model(prior, cfg, lambda n, tp: _shard_model(cfg, n, tp),
                                       rank, world_size, groups, tp_slots=tp_slots, progress=progress,
                                       device=device, dtype=dtype,
                                       ul_degrees=measured_ulysses_degrees(prior, world_size, device, ulysses),
                                       ep_degrees=experts.ep_degrees(min(world_size, gpus_per_node)) if experts else ())
    # the host link activation offload copies over, measured on this rank's device (schedule.offload)
    return with_host_link(cost, measure_host_link(device if device is not None else "cpu"))


def _shard_model(cfg: Any, layers: int, tp: int) -> Any:
    """One TP rank's shard of a zoo Llama (or MoE decoder, its experts' width divided too) with ``layers``
    layers: what calibration times."""
    shard = llama.tp_shard_config(cfg, layers, tp)
    if isinstance(cfg, llama_moe.LlamaMoeConfig):
        return llama_moe.build(dataclasses.replace(shard, moe_intermediate_size=-(-cfg.moe_intermediate_size // tp)))
    return llama.build(shard)


def measured_ulysses_degrees(prior: Any, world_size: int, device: Any, ulysses: bool | None) -> list[int]:
    """The UL degrees ``--profile measure`` times: those the model's heads allow at TP 1 on ``world_size``
    ranks, when ``ulysses`` (None: when ``device`` is a GPU)."""
    if ulysses is None:
        ulysses = torch.device(device or "cpu").type == "cuda"
    return ulysses_degrees(prior.model.heads, 1, min(world_size, prior.ulysses_limit)) if ulysses else []


@dataclass
class PlannedStep:
    """One iteration's plan turned into the executor's input, with the time it took to get it.
    ``model_est_ms``: the cost model's own estimate (``plan.est_latency_ms`` is it times the online
    correction); ``source``: ``ahead`` (the planner process) or ``inline`` (planned on rank 0)."""

    plan: Any                                   # hgraph.runtime.planner.plan.Plan
    microbatches: list[list[MicroBatch]]
    wait_s: float
    model_est_ms: float = 0.0
    source: str = "inline"
    queue_wait_s: float = 0.0                   # rank 0 blocked on the planner process (0 inline)
    upcoming: list = field(default_factory=list)   # the strategies of the next steps' plans known now


class IterationPlanner:
    """Plans each mini-batch on rank 0 and shares the plan with every rank.

    With ``ahead`` (rank 0's ``PlanConsumer``) the plans come from the planner process; if it is lost,
    rank 0 prints one warning and plans inline from then on. ``correction`` (rank 0) scales the
    estimates by what the last steps measured (``observe``)."""

    def __init__(self, cost: Any, candidates: Sequence[Strategy], rank: int, *, source: str = "given",
                 method: str = "fast", time_limit_s: float = 10.0, device_memory: float | None = None) -> None:
        self.cost, self.candidates, self.rank = cost, list(candidates), rank
        self.source, self.method, self.time_limit_s = source, method, time_limit_s
        self.device_memory = device_memory          # bytes per rank bounding MaxLen (None: the profile's)
        self.ahead = None
        self._first_ahead = True         # the next plan taken from ``ahead`` is the run's first
        self.correction = StepCorrection()
        self.warnings: list[str] = []

    @classmethod
    def create(cls, strategies: str, profile: str, model: Any, documents: Sequence[Document],
               tokens_per_iter: int, rank: int, world_size: int, gpus_per_node: int = 8, *,
               groups: Any = None, tp_slots: int = 0,
               progress: Callable[[str], None] | None = None, device_memory: Any = None,
               working_bytes: int = 4, max_candidates: int | None = None,
               compiled: Any = None, method: str = "fast", time_limit_s: float = 10.0,
               activation_budget_bytes: float | None = None, device: Any = None, dtype: Any = None,
               compiled_step: bool = False, shard_group: int | None = None) -> "IterationPlanner":
        """``strategies``: ``auto`` (``auto_candidates`` for the lengths of ``documents``) or
        ``"S1;S2"``. The candidate set is computed on rank 0 and broadcast. ``profile`` ``measure``
        calibrates on every rank (collective). ``device_memory``: bytes per rank that bound every
        scheme's MaxLen (``runtime_memory``; ``"auto"``: sized from the model, ``default_device_memory``;
        None: the profile's own memory model); ``max_candidates``: at most this many ``auto``
        candidates; ``compiled``: ``model`` compiled (its layouts size the model states; default:
        traced again); ``method``, ``time_limit_s``: how each iteration dispatches;
        ``activation_budget_bytes``: the planner's micro-batch times include the recomputation this
        budget forces (``with_activation_budget``; the candidates are chosen without it); ``device``,
        ``dtype``: where and in what ``measure`` times the model (the run's); ``compiled_step``: the run
        compiles its graphs (the activations it keeps bound MaxLen); ``shard_group``: its optimizer
        states are sharded over groups of that many ranks (None: the world), which the model states
        count."""
        if profile == MEASURE:
            cost = measured_cost_model(model, rank, world_size, groups, gpus_per_node, tp_slots, progress,
                                       device=device, dtype=dtype)
        else:
            cost = model_cost_model(profile, model, world_size, gpus_per_node)
        cost, limit = _on_rank0(lambda: bounded_cost_model(cost, model, device_memory, working_bytes, compiled,
                                                           compiled_step, shard_group), rank)
        # the corpus' lengths are read on rank 0 only, as an array: every rank holding them as a Python
        # list cost ~36 bytes a document (72 GB per rank for a 2T-token corpus)
        if strategies.strip() != "auto":
            candidates = parse_candidates(strategies, world_size)
            _on_rank0(lambda: check_documents_fit(doc_lengths(documents), cost, limit,
                                                  [p for s in candidates for p in s.pipelines]), rank)
            return cls(with_activation_budget(cost, activation_budget_bytes), candidates, rank, source="given",
                       method=method, time_limit_s=time_limit_s, device_memory=limit)
        _on_rank0(lambda: check_documents_fit(doc_lengths(documents), cost, limit), rank)
        if progress is not None:
            progress("proposal")

        def propose() -> tuple:
            lengths = doc_lengths(documents)
            # the longest document is what a candidate must hold (not the model's context, which may
            # be longer than any scheme's MaxLen under a device memory limit)
            longest = int(lengths.max())
            max_len = min(int(getattr(getattr(model, "config", None), "max_seq_len", 0) or longest), longest)
            return auto_candidates(lengths, cost, world_size, max_len, tokens_per_iter,
                                   max_candidates=max_candidates)
        candidates, source = _on_rank0(propose, rank)
        return cls(with_activation_budget(cost, activation_budget_bytes), candidates, rank, source=source,
                   method=method, time_limit_s=time_limit_s, device_memory=limit)

    def plan_ahead(self, consumer: Any, batches: Iterable[MiniBatch]) -> None:
        """Rank 0: hand the planner process the cost model, candidates and the coming mini-batches
        (read from ``batches`` as the planner needs them)."""
        consumer.setup(self.cost, self.candidates, self.method, self.time_limit_s,
                       ((b.step, [len(d) for d in b.docs]) for b in batches))
        self.ahead = consumer

    def _plan_on_rank0(self, batch: MiniBatch) -> tuple[Any, str, float, float, list]:
        plan, source, queue_wait = None, "inline", 0.0
        if self.ahead is not None:
            try:
                plan, queue_wait = self.ahead.get(batch.step)
                source = "ahead"
            except PlannerLost as exc:
                self.ahead = None
                warning = f"hgraph train: warning: {exc}; planning inline from step {batch.step} on"
                self.warnings.append(warning)
                log.warning(warning)
        if plan is None:
            plan = selection.plan_iteration([len(d) for d in batch.docs], self.candidates, self.cost,
                                  method=self.method, index=batch.step, time_limit_s=self.time_limit_s)
        # the first step waits for the next one's plan too, so that its strategy builds during this
        # step (later steps find the planner ahead of them)
        upcoming = self.ahead.upcoming(wait_for=int(self._first_ahead)) if self.ahead is not None else []
        self._first_ahead = False
        return (scaled_plan(plan, self.correction.factor), source, float(plan.est_latency_ms), queue_wait,
                upcoming)

    def plan(self, batch: MiniBatch) -> PlannedStep:
        """The plan of ``batch`` (the same on every rank) and its packed micro-batches per pipeline,
        with the strategies of the next steps' plans that the planner process has delivered (the
        same on every rank too: the ranks build them ahead)."""
        t0 = time.perf_counter()
        plan, source, model_est, queue_wait, upcoming = _on_rank0(lambda: self._plan_on_rank0(batch), self.rank)
        wait = time.perf_counter() - t0
        return PlannedStep(plan, microbatches_of_plan(plan, batch.docs), wait, model_est, source, queue_wait,
                           upcoming)

    def observe(self, model_est_ms: float, measured_ms: float) -> None:
        """A measured step (rank 0): feeds the online correction of later estimates."""
        self.correction.observe(model_est_ms, measured_ms)


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
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return [float(t[0]) for t in out]
