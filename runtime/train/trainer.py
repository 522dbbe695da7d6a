"""The training loop: data -> mini-batches -> each step's strategy and micro-batches -> executor step.

The run's configuration is a ``hgraph.runtime.train.config.TrainConfig``. ``Trainer`` sets up this
rank: the model, built on the meta device (nothing allocated; ``hgraph.runtime.weights``), its
buffers computed, and the fp32 optimizer shards filled one parameter at a time from the run's weight
source (by default the model's own initialisation after ``torch.manual_seed(seed)``, bitwise equal
on every rank and to an eager build; the safetensors of an ``hf:DIR`` model; ``init_from``'s files;
``hgraph.runtime.weights.choice``), so no rank ever holds the whole model; the documents
(mini-batches take whole documents in file order up to ``tokens_per_iter``; with outlier delay,
``hgraph.runtime.data.outlier_delay``); the compiled model, the sharded optimizer, the cache of
per-strategy Programs and the executor; and the step mode (``hgraph.runtime.train.step_modes``): a
fixed schedule, the planner's choice every step, or DCP-inter.

``Trainer.run`` is the loop, as torchtitan's: per mini-batch, the mode's step, then the step is
handed to the components that report it: the metrics line (``hgraph.runtime.train.metrics``), rank
0's step line and progress bar (``hgraph.runtime.train.progress``), the checkpoint when one is due,
and the heartbeat that names a lost rank when a collective fails.

Checkpoints (``checkpoint_dir``): after every ``checkpoint_every`` steps and after the last one, the
strategy-independent optimizer shards, RNG states, data position and planner state are saved
(``hgraph.runtime.checkpoint.run``); ``resume`` continues from one, on any world size, at the saved
data position, up to ``steps`` in all. With a checkpoint folder, SIGTERM stops the run after the
step all ranks agree on, with a checkpoint (``hgraph.runtime.train.exit_signal``).

The executor's ``ProgramCache`` (``hgraph.runtime.engine.program_cache``) keeps per strategy the
Program and this rank's state for it (working tensors, process groups), counting hits, misses, the
host time of a switch and of each build (the step modes have the next steps' strategies built ahead,
off the steps' critical path); the trainer reads its figures. What a rank builds before the loop
(model, weight source, optimizer, planner setup) is ``runtime/train/model_setup.py``'s; a rank's run
and the run of all ranks are ``runtime/train/rank_run.py``'s, under the run object of
``runtime/train/run.py``.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

import hgraph
from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint.run import (RunCheckpoints, SavedCheckpoint, data_fingerprint, data_position,
                                           restore_state)
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.process_groups import GroupCache, shard_rounds
from hgraph.runtime.data.corpus import Corpus, DataOrder, SourceSpec, corpus_of, open_corpus
from hgraph.runtime.data.documents import Document, MiniBatch, doc_lengths
from hgraph.runtime.data.outlier_delay import run_mini_batches
from hgraph.runtime.data.stored import ConcatDocuments, LongReport, limit_long, merge_reports
from hgraph.runtime.engine import host_heap
from hgraph.runtime.engine.executor import Executor, RankLostError, StepResult
from hgraph.runtime.engine.router_losses import RouterLossConfig
from hgraph.runtime.planner.cost.shard_group import resolve_shard_group
from hgraph.shard_rule import shard_group_ranks
from hgraph.runtime.planner.service.setup import start_planner
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.data_setup import model_limits
from hgraph.runtime.train.devices import rank_device
from hgraph.runtime.train.exit_signal import ExitSignal
from hgraph.runtime.train.heartbeat import Heartbeat, Silent, silent_peers_text
from hgraph.runtime.process.lifetime import end_process
from hgraph.runtime.process.run_log import run_log
from hgraph.runtime.train.loss_health import FlatLossWatch
from hgraph.runtime.train.lr_schedule import schedule_of
from hgraph.runtime.train.metrics import MetricsWriter, format_step_line, memory_figures
from hgraph.runtime.train.model_setup import dropout_status, make_optimizer, model_and_weights, planner_setup_of
from hgraph.runtime.train.progress import PrintedLines, ProgressBar, progress_bar
from hgraph.runtime.train.resume import load_resume, run_state
from hgraph.runtime.train.step_loggers import StepLoggers, step_scalars
from hgraph.runtime.train.step_modes import (FixedSchedule, PlannerDriven, SpAccumulation, StepExtrasOf, StepMode,
                                             dispatch_and_pack, engine_memory_budget, offload_prices, packed,
                                             parse_schedule, sp_accumulation_cost)
from hgraph.runtime.train.step_record import StepExtras, StepRecord
from hgraph.runtime.train.throughput import ModelFlops, device_peak_tflops, step_throughput
from hgraph.runtime.weights.deferred_init import to_meta
from hgraph.runtime.weights.sources import install_buffers
from hgraph.strategy import Cluster, Strategy

log = run_log(__name__)


@dataclass
class TrainSummary:
    """What a rank returns: per-step records, program cache figures, the final parameters if asked."""

    records: list[StepRecord]
    cache: dict
    final_params: Optional[dict] = None
    checkpoints: list = field(default_factory=list)   # per checkpoint saved: step, path, bytes, save_s
    resumed_from: Optional[dict] = None               # the checkpoint this run started from
    candidates: list = field(default_factory=list)    # planner-driven: the strategies it chose among
    dropout: str = "none"                             # ``dropout_status`` of the run
    long_documents: dict = field(default_factory=dict)   # what --long did (``LongReport``)
    sequence_parallel: str = "on"                     # ``CompiledModule.sequence_parallel_status``
    stopped: Optional[dict] = None    # stopped by a signal: {"signal", "step" (steps done), "checkpoint"}
    shard_group: dict = field(default_factory=dict)   # {"size": G, "auto": why ``auto`` chose it, or ""}

    @property
    def steps(self) -> list[StepResult]:
        """Per step, the executor's result."""
        return [r.result for r in self.records]

    @property
    def planned(self) -> list[dict]:
        """Planner-driven: per step, the planner's figures (empty otherwise)."""
        return [dict(r.plan) for r in self.records if r.plan]

    @property
    def step_extra(self) -> list[dict]:
        """Per step: its lr and, when evaluated, eval_loss."""
        return [r.extra_row() for r in self.records]


def _stream(config: TrainConfig) -> dict[str, int]:
    """The options that fix a run's mini-batch stream (``outlier_delay.run_mini_batches``)."""
    return {"tokens_per_iter": config.data.tokens_per_iter, "steps": config.data.steps,
            "outlier_queues": config.planner.outlier_queues}


class Trainer:
    """Runs a ``TrainConfig`` on this rank of an initialised process group (or alone)."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int, groups: Optional[GroupCache] = None,
                 planner_channel: Any = None) -> None:
        if world_size != config.cluster.world_size:
            raise HGraphError(f"the run has {world_size} processes but --world-size is "
                              f"{config.cluster.world_size}")
        if config.data.steps < 1:
            raise HGraphError(f"--steps must be >= 1, got {config.data.steps}")
        self.config, self.rank, self.world_size = config, rank, world_size
        schedule = [] if config.planner_driven else parse_schedule(config.planner.strategy_schedule, world_size)
        self.model, self.weights = model_and_weights(config, say=rank == 0)
        self.weights_from = self.weights.description      # the source is dropped once the shards are filled
        self.corpus, self.long_report = self.open_data()
        self.docs = self.corpus.docs
        self.order = DataOrder(self.corpus, shuffle=config.data.shuffle, seed=config.model.seed)
        self.eval_docs = self.eval_documents()
        self.schedule = schedule_of(config)
        self.loss_watch = FlatLossWatch(config.logging.flat_loss_threshold, self.schedule.warmup_steps)
        self.fingerprint = data_fingerprint(self.docs)
        # --shard-group: the optimizer states sharded over groups of G ranks (auto: why, in the summary)
        self.shard_group, self.shard_group_why = resolve_shard_group(
            config.optimizer.shard_group, world_size, config.cluster.gpus_per_node,
            sum(p.numel() for p in self.model.parameters()), config.cluster.device_memory)
        shard_group = self.shard_group if self.shard_group < world_size else None
        self.resumed = load_resume(config, rank, world_size, self.fingerprint, self.docs, self.order,
                                   shard_group)   # None: fresh
        if self.resumed is not None:
            self.order.check_state(self.resumed.data_position, str(self.resumed.path))
        groups = groups if groups is not None else GroupCache(rank, world_size)
        # masters, working tensors and buffers live on the rank's device (a GPU of its own under NCCL)
        self.device = rank_device(config.cluster.device, rank,
                                  dist.get_backend() if dist.is_initialized() else None)
        if self.device.type == "cpu":
            host_heap.return_large_blocks()     # the process's peak follows what is live (engine/host_heap)
        install_buffers(self.model, self.weights, self.device)
        self.compiled = hgraph.compile(self.model, dtype=config.model.dtype,
                                       dropout=config.model.dropout == "apply",
                                       sequence_parallel=None if config.model.sequence_parallel else False)
        self.sequence_parallel = self.compiled.sequence_parallel_status()
        if self.sequence_parallel.startswith("off:") and rank == 0 and config.log_steps:
            log.info("hgraph: %s", self.sequence_parallel.removeprefix('off: '))
        self.dropout = dropout_status(self.compiled.hgraph.gm, config.model.dropout)
        self.model_flops = ModelFlops.of(self.compiled)        # every step's TFLOP/s and MFU
        self.peak_tflops = device_peak_tflops(self.device, config.cluster.peak_tflops)
        if config.model.dropout == "off" and self.dropout.startswith("off") and rank == 0 and config.log_steps:
            log.info("hgraph: the model's dropout is disabled (%s)", self.dropout)
        self.planner_setup = (planner_setup_of(config, self.compiled, self.device, shard_group)
                              if config.planner_driven else None)
        planner = None
        if self.planner_setup is not None:
            planner = start_planner(
                self.planner_setup, rank=rank, world_size=world_size, model=self.model, compiled=self.compiled,
                docs=self.docs, groups=groups, channel=planner_channel, resumed=self.resumed,
                progress_bar=lambda total, label: self.progress_bar(total, label, plain=config.log_steps and rank == 0),
                run_batches=lambda: (b for b, _ in run_mini_batches(self.docs, world_size, **_stream(config),
                                                                    resumed=self.resumed,
                                                                    order=self.order.copy())))
        if shard_group is not None:        # collective: every rank creates its shard group and its replicas
            groups.create(shard_rounds(rank, world_size, shard_group))
        self.optimizer = make_optimizer(config, self.compiled, rank, world_size, self.device, shard_group,
                                        groups.get(shard_group_ranks(rank, shard_group)) if shard_group else None)
        if self.resumed is not None:
            restore_state(self.resumed, self.optimizer)
        else:
            self.optimizer.load_shards(self.weights.shards(self.optimizer.layouts), self.weights.description)
        to_meta(self.model, buffers=False)     # an eagerly built model frees its parameters here
        self.weights = None
        vocab_parallel = {"on": True, "off": False}.get(config.model.vocab_parallel_loss)    # auto: None
        # the rank's one choke point for its steps' collectives: their order (strict: one in flight; a hang
        # named after the heartbeat timeout, and before the collective's own timeout, 60 s unless given,
        # would end it without the names) and record (--verify-collectives)
        hang_s = min(config.cluster.heartbeat_timeout, 0.8 * (config.cluster.timeout or 60.0))
        issuer = CollectiveIssuer(rank, world_size, order=config.cluster.collective_order,
                                  record=config.cluster.verify_collectives, hang_s=hang_s, device=self.device)
        self.executor = Executor(self.compiled, self.optimizer, rank, world_size, groups,
                                 device=self.device, skip_nonfinite=config.optimizer.skip_nonfinite,
                                 memory_budget=engine_memory_budget(config, planner),
                                 cp_sharding=config.planner.cp_sharding, track_memory=config.logging.track_memory,
                                 cluster=Cluster(world_size, config.cluster.gpus_per_node, shard_group=shard_group),
                                 seed=config.model.seed,
                                 vocab_parallel_loss=vocab_parallel, compile_mode=config.model.compile,
                                 compile_backend=config.model.compile_backend, offload=config.planner.offload,
                                 host_budget=config.planner.host_memory_budget,
                                 layer_ms=offload_prices(config, self.model, world_size, planner),
                                 issuer=issuer, verify_collectives=config.cluster.verify_collectives,
                                 push_bucket_bytes=config.cluster.push_bucket_bytes,
                                 pull_bucket_bytes=config.cluster.pull_bucket_bytes,
                                 router_losses=RouterLossConfig(config.model.moe_aux_loss,
                                                                config.model.moe_aux_loss_coef,
                                                                config.model.moe_z_loss_coef),
                                 overlap_push=config.cluster.overlap_push)
        if planner is None:
            self.executor.prepare(schedule)     # bad strategies fail before any step
        # planner-driven: a strategy is built ahead once a delivered plan names it (else on its step, a miss)
        dcp_cost = sp_accumulation_cost(config, schedule, self.model, world_size)
        self.mode: StepMode
        if planner is not None:
            self.mode = PlannerDriven(planner, self.planner_setup, self.executor, config)
        elif dcp_cost is not None:
            self.mode = SpAccumulation(schedule, dcp_cost, self.executor, config)
        else:
            self.mode = FixedSchedule(schedule, self.executor, config)
        if rank == 0:
            for line in self.sharding_warnings(schedule or [Strategy.parse(c) for c in self.mode.candidates()]):
                log.info("hgraph: warning: %s", line)     # on stdout, with the run's other notes

    def sharding_warnings(self, strategies: list) -> list[str]:
        """One line per TP degree of ``strategies`` that leaves much of the blocks' parameters replicated
        (``CompiledModule.sharding_report``)."""
        lines: dict[str, None] = {}
        for strategy in dict.fromkeys(strategies):
            for line in self.compiled.sharding_report(strategy).warnings():
                lines[line] = None
        return list(lines)

    def progress_bar(self, total: int, label: str, *, plain: bool = False) -> ProgressBar:
        """A bar of this rank from the config's factory (``runtime.train.progress``)."""
        return progress_bar(self.config.progress_bars, total, label, rank=self.rank, plain=plain)

    def open_data(self) -> tuple[Corpus, LongReport]:
        """The run's documents (every source of ``--data``, lazily for token stores) after ``--long``."""
        cfg = self.config
        vocab, max_len = model_limits(self.model)
        if cfg.docs is not None:
            docs = [Document(i, tuple(int(t) for t in d)) for i, d in enumerate(cfg.docs)]
            if not docs or any(len(d) == 0 for d in docs):
                raise HGraphError("documents must be non-empty lists of token ids")
            sources, parts = [SourceSpec("documents")], [docs]
        elif cfg.data_sources is not None or cfg.data.data is not None:
            sources, parts = open_corpus(cfg.data_sources or cfg.data.data, vocab)
        else:
            raise HGraphError("no training data: give --data (a token store, JSONL or raw text with "
                              "--tokenizer)")
        limited, reports = [], []
        for part in parts:
            docs, report = limit_long(part, cfg.data.tokens_per_iter, max_len, cfg.data.long)
            limited.append(docs)
            reports.append(report)
        corpus = corpus_of(limited, [s.weight for s in sources], [s.path for s in sources])
        return corpus, merge_reports(reports)

    def eval_documents(self) -> Optional[list[Document]]:
        """``--eval-data``'s first documents, in file order, up to ``--eval-tokens`` (at least one)."""
        cfg = self.config
        if cfg.data.eval_data is None:
            return None
        vocab, max_len = model_limits(self.model)
        budget = cfg.data.eval_tokens or cfg.data.tokens_per_iter
        _, parts = open_corpus(cfg.eval_sources or cfg.data.eval_data, vocab)
        # validation documents only need to fit the model (they are not a step's budget)
        docs, _ = limit_long(parts[0] if len(parts) == 1 else ConcatDocuments(parts), sys.maxsize, max_len,
                             cfg.data.long)
        lengths = doc_lengths(docs)
        count = max(1, int(np.searchsorted(np.cumsum(lengths), budget, side="right")))
        chosen = [docs[i] for i in range(min(count, len(docs)))]
        if sum(len(d) - 1 for d in chosen) < 1:
            raise HGraphError(f"--eval-data {cfg.data.eval_data}: its documents up to --eval-tokens "
                              f"{budget} have no next-token target")
        return chosen

    def evaluate(self, strategy: str) -> float:
        """The validation loss of ``eval_docs`` with the current parameters, under ``strategy`` (the
        step's: its Program, dispatched by the built-in rule; collective)."""
        s = Strategy.parse(strategy)
        mbs = packed(dispatch_and_pack(s, self.eval_docs, self.config.planner.microbatch_tokens))
        return self.executor.evaluate(s, mbs, sum(len(d) - 1 for d in self.eval_docs))

    def step(self, batch: MiniBatch) -> StepResult:
        """One step of ``batch`` in the run's mode, unreported (collective): its result."""
        return self.run_step(batch, lambda result: StepExtras(self.optimizer.lr)).result

    def run_step(self, batch: MiniBatch, extras: StepExtrasOf) -> StepRecord:
        """One step of ``batch`` in the run's mode (collective) and its record, ``extras`` adding what
        the caller knows once the result is (``StepMode.step``); with --verify-collectives rank 0
        notes each new strategy's verdict (a failed one has ended the run)."""
        checked = len(self.executor.order_verdicts)
        record = self.mode.step(batch, extras)
        if self.rank == 0 and self.config.log_steps:
            for step, strategy, line in self.executor.order_verdicts[checked:]:
                log.info("hgraph: collectives of %s (step %d): %s", strategy, step, line)
        return record

    def run(self, exit_signal: Optional[ExitSignal] = None) -> TrainSummary:
        """The training loop; ``exit_signal``: stop with a checkpoint after the step on which every rank
        agrees that one rank got SIGTERM (``hgraph.runtime.train.exit_signal``)."""
        cfg = self.config
        records: list[StepRecord] = []
        start_step = self.resumed.step if self.resumed is not None else 0
        start_position = self.resumed.data_position["next_document"] if self.resumed is not None else 0
        ckpts = cfg.checkpointing
        checkpoints = RunCheckpoints(Path(ckpts.checkpoint_dir) if ckpts.checkpoint_dir else None,
                                     ckpts.checkpoint_every, cfg.data.steps, ckpts.keep_checkpoints,
                                     asynchronous=ckpts.async_checkpoint)
        metrics = MetricsWriter(cfg.logging.metrics if self.rank == 0 else None,
                                start_step if self.resumed is not None else None)
        loggers = (StepLoggers(cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.run_dir, cfg.values())
                   if self.rank == 0 else StepLoggers())
        heartbeat = Heartbeat.for_default_group(timeout_s=cfg.cluster.heartbeat_timeout,
                                                on_unresponsive=self._end_on_silence)
        self.executor.watch(heartbeat)
        now = start_step
        stopped = None
        bar = self.progress_bar(cfg.data.steps, "training") if cfg.log_steps else PrintedLines()
        try:
            stream = run_mini_batches(self.docs, self.world_size, **_stream(cfg), resumed=self.resumed,
                                      order=self.order)
            for batch, delay_state in stream:
                now = batch.step
                lr = self.optimizer.lr = self.schedule.lr_at(batch.step)
                record = self.run_step(batch, self.extras_of(batch, lr, delayed=delay_state is not None))
                records.append(record)
                self._report(record, metrics, bar, loggers)
                result = record.result
                flat = self.loss_watch.observe(batch.step, result.loss, lr) if self.rank == 0 else None
                if flat is not None:
                    log.warning("hgraph train: warning: %s", flat)
                saved = self._checkpoint(checkpoints, batch, delay_state)
                # the last step saves anyway; the same test on every rank keeps the collective matched
                if exit_signal is not None and batch.step + 1 < cfg.data.steps and exit_signal.agreed(self.device):
                    saved = saved or self._checkpoint(checkpoints, batch, delay_state, now=True)
                    stopped = {"signal": exit_signal.name, "step": batch.step + 1, "checkpoint": saved.path}
                    break
            checkpoints.finish()                 # an asynchronous save completes before the run ends
        except RuntimeError as exc:
            # a collective outside the executor's step (checkpoint save, planner broadcast) failed:
            # name the rank that died, as the executor does inside a step
            lost = heartbeat.lost_ranks() if heartbeat is not None and not isinstance(exc, RankLostError) else []
            if lost:
                raise RankLostError(now, lost, self.rank, exc) from exc
            raise
        finally:
            bar.close()
            self.mode.close()
            metrics.close()
            loggers.close()
            self.executor.watch(None)
            if heartbeat is not None:
                heartbeat.stop()
        final = self.final_state_dict() if ckpts.save_final or cfg.return_final else None
        if ckpts.save_final and self.rank == 0:
            Path(ckpts.save_final).parent.mkdir(parents=True, exist_ok=True)
            torch.save(final, ckpts.save_final)
        resumed = None if self.resumed is None else {
            "path": str(self.resumed.path), "step": self.resumed.step,
            "saved_world_size": self.resumed.saved_world_size, "resharded": self.resumed.resharded,
            "next_document": start_position}
        return TrainSummary(records, self.executor.programs.info(), final, [asdict(c) for c in checkpoints.saved],
                            resumed, self.mode.candidates(), self.dropout, asdict(self.long_report),
                            sequence_parallel=self.sequence_parallel, stopped=stopped,
                            shard_group={"size": self.shard_group, "auto": self.shard_group_why,
                                         "world": self.shard_group >= self.world_size})

    def _end_on_silence(self, silent: list[Silent]) -> None:
        """A peer stopped answering (heartbeat thread): this rank's collectives would wait for it until
        their timeout, so the process ends now, naming it; the launcher ends the others."""
        end_process(silent_peers_text(silent, self.rank, self.config.cluster.heartbeat_timeout), blame=silent[0][0])

    def throughput(self, result: StepResult, batch: MiniBatch) -> dict:
        """The step's tokens/s, model TFLOP/s per device and MFU (``runtime.train.throughput``)."""
        flops = self.model_flops.step_flops([len(d) for d in batch.docs])
        return step_throughput(flops, result.tokens, result.time_s, self.world_size, self.peak_tflops)

    def extras_of(self, batch: MiniBatch, lr: float, *, delayed: bool) -> StepExtrasOf:
        """What the loop adds to ``batch``'s record once its result is known: the learning rate, the
        validation loss after every ``eval_every`` steps, the throughput and, when metrics or loggers
        take them, the memory figures (collective, in this order on every rank: evaluation, then one
        all-gather); ``delayed``: the run delays outliers."""
        cfg = self.config
        every = cfg.data.eval_every if self.eval_docs is not None else None
        logged = bool(cfg.logging.tensorboard or cfg.logging.wandb)    # the same on every rank

        def extras(result: StepResult) -> StepExtras:
            eval_loss = self.evaluate(result.strategy) if every and (batch.step + 1) % every == 0 else None
            memory = (memory_figures(result, self.world_size, self.device, cfg.planner.memory_budget,
                                     self.executor.peak_memory.source, tracked=self.executor.track_memory)
                      if cfg.logging.metrics or logged else {})
            return StepExtras(lr, eval_loss, self.throughput(result, batch), memory, outlier_delay=delayed)
        return extras

    def _report(self, record: StepRecord, metrics: MetricsWriter, bar: ProgressBar,
                loggers: Optional[StepLoggers] = None) -> None:
        """The step's metrics line and logged scalars and rank 0's step line (every ``log_every`` steps
        and the last) and progress, all from its record."""
        cfg = self.config
        result, extras, step = record.result, record.extras, record.step
        metrics.write(record)
        if loggers:
            loggers.log(step, step_scalars(result.loss, result.time_s, extras.throughput, extras.memory,
                                           extras.fields()))
        if cfg.log_steps and self.rank == 0:
            due = step % cfg.logging.log_every == 0 or step + 1 == cfg.data.steps
            if due or extras.eval_loss is not None:
                bar.write(format_step_line(result, record.plan or None, extras.fields(),
                                           extras.throughput["mfu"]))
            bar.update(1, f"step {step}")

    def _checkpoint(self, checkpoints: RunCheckpoints, batch: MiniBatch, delay_state: Optional[dict], *,
                    now: bool = False) -> Optional[SavedCheckpoint]:
        """The checkpoint after ``batch`` when one is due or asked for ``now`` (collective); rank 0 says
        so with the step lines. Returns what was saved (None: nothing)."""
        done = batch.step + 1
        if not (now or checkpoints.due(done)):
            return None
        cfg = self.config
        pos = data_position(done, batch.next_position, self.docs, cfg.data.tokens_per_iter, self.fingerprint,
                            self.order)
        saved = checkpoints.save(done, self.optimizer, rank=self.rank, world_size=self.world_size,
                                 data_position=pos, delay_queues=delay_state,
                                 planner_state=self.mode.checkpoint_state(),
                                 run=run_state(cfg, self.world_size, self.model))
        if cfg.log_steps and self.rank == 0:
            if checkpoints.asynchronous:
                log.info("checkpoint %s staged in %.0f ms, written in the background", saved.path, 1e3 * saved.save_s)
            else:
                log.info("checkpoint %s (%.2f MB) saved in %.0f ms", saved.path, saved.bytes / 1e6, 1e3 * saved.save_s)
        return saved

    def final_state_dict(self) -> dict:
        """The parameters gathered to full tensors (collective; every rank gets them), cast to the
        module's dtype, with its buffers, keyed like the original module's ``state_dict`` (tied
        aliases included)."""
        params = self.optimizer.full_state_dict()
        model = self.compiled.original
        canonical: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical.setdefault(id(p), name)
        out = {}
        for key, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter):
                out[key] = params[canonical[id(value)]].to(value.dtype).cpu()
            else:
                out[key] = value.detach().cpu().clone()
        return out
