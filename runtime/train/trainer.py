"""The training loop: data -> mini-batches -> a strategy per step -> dispatch + pack -> executor step.

The run's configuration is a ``hgraph.runtime.train.config.TrainConfig``.

Deterministic mode (``planner.strategy_schedule`` ``"S1;S2;..."``, ``hgraph train
--strategy-schedule``): step ``k`` uses strategy ``S_(k mod n)``; the model is built right after
``torch.manual_seed(seed)`` on every rank, so every rank starts from the same parameters;
mini-batches take whole documents in file order up to ``tokens_per_iter``.

Planner-driven mode (no schedule; candidates ``planner.strategies``: ``auto`` or ``"S1;S2"``): every
iteration the planner (``hgraph.runtime.planner.service.iteration``) picks the strategy and the
documents' pipelines and micro-batches with the cost model of ``profile``; rank 0 plans and broadcasts the plan, and the
executor runs exactly it. The metrics line then also has the estimate, per-pipeline estimated and
measured latency, per-rank busy time, planner wait, switch time and cache hit.

In schedule mode, dispatch and packing use a simple built-in rule (``dispatch_and_pack``):
documents, longest first (ties by file order), go to the pipeline with the least tokens per rank
after adding them (LPT weighted by the pipeline's ranks); inside a pipeline they are packed
first-fit-decreasing into micro-batches of at most ``microbatch_tokens`` tokens (default: the larger
of the pipeline's longest document and its tokens divided by its PP degree, so a PP pipeline gets
about PP micro-batches). A pipeline may get no document; it still takes part in pull and push.

Checkpoints (``checkpoint_dir``): after every ``checkpoint_every`` steps and after the last one, the
strategy-independent optimizer shards, RNG states, data position and planner state are saved
(``hgraph.runtime.checkpoint.run``); ``resume`` continues from one, on any world size, at the saved
data position, up to ``steps`` in all.

``GraphCache`` keeps one Program per strategy (and, in the executor, the rank's working tensors and
process groups), counting hits, misses and the host time of a switch.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

import hgraph
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.checkpoint.run import (RunCheckpoints, data_fingerprint, data_position, find_resume_point,
                                           load_resume, planner_state, restore_state, rewrite_metrics_before,
                                           run_state)
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.documents import Document, MiniBatch, check_lengths, first_fit, read_jsonl
from hgraph.runtime.data.outlier_delay import run_mini_batches
from hgraph.runtime.engine.executor import Executor, MicroBatch, RankLostError, StepResult, shard_dims_of
from hgraph.runtime.engine.optimizer import ShardedAdam, ShardedAdamW
from hgraph.runtime.planner.service.iteration import all_gather_floats, model_cost_model, pipeline_metrics
from hgraph.runtime.planner.service.setup import planner_process, start_planner
from hgraph.runtime.train.dcp_inter import BALANCE_MODES, DCP_INTER, dcp_inter_step
from hgraph.runtime.train.heartbeat import Heartbeat
from hgraph.runtime.train.launch import init_from_env, local_backend, spawn
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.progress import PrintedLines, ProgressBar, progress_bar
from hgraph.strategy import Cluster, Strategy, parse_strategy_list


@dataclass
class TrainSummary:
    """What a rank returns: per-step results, graph cache figures, the final parameters if asked."""

    steps: list
    cache: dict
    final_params: Optional[dict] = None
    planned: list = field(default_factory=list)   # planner-driven: per step, the planner's figures
    checkpoints: list = field(default_factory=list)   # per checkpoint saved: step, path, bytes, save_s
    resumed_from: Optional[dict] = None               # the checkpoint this run started from
    candidates: list = field(default_factory=list)    # planner-driven: the strategies it chose among


def parse_schedule(text: str, world_size: int) -> list[Strategy]:
    """``"S1;S2;..."`` -> strategies; each must use exactly ``world_size`` ranks (one-line error)."""
    return parse_strategy_list(text, world_size, "--strategy-schedule")


def dispatch_and_pack(strategy: Strategy, docs: Sequence[Document],
                      microbatch_tokens: Optional[int] = None) -> list[list[list[Document]]]:
    """The built-in rule (module docstring): per pipeline, its micro-batches, each a list of documents."""
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
        longest = max(len(d) for d in mine)
        cap = microbatch_tokens or max(longest, math.ceil(load[i] / strategy.pipelines[i].pp))
        if cap < longest:
            d = max(mine, key=len)
            raise HGraphError(f"document {d.index} has {len(d)} tokens, more than the micro-batch limit {cap}")
        bins = first_fit(mine, cap)        # already longest first
        out.append([sorted(b, key=lambda d: d.index) for b in bins])
    return out


class GraphCache:
    """One Program per strategy, with hits, misses and the host time of each switch."""

    def __init__(self, compiled: Any, cluster: Cluster) -> None:
        self.compiled, self.cluster = compiled, cluster
        self.hits = self.misses = 0
        self.switch_s: list[float] = []
        self.compile_s: list[float] = []
        self._programs: dict[Strategy, Any] = {}

    def get(self, strategy: Strategy) -> Any:
        t0 = time.perf_counter()
        prog = self._programs.get(strategy)
        if prog is None:
            self.misses += 1
            prog = self.compiled.instantiate(strategy, self.cluster)
            self._programs[strategy] = prog
            self.compile_s.append(time.perf_counter() - t0)
        else:
            self.hits += 1
            self.switch_s.append(time.perf_counter() - t0)
        return prog

    def info(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "programs": len(self._programs),
                "max_hit_switch_ms": 1e3 * max(self.switch_s, default=0.0),
                "compile_s": sum(self.compile_s)}


def build_model(config: TrainConfig) -> torch.nn.Module:
    """The model, built right after ``torch.manual_seed(seed)`` (the same on every rank)."""
    model = config.model
    spec = model.model if ":" in model.model else f"llama:{model.model}"
    torch.manual_seed(model.seed)
    return resolve_model_spec(spec, model.model_args)


def make_optimizer(config: TrainConfig, compiled: Any, rank: int, world_size: int) -> Any:
    opt = config.optimizer
    if opt.optimizer not in ("adam", "adamw"):
        raise HGraphError(f"--optimizer {opt.optimizer!r}: allowed are adam, adamw")
    cls = ShardedAdam if opt.optimizer == "adam" else ShardedAdamW
    full = dict(compiled._orig_mod.named_parameters())
    named = [(n, full[n]) for n in compiled.hgraph.params]
    kwargs = {} if opt.weight_decay is None else {"weight_decay": opt.weight_decay}
    return cls(named, shard_dims_of(compiled), rank, world_size, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
               max_grad_norm=opt.grad_clip, **kwargs)


class Trainer:
    """Runs a ``TrainConfig`` on this rank of an initialised process group (or alone)."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int, groups: Any = None,
                 planner_channel: Any = None) -> None:
        if world_size != config.cluster.world_size:
            raise HGraphError(f"the run has {world_size} processes but --world-size is "
                              f"{config.cluster.world_size}")
        if config.data.steps < 1:
            raise HGraphError(f"--steps must be >= 1, got {config.data.steps}")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.planner = None
        if not config.planner_driven:
            self.schedule = parse_schedule(config.planner.strategy_schedule, world_size)
        self.model = build_model(config)
        self.docs = self.documents()
        self.fingerprint = data_fingerprint(self.docs)
        self.resumed = load_resume(config, rank, world_size, self.fingerprint)   # None: a fresh run
        groups = groups if groups is not None else GroupCache(rank, world_size)
        # one GPU per process under NCCL: masters, working tensors and buffers live on it
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu"))
        self.model.to(self.device)
        self.compiled = hgraph.compile(self.model, dtype=config.model.dtype)
        if config.planner_driven:
            self.planner = start_planner(self, groups, planner_channel)
            self.schedule = list(self.planner.candidates)
        self.cluster = Cluster(world_size, config.cluster.gpus_per_node)
        self.cache = GraphCache(self.compiled, self.cluster)
        if self.planner is None:
            for s in dict.fromkeys(self.schedule):    # bad strategies fail before any step
                self.cache.get(s)
            self.cache.hits = 0
        # planner-driven: a strategy is instantiated when first chosen (a cache miss, in its switch_s)
        self.optimizer = make_optimizer(config, self.compiled, rank, world_size)
        if self.resumed is not None:
            restore_state(self.resumed, self.optimizer)
        self.planned: dict[int, dict] = {}      # planner-driven mode: per step, its planner figures
        self.balance_info: dict[int, dict] = {}  # --balance dcp-inter: per step, its figures
        self.dcp_cost = self._dcp_inter_cost()
        self.executor = Executor(self.compiled, self.optimizer, rank, world_size, groups,
                                 device=self.device, skip_nonfinite=config.optimizer.skip_nonfinite,
                                 memory_budget=config.planner.memory_budget,
                                 cp_sharding=config.planner.cp_sharding, track_memory=config.logging.track_memory)

    def _dcp_inter_cost(self) -> Any:
        """DCP-inter mode (``runtime.dcp_balance``): checks the run and returns the cost model."""
        cfg = self.config
        if cfg.planner.balance not in BALANCE_MODES:
            raise HGraphError(f"--balance {cfg.planner.balance!r}: expected one of {', '.join(BALANCE_MODES)}")
        if cfg.planner.balance != DCP_INTER:
            return None
        homogeneous = (self.planner is None and len(set(self.schedule)) == 1
                       and all((p.tp, p.pp, p.cp) == (1, 1, 1) for p in self.schedule[0].pipelines))
        if not homogeneous:
            raise HGraphError(f"--balance {DCP_INTER} runs homogeneous data parallelism: give "
                              f"--strategy-schedule {self.world_size}xTP1PP1 (the SP size is chosen per batch)")
        cost = model_cost_model(cfg.planner.profile, self.model, self.world_size, cfg.cluster.gpus_per_node)
        cost.activation_budget_bytes = cfg.planner.memory_budget
        return cost

    def dcp_inter_step(self, batch: MiniBatch) -> StepResult:
        """One step of DCP-inter: per-batch SP size, micro-batches balanced over the replicas."""
        cfg = self.config
        rank_tokens = cfg.planner.microbatch_tokens or math.ceil(cfg.data.tokens_per_iter / self.world_size)
        planned = dcp_inter_step(batch.docs, self.world_size, rank_tokens, self.dcp_cost.microbatch_time)
        self.balance_info[batch.step] = planned.metrics()
        program = self.cache.get(planned.strategy)
        mbs = [[MicroBatch.pack([d.input_ids for d in mb], [d.index for d in mb]) for mb in pipe]
               for pipe in planned.plan]
        return self.executor.step(program, mbs, batch.num_targets, batch.step)

    def progress_bar(self, total: int, label: str, *, plain: bool = False) -> ProgressBar:
        """A bar of this rank from the config's factory (``runtime.train.progress``)."""
        return progress_bar(self.config.progress_bars, total, label, rank=self.rank, plain=plain)

    def documents(self) -> list[Document]:
        cfg = self.config
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if cfg.docs is not None:
            docs = [Document(i, tuple(int(t) for t in d)) for i, d in enumerate(cfg.docs)]
            if not docs or any(len(d) == 0 for d in docs):
                raise HGraphError("documents must be non-empty lists of token ids")
        elif cfg.data.data is not None:
            docs = read_jsonl(cfg.data.data, vocab)
        else:
            raise HGraphError("no training data: give --data FILE.jsonl")
        check_lengths(docs, cfg.data.tokens_per_iter,
                      getattr(getattr(self.model, "config", None), "max_seq_len", None))
        return docs

    def run(self) -> TrainSummary:
        cfg = self.config
        results: list[StepResult] = []
        start_step = self.resumed.step if self.resumed is not None else 0
        start_position = self.resumed.data_position["next_document"] if self.resumed is not None else 0
        ckpts = cfg.checkpointing
        checkpoints = RunCheckpoints(Path(ckpts.checkpoint_dir) if ckpts.checkpoint_dir else None,
                                     ckpts.checkpoint_every, cfg.data.steps, ckpts.keep_checkpoints)
        metrics = None
        if cfg.logging.metrics and self.rank == 0:
            if self.resumed is not None:
                rewrite_metrics_before(Path(cfg.logging.metrics), start_step)
            metrics = open(cfg.logging.metrics, "a" if self.resumed is not None else "w", encoding="utf-8")
        self.executor.heartbeat = Heartbeat.for_default_group()
        now = start_step
        bar = self.progress_bar(cfg.data.steps, "training") if cfg.log_steps else PrintedLines()
        try:
            for batch, delay_state in run_mini_batches(self.docs, cfg, self.world_size, self.resumed):
                now = batch.step
                result = self.step(batch)
                results.append(result)
                memory_line = (self._memory_per_rank(result) if cfg.logging.metrics and self.executor.track_memory
                               else {})
                if metrics is not None:
                    line = _metrics_line(result, self.cache)
                    line.update(self.planned.get(batch.step, {}))
                    # the documents of the step and the data position after it: a resumed run can
                    # be checked to train every document exactly once
                    line["documents"] = [d.index for d in batch.docs]
                    line["next_document"] = batch.next_position
                    if delay_state is not None:
                        # outlier delay: what came from earlier steps and what still waits, so a
                        # reader can check that every document read is trained once
                        line["delayed"] = batch.delayed
                        line["pending_delay"] = batch.pending
                        line["delay_iters"] = list(batch.delay_iters)
                    line.update(memory_line)
                    line.update(self.balance_info.get(batch.step, {}))
                    metrics.write(json.dumps(line) + "\n")
                    metrics.flush()
                if cfg.log_steps and self.rank == 0:
                    if batch.step % cfg.logging.log_every == 0 or batch.step + 1 == cfg.data.steps:
                        bar.write(format_step_line(result, self.planned.get(batch.step)))
                    bar.update(1, f"step {batch.step}")
                if checkpoints.due(batch.step + 1):
                    pos = data_position(batch.step + 1, batch.next_position, self.docs, cfg.data.tokens_per_iter,
                                        self.fingerprint)
                    saved = checkpoints.save(batch.step + 1, self.optimizer, rank=self.rank,
                                             world_size=self.world_size, data_position=pos,
                                             delay_queues=delay_state,
                                             planner_state=planner_state(cfg, self.planner, self.schedule,
                                                                         self.world_size),
                                             run=run_state(cfg, self.world_size))
                    if cfg.log_steps and self.rank == 0:
                        print(f"checkpoint {saved.path} ({saved.bytes / 1e6:.2f} MB) saved in "
                              f"{1e3 * saved.save_s:.0f} ms", flush=True)
        except RuntimeError as exc:
            # a collective outside the executor's step (checkpoint save, planner broadcast) failed:
            # name the rank that died, as the executor does inside a step
            beat = self.executor.heartbeat
            lost = beat.lost_ranks() if beat is not None and not isinstance(exc, RankLostError) else []
            if lost:
                raise RankLostError(now, lost, self.rank, exc) from exc
            raise
        finally:
            bar.close()
            if self.planner is not None and self.planner.ahead is not None:
                self.planner.ahead.stop()
            if metrics is not None:
                metrics.close()
            if self.executor.heartbeat is not None:
                self.executor.heartbeat.stop()
                self.executor.heartbeat = None
        final = self.final_state_dict() if cfg.checkpointing.save_final else None
        if final is not None and self.rank == 0:
            Path(cfg.checkpointing.save_final).parent.mkdir(parents=True, exist_ok=True)
            torch.save(final, cfg.checkpointing.save_final)
        planned = [self.planned[r.step] for r in results if r.step in self.planned]
        resumed = None if self.resumed is None else {
            "path": str(self.resumed.path), "step": self.resumed.step,
            "saved_world_size": self.resumed.saved_world_size, "resharded": self.resumed.resharded,
            "next_document": start_position}
        return TrainSummary(results, self.cache.info(), final, planned, [asdict(c) for c in checkpoints.saved],
                            resumed, [str(s) for s in self.planner.candidates] if self.planner is not None else [])

    def step(self, batch: MiniBatch) -> StepResult:
        if self.planner is not None:
            return self.planned_step(batch)
        if self.dcp_cost is not None:
            return self.dcp_inter_step(batch)
        strategy = self.schedule[batch.step % len(self.schedule)]
        program = self.cache.get(strategy)
        plan = dispatch_and_pack(strategy, batch.docs, self.config.planner.microbatch_tokens)
        mbs = [[MicroBatch.pack([d.input_ids for d in mb], [d.index for d in mb]) for mb in pipe] for pipe in plan]
        # a plain data-parallel step pulls the next step's parameters only if that step runs the same
        # strategy (with a planner the next strategy is not known yet: the executor's default)
        again = (batch.step + 1 < self.config.data.steps
                 and self.schedule[(batch.step + 1) % len(self.schedule)] == strategy)
        return self.executor.step(program, mbs, batch.num_targets, batch.step, prefetch=again)

    def planned_step(self, batch: MiniBatch) -> StepResult:
        """One step on the planner's plan; its planner figures go to ``self.planned[step]``."""
        planned = self.planner.plan(batch)
        hits = self.cache.hits
        t0 = time.perf_counter()
        program = self.cache.get(planned.plan.strategy)
        switch_s = time.perf_counter() - t0
        result = self.executor.step(program, planned.microbatches, batch.num_targets, batch.step)
        busy = all_gather_floats(result.compute_s, self.world_size, self.device)
        if self.rank == 0 and self.cache.hits > hits:   # a compiling step says nothing about later ones
            self.planner.observe(planned.model_est_ms, 1e3 * result.time_s)
        self.planned[batch.step] = {
            "est_latency_ms": float(planned.plan.est_latency_ms), "est_model_ms": planned.model_est_ms,
            "planner_source": planned.source, "planner_queue_wait_s": planned.queue_wait_s,
            "pipelines": pipeline_metrics(planned.plan, busy), "rank_busy_s": busy,
            "planner_wait_s": planned.wait_s, "planner_solve_ms": float(planned.plan.solve_ms),
            "switch_s": switch_s, "cache_hit": self.cache.hits > hits,
            "plan_documents": sorted(batch.docs[i].index for i in planned.plan.documents())}
        return result

    def _memory_per_rank(self, r: StepResult) -> dict:
        """Measured and predicted peak bytes of every rank (collective), for the metrics line."""
        nan = float("nan")
        peak = all_gather_floats(nan if r.peak_mem_bytes is None else r.peak_mem_bytes, self.world_size, self.device)
        pred = all_gather_floats(nan if r.predicted_mem_bytes is None else r.predicted_mem_bytes,
                                 self.world_size, self.device)
        return {"peak_mem_bytes": [None if math.isnan(v) else int(v) for v in peak],
                "predicted_mem_bytes": [None if math.isnan(v) else round(v) for v in pred],
                "memory_budget": self.config.planner.memory_budget, "recompute_layers": r.recompute_layers}

    def final_state_dict(self) -> dict:
        """The fp32 parameters gathered (collective), keyed like the original module's state_dict."""
        params = self.optimizer.full_state_dict()
        with torch.no_grad():
            for name, p in self.compiled._orig_mod.named_parameters():
                p.copy_(params[name].to(p.dtype))
        return {k: v.detach().cpu().clone() for k, v in self.compiled._orig_mod.state_dict().items()}


def format_step_line(r: StepResult, planned: Optional[dict] = None) -> str:
    """The readable per-iteration line: step, strategy, estimated vs measured ms, loss, tokens/s,
    cache hit (the planner's fields only in planner-driven mode)."""
    est = f"est {planned['est_latency_ms']:8.2f} ms  " if planned else ""
    hit = ("  cache hit" if planned["cache_hit"] else "  cache miss") if planned else ""
    tps = r.tokens / r.time_s if r.time_s > 0 else 0.0
    return (f"step {r.step:>4}  {r.strategy:<28} {est}measured {1e3 * r.time_s:8.1f} ms  loss {r.loss:.6f}  "
            f"{tps:8.0f} tok/s{hit}" + ("  (skipped: non-finite loss)" if r.skipped else ""))


def _metrics_line(r: StepResult, cache: GraphCache) -> dict:
    return {"step": r.step, "strategy": r.strategy, "loss": r.loss, "tokens": r.tokens, "time_s": r.time_s,
            "pull_s": r.pull_s, "compute_s": r.compute_s, "push_s": r.push_s, "optimizer_s": r.optimizer_s,
            "skipped": r.skipped, "grad_norm": r.grad_norm, "overlapped_update": r.overlapped_update,
            "pull_prefetched": r.pull_prefetched, "cache_hits": cache.hits,
            "cache_misses": cache.misses, **{f"{k}": v for k, v in r.bytes.items()}}


def train_worker(rank: int, world_size: int, config: TrainConfig, planner_channel: Any = None) -> dict:
    """Spawn target: run ``config`` on this rank; returns steps and cache figures (rank 0: final params).

    Bad input (HGraphError) is returned as ``{"error": message}``: it happens at the same point on
    every rank (before any collective, or after the loss all-reduce), so no rank is left waiting.
    """
    try:
        summary = Trainer(config, rank, world_size, planner_channel=planner_channel if rank == 0 else None).run()
    except HGraphError as exc:
        return {"error": str(exc)}
    return {"rank": rank, "steps": [asdict(s) for s in summary.steps], "cache": summary.cache,
            "planned": summary.planned, "final_params": summary.final_params if rank == 0 else None,
            "checkpoints": summary.checkpoints, "resumed_from": summary.resumed_from,
            "candidates": summary.candidates}


def run_training(config: TrainConfig, *, timeout_s: float = 60.0) -> dict:
    """Run ``config`` and return rank 0's ``train_worker`` result (bad input: HGraphError); under
    ``torchrun`` this process's own result (its ``"rank"`` says which).

    Under ``torchrun`` (``RANK`` set) this process is one rank of the run; otherwise
    ``config.cluster.world_size`` local gloo processes are spawned. ``timeout_s`` bounds each collective, so
    a lost rank is reported within it; a spawned run also names a rank whose process died.
    """
    ckpts, cluster = config.checkpointing, config.cluster
    if ckpts.resume and config.resume_from is None and ckpts.checkpoint_dir is not None:
        # resolved once, before any process starts: every rank loads the same checkpoint
        point = find_resume_point(ckpts.checkpoint_dir, fallback=ckpts.resume_fallback)
        config = config.with_values(resume_from=str(point.folder))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = init_from_env(None if cluster.backend == "auto" else cluster.backend, timeout_s=timeout_s)
        with planner_process(config, rank == 0) as channel:      # rank 0's process owns the planner
            results = [train_worker(rank, world, config, channel)]
    else:
        total = 120.0 + timeout_s * (config.data.steps + 1)
        with planner_process(config, True) as channel:           # the launcher owns the planner
            results = spawn(train_worker, cluster.world_size,
                            backend=local_backend(cluster.backend, cluster.world_size),
                            args=(config, channel), timeout_s=total)
    error = next((r["error"] for r in results if "error" in r), None)
    if error is not None:
        raise HGraphError(error)
    return results[0]
