"""One training step of a strategy's Program on this rank (Hydraulis §5, Fig. 2b).

``Executor.step(strategy, microbatches, num_targets)`` finds the strategy's Program and this rank's
state for it (building them on first use), then:

The step runs inside the ``SyncStep`` its ``ParamSync`` opens (``with sync.step(...) as s:``), which
owns the order of the pull's and push's phases (``runtime/comm/param_sync``):

1. **Pull Parameter**: entering the ``SyncStep`` posts every LNK pull of the step (async); each
   graph's ``pull_wait`` node waits for its parameter.
2. **1F1B** over this rank's pipeline's micro-batches: ``warmup = min(PP - stage - 1, m)``
   forwards, then one forward / one backward alternately, then the remaining backwards. Pipelines
   may have different numbers of micro-batches of different packed lengths; the received
   activations' shapes follow from the micro-batch's token count (the plan), so no shape messages.
   The last stage backpropagates ``stage_loss_sum / num_targets`` (``docs/architecture.md``, loss:
   the mini-batch's number of targets), so the gradient never depends on the strategy or the packing; it is made
   from the output head's inputs chunk by chunk, never from the whole logits (``engine/loss``). In a CP
   pipeline each CP rank runs its share of every micro-batch's tokens (per-document or
   per-sequence sharding, ``cp_layout_for``), with the positions and next-token targets of the
   whole documents.
3. **Push Gradient**: the reduce-scatters among replicas start during the last backward, bucket by
   bucket as gradients become final (``SyncStep.backward_starts``), on every backend, in the buckets' one
   global order; ``SyncStep.finish`` waits for them and LNKs the working gradients to the optimizer
   owners (a pipeline without micro-batches pushes zeros). ``StepResult.push_ms`` times the push from
   its first reduction's issue, ``push_exposed_ms`` the part of it after the backward ended.
4. The loss is summed over the world (one all-reduce issued before the push and waited after it, the
   MoE router losses' values with it; a
   non-finite loss raises naming the step, or skips the update when ``skip_nonfinite``), then the
   sharded optimizer steps.

Every collective of a step goes through the rank's ``CollectiveIssuer`` (``runtime/comm/order/issue``,
labelled with the micro-batch and direction it runs in): under ``--collective-order strict`` each
completes before the next is issued; with ``verify_collectives`` a Program's first step ends with the
check of every rank's recorded sequence (``order/verify``: ``RunFailed`` naming the first difference or
the deadlock); a collective that times out raises ``RunFailed`` saying where each rank's sequence
stopped.

Plain data parallelism (every parameter all-gathered, every gradient one reduce-scatter over all
ranks; any backend) runs 3-4 as an **overlapped update** instead (``ParamSync.can_overlap_update``,
not with global-norm clipping): the loss rides in the first reduction, each reduction updates its
shards as soon as it is taken (one behind the newest during backward), and the next step's all-gathers are
posted as their parameters are updated and completed before the step returns (``prefetch``), so the
next step of the same Program pulls nothing. A ZeRO-3 step needs two collectives in sequence where
DDP needs one; this keeps it at two (the loss costs none) and does the rest on the way. On gloo both
are all-to-alls: one exchange with each peer, where DDP's ring all-reduce takes ``2(N - 1)`` steps in
sequence (``grad_buckets``, ``param_gather``).

The executor owns its ``ProgramCache`` (``hgraph.runtime.engine.program_cache``): per strategy the
Program and this rank's ``RankState`` for it (the rank's graph with its working tensors, the
``ParamSync``, then the process groups). When the step mode knows the next steps' strategies it
calls ``build_ahead``: a strategy not built yet is built on a background thread while this rank runs
the steps before it, and its state prepared there (host work only: no collective, no working
memory); its first step looks it up and creates its process groups (``_ready_state``). Otherwise the
Program is built on the strategy's first step. Switching back to a strategy seen before costs a dict
lookup, and no optimizer state moves (its layout does not depend on the strategy); the step's result
says whether the Program was a hit (``StepResult.cache_hit``), how long the lookup took
(``switch_s``) and, on a Program's first step, its build (``build_s``, ``built_ahead``).
Only one Program's working parameters and gradients hold memory at a time: a switch frees the
storage of the last Program's (``ParamSync.release_working``) before it allocates the next one's
(``acquire_working``), and a state prepared ahead holds none, so a rank's peak does not grow with the
number of strategies a run has used or builds ahead.

With global-batch MoE load balancing (``engine/router_losses``) a counting pass runs before 2: the
rank's micro-batches forward without grad (``_forward_only``, which ``evaluate`` runs too), then one
all-reduce of the routing counts over the world.

The step's parts live in their own modules: ``rank_state`` (what a rank keeps per Program, its working
graph), ``sequence_inputs`` (a micro-batch's tokens, targets and keys at the rank's sequence place),
``pipeline_run`` (the 1F1B loop), ``step_result`` and ``step_failure`` (a lost rank, a timeout).
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from hgraph.compiled import CompiledModule
from hgraph.errors import HGraphError, RunFailed
from hgraph.program import GroupRound, Program, RankProgram
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.order.verify import check_recorded
from hgraph.runtime.comm.param_sync import ParamSync
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.compiled_regions import (RegionCompiles, check_backend, compile_regions,
                                                    compile_wanted)
from hgraph.runtime.engine.memory import ActivationMeter, OffloadPolicy, bind_stage_group, stage_memory
from hgraph.runtime.engine.offload import (DEFAULT_HOST_LINK_BYTES_PER_S, OFFLOAD_MODES, HostOffload,
                                           rank_host_budget)
from hgraph.runtime.engine.peak_memory import PeakMemory
from hgraph.runtime.engine.program_cache import CachedProgram, ProgramCache
from hgraph.runtime.engine.pipeline_run import run_one_f_one_b
from hgraph.runtime.engine.router_losses import RouterLossConfig, moe_ops_of
from hgraph.runtime.engine.router_losses import router_losses as make_router_losses
from hgraph.runtime.engine.rank_state import RankState, ShardedOptimizer, working_graph
from hgraph.runtime.engine.sequence_inputs import ADAPTIVE, CP_SHARDINGS, MicroBatchFeed
from hgraph.runtime.engine.step_failure import RankLostError, RankWatch, step_failure  # noqa: F401 (re-exported)
from hgraph.runtime.engine.step_result import ProgramLookup, StepResult
from hgraph.strategy import Cluster, Scheme, Strategy


class Executor:
    """Runs steps of Programs of one compiled model on this rank with a sharded optimizer.

    ``optimizer``: a ``ShardedAdam`` over the full model's parameters with shard dims from the
    HGraph (``shard_dims_of``); ``groups``: the rank's ``GroupCache``; ``cluster``: where the
    strategies' Programs are laid out (default: ``Cluster(world_size)``).
    ``programs``: the executor's ``ProgramCache`` (read its counts; only the executor looks up).
    ``watch(heartbeat)``: name the lost ranks when a step's collective fails (``RankLostError``).
    """

    def __init__(self, compiled: CompiledModule, optimizer: ShardedOptimizer, rank: int, world_size: int,
                 groups: GroupCache,
                 device: Optional[torch.device] = None, skip_nonfinite: bool = False,
                 memory_budget: Union[float, Callable[[Scheme], Optional[float]], None] = None,
                 track_memory: bool = False,
                 cp_sharding: str = ADAPTIVE, cluster: Optional[Cluster] = None, seed: int = 0,
                 vocab_parallel_loss: Optional[bool] = None, compile_mode: str = "off",
                 compile_backend: str = "inductor", offload: str = "off",
                 host_budget: Optional[float] = None,
                 layer_ms: Optional[Callable[[Scheme, tuple[int, int]], float]] = None,
                 host_link_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S,
                 issuer: Optional[CollectiveIssuer] = None, verify_collectives: bool = False,
                 push_bucket_bytes: int = DEFAULT_BUCKET_BYTES, pull_bucket_bytes: Optional[int] = None,
                 overlap_push: bool = True, router_losses: Optional[RouterLossConfig] = None) -> None:
        self.compiled = compiled
        # the MoE router losses every Program's context adds (None: the run adds none)
        self.router_losses = make_router_losses(router_losses)
        # per rank graph: its MoE ops' rows in the model's count matrix (the global-batch form)
        self._moe_ops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the bucket sizes and the backward's reductions of every Program's ParamSync (comm/param_sync)
        self.push_bucket_bytes, self.pull_bucket_bytes = push_bucket_bytes, pull_bucket_bytes
        self.overlap_push = overlap_push
        self.optimizer = optimizer
        self.rank, self.world_size = rank, world_size
        # the rank's one choke point for its steps' collectives (order, record), handed to every part
        # that issues one; ``verify_collectives``: a Program's first step checks every rank's record
        self.issuer = issuer or CollectiveIssuer(rank, world_size, device=device)
        self.verify_collectives = verify_collectives
        if verify_collectives:
            self.issuer.start_recording()
        if hasattr(optimizer, "issue_through"):
            optimizer.issue_through(self.issuer)
        self.order_verdicts: list[tuple[int, str, str]] = []   # (step, strategy, line) per check
        self.groups = groups
        self.device = torch.device(device or "cpu")
        self.skip_nonfinite = skip_nonfinite
        # DCP-intra: with a budget (bytes of activations per rank, or per scheme: the planner's relief
        # budget, ``CostModel.relief_budget``) blocks are recomputed or offloaded per micro-batch
        self.memory_budget = memory_budget
        # activation offload (engine/offload): on | auto (priced per layer by ``layer_ms``: a scheme and a
        # micro-batch's features -> one layer's forward+backward ms) | off; ``host_budget``: host bytes
        # per rank (None: half the host's RAM over its ranks)
        if offload not in OFFLOAD_MODES:
            raise HGraphError(f"offload {offload!r}: expected one of {', '.join(OFFLOAD_MODES)}")
        self.offload, self.layer_ms, self.host_link_bytes_per_s = offload, layer_ms, host_link_bytes_per_s
        self.host_budget = host_budget
        self.track_memory = track_memory or memory_budget is not None or offload != "off"
        if cp_sharding not in CP_SHARDINGS:
            raise HGraphError(f"CP sharding {cp_sharding!r}: expected one of {', '.join(CP_SHARDINGS)}")
        self.cp_sharding = cp_sharding
        self.working_dtype = compiled.options.working_dtype or torch.float32
        # a TP-split vocabulary's loss: Megatron's vocabulary-parallel one (no logits gathered), or each
        # chunk's logits gathered for torch's log_softmax, the single-device arithmetic to the bit. By
        # default fp32 (the equivalence signature) gathers: vocabulary-parallel rounds the softmax's
        # normaliser differently by an ulp, which Adam scales up on gradients that cancel to ~eps
        self.vocab_parallel_loss = (self.working_dtype != torch.float32 if vocab_parallel_loss is None
                                    else vocab_parallel_loss)
        # torch.compile of the rank graphs' compute between their communication ops (compiled_regions)
        self.compile = compile_wanted(compile_mode, self.device)
        self.compile_strict = compile_mode == "on"
        self.compile_backend = compile_backend
        if self.compile:
            check_backend(compile_backend)
        self.region_compiles = RegionCompiles()
        self.programs: ProgramCache[RankState] = ProgramCache(
            compiled, cluster if cluster is not None else Cluster(world_size))
        self._last_program: Optional[Program] = None
        self.seed = seed           # the run's seed: dropout masks are keyed by it (``kernels/dropout``)
        self._step_index = 0
        self._active: Optional[RankState] = None    # the state whose working tensors hold memory
        self._heartbeat: Optional[RankWatch] = None     # names lost ranks on failure (``watch``)
        self.peak_memory = PeakMemory(self.device)   # every step's measured peak (StepResult.process_peak_bytes)

    def watch(self, heartbeat: Optional[RankWatch]) -> None:
        """Name the ranks ``heartbeat`` lost when a step's collective fails (None: stop naming them)."""
        self._heartbeat = heartbeat

    # ---- Programs and this rank's state for each (kept in the program cache) --------------------------
    def prepare(self, strategies: Sequence[Strategy]) -> None:
        """Build the Programs of ``strategies`` now (misses) and create their process groups
        (collective: every rank calls it with the same strategies), so a strategy that cannot be built
        fails before any step, and no first step of one creates groups."""
        programs = [self.programs.find(strategy)[0].program for strategy in dict.fromkeys(strategies)]
        self.groups.create([rnd for program in programs for rnd in program_rounds(program, self.rank)])

    def build_ahead(self, strategies: Sequence[Union[Strategy, str]]) -> None:
        """The strategies of the next steps, in order: those without a Program are built on the
        build-ahead thread, with this rank's state prepared (host work: no collective, no working
        memory), while this rank runs its steps; the first step of each only looks it up and creates
        its process groups. A strategy whose build fails raises at that step, as an inline build would."""
        for strategy in strategies:
            self.programs.build_ahead(_strategy(strategy), self._prepare_state)

    def close(self) -> None:
        """The run is over: builds not started are dropped."""
        self.programs.close()

    def program(self, strategy: Union[Strategy, str]) -> Program:
        """The Program of ``strategy`` (built if new; not counted as a hit or a miss)."""
        return self.programs.find(_strategy(strategy), count=False)[0].program

    def rank_state(self, strategy: Union[Strategy, str, Program]) -> RankState:
        """This rank's state for ``strategy``'s Program (or a given Program), built on first use
        (collectively: every rank calls it); no hit or miss counted."""
        return self._state_of(self._entry(strategy, count=False)[0])

    def _entry(self, strategy: Union[Strategy, str, Program], count: bool = True
               ) -> tuple[CachedProgram[RankState], Optional[bool]]:
        """The cache entry of a strategy (and whether it hit), or of a Program given (hit: None)."""
        if isinstance(strategy, Program):
            return self.programs.adopt(strategy), None
        return self.programs.find(_strategy(strategy), count=count)

    def _state_of(self, entry: CachedProgram[RankState]) -> RankState:
        """The entry's rank state, built on the Program's first use, or readied there if it was
        prepared ahead (collectively: every rank calls it for the same Program)."""
        if entry.state is None:      # not prepared ahead: its preparation counts in its build
            t0, c0 = time.perf_counter(), time.thread_time()
            state = self._prepare_state(entry.program)
            entry.prepared(state, time.perf_counter() - t0, time.thread_time() - c0)
        if not entry.state.ready:
            self._ready_state(entry.state)
        return entry.state

    def _prepare_state(self, program: Program) -> RankState:
        """This rank's state for ``program``, host work only (the build-ahead thread runs it): its copy
        of the rank's graph with working parameters that hold no memory yet (``_activate`` allocates
        them), the ``ParamSync`` over them, the activation accounting. No collective: the process
        groups are created by ``_ready_state``."""
        if program.cluster.world_size != self.world_size:
            raise HGraphError(f"strategy {program.strategy} is planned for {program.cluster.world_size} ranks "
                              f"but this run has {self.world_size}")
        rp = program.rank(self.rank)
        gm, working, aliased = working_graph(rp, self.optimizer.params, self.world_size, self.working_dtype,
                                             self.device)
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # plain data parallelism: the shards are updated as their gradients arrive (``_overlaps_update``)
        update = self.optimizer.step if self.optimizer.updates_in_parts else None
        sync = ParamSync(program, self.rank, self.optimizer.params, working, rp.params, self.groups,
                         self.working_dtype, aliased, update=update, issuer=self.issuer,
                         push_bucket_bytes=self.push_bucket_bytes, pull_bucket_bytes=self.pull_bucket_bytes,
                         overlap_push=self.overlap_push)
        # the working tensors hold no memory until the Program runs (``_activate``): a Program prepared
        # ahead costs none. They had storage only while the views above were taken (a strided view of
        # an empty storage is refused): on CPU pages never touched, which never became resident; on a
        # GPU the caching allocator lends the bytes for that moment (not measured yet)
        sync.release_working()
        graph, memory = gm, None
        if self.track_memory:
            budget = self.memory_budget(rp.scheme) if callable(self.memory_budget) else self.memory_budget
            graph, memory = stage_memory(gm, working, program, rp, budget, self.device,
                                         self._offload_policy(program, rp), self.issuer)
        comm = CommContext(self.rank, self.world_size, self.groups, device=self.device, comm_stream=stream,
                           bindings=dict(rp.bindings), param_sync=sync,
                           head_inputs=True,    # a last stage's loss is made from its head's inputs (engine/loss)
                           vocab_parallel_loss=self.vocab_parallel_loss, issuer=self.issuer,
                           router_losses=self.router_losses)
        return RankState(program, rp, graph, working, comm, sync, memory)

    def _ready_state(self, state: RankState) -> None:
        """The main thread's part of a state before its first step: the process groups its Program
        needs (collective: every rank creates its own part of the same rounds) and, with ``--compile``,
        its compiled regions."""
        program = state.program
        self.groups.create(program_rounds(program, self.rank))
        if state.memory is not None:
            bind_stage_group(state.memory, program, state.rank_program, self.groups)
        if self.compile:      # after recompute's outlining: its blocks' regions are compiled inside them
            state.graph, _ = compile_regions(state.graph, self.compile_backend, self.compile_strict,
                                             self.region_compiles)
        state.ready = True

    def _offload_policy(self, program: Program, rp: RankProgram
                        ) -> Optional[Callable[[ActivationMeter], OffloadPolicy]]:
        """What makes this rank's ``OffloadPolicy`` for ``program`` over its meter (None: off)."""
        if self.offload == "off":
            return None
        budget = rank_host_budget(self.host_budget, program.cluster.gpus_per_node, self.world_size)
        layer_ms = self.layer_ms
        prices = (lambda f: layer_ms(rp.scheme, f)) if layer_ms is not None else None
        return lambda meter: OffloadPolicy(self.offload, HostOffload(self.device, meter, budget), prices,
                                           self.host_link_bytes_per_s)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self, strategy: Union[Strategy, str, Program], microbatches: Sequence[Sequence[MicroBatch]],
             num_targets: int, step: int = 0, prefetch: Optional[bool] = None) -> StepResult:
        """One training step of ``strategy``'s Program (found or built here; a Program built elsewhere
        may be given instead): ``microbatches[i]`` are pipeline ``i``'s packed rows (may be empty).
        The result says whether the Program was a hit (``cache_hit``) and how long finding it took.

        Every rank must call it with the same arguments (collective). A collective that fails
        because a rank died raises ``RankLostError`` naming it (when a heartbeat is ``watch``ed).
        ``prefetch``: a plain data-parallel step also pulls the next step's parameters, which pays
        off when the next step runs the same Program (``None``: when the last step ran this one too,
        a repeat being the best guess; give the answer when the caller knows it).
        """
        t0 = time.perf_counter()
        entry, hit = self._entry(strategy)
        found = time.perf_counter()
        switch_s = found - t0
        first_use = entry.state is None or not entry.state.ready
        try:
            state = self._state_of(entry)
            # what finding the Program took, known now that its state is built (its build counted in)
            lookup = ProgramLookup(hit, switch_s)
            if first_use and entry.build is not None:
                lookup = ProgramLookup(hit, switch_s, entry.ahead, entry.build.build_s,
                                       t0 - entry.build.started_at if entry.ahead else None)
            result = self._step(entry.program, state, lookup, microbatches, num_targets, step, prefetch, found)
        except RuntimeError as exc:
            failure = step_failure(exc, step, self.rank, self._heartbeat, self.issuer)
            if failure is not None:
                raise failure from exc
            raise
        if first_use and self.verify_collectives:
            self._verify_order(step, entry.program)
        return result

    def _activate(self, state: RankState) -> None:
        """Make ``state`` the one whose working tensors hold memory."""
        if self._active is not state:
            if self._active is not None:
                self._active.sync.release_working()
            state.sync.acquire_working()
            self._active = state

    def _overlaps_update(self, state: RankState) -> bool:
        """Whether this step updates the shards as their reductions arrive: a plain data-parallel
        Program without global-norm clipping (which needs every gradient before any update)."""
        return state.sync.can_overlap_update and self.optimizer.max_grad_norm is None

    def _step(self, program: Program, state: RankState, lookup: ProgramLookup,
              microbatches: Sequence[Sequence[MicroBatch]], num_targets: int, step: int,
              prefetch: Optional[bool], t0: float) -> StepResult:
        """The step under ``state`` (readied by ``step``); ``t0``: when its Program was found (the
        state's first readying counts in the step's time, the lookup does not)."""
        if len(microbatches) != len(program.strategy.pipelines):
            raise HGraphError(f"step {step}: {len(microbatches)} micro-batch lists for the "
                              f"{len(program.strategy.pipelines)} pipelines of {program.strategy}")
        if num_targets < 1:
            raise HGraphError(f"step {step}: the mini-batch has no targets; the loss is undefined")
        self._activate(state)
        self._step_index = step
        self.issuer.begin_step(step)
        rp, sync = state.rank_program, state.sync
        for w in state.working.values():
            w.grad = None
        if self.router_losses is not None:
            self.router_losses.begin_step()
        overlap = self._overlaps_update(state)
        if prefetch is None:
            prefetch = self._last_program is program
        self._last_program = program
        with sync.step(overlap_update=overlap, prefetch=prefetch) as sync_step:
            if state.memory is not None:
                state.memory.begin_step()
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
            t_pull = time.perf_counter()
            feed = self._feed(state)
            mine = [feed.own(mb) for mb in microbatches[rp.pipeline]]     # its EP rank's documents
            if self.router_losses is not None and self.router_losses.global_batch:
                self._count_routing(state, mine, num_targets)
            loss_sum = run_one_f_one_b(state, mine, num_targets, feed, self.issuer,
                                       lambda loss_sum: sync_step.backward_starts(self._loss_share(rp, loss_sum),
                                                                                  self._router_shares()))
            t_backward = time.perf_counter()
            state.comm.wait_all()
            sync_step.complete_pulls()
            t_compute = time.perf_counter()
            grads = {name: w.grad for name, w in state.working.items()}
            outcome = sync_step.finish(grads, lambda: self._issue_global_loss(rp, loss_sum, self._router_shares()),
                                       self._router_shares())
        t_push = time.perf_counter()
        total_loss, grad_shards = outcome.loss_sum, outcome.grad_shards
        # no reduction issued (one rank, point-to-point only): the push began after the compute
        push_start = sync_step.push_started_s if sync_step.push_started_s is not None else t_compute
        wall = time.time() - time.perf_counter()     # the host times as moments other ranks can compare
        loss = total_loss / num_targets
        tokens = sum(mb.tokens for mbs in microbatches for mb in mbs)
        skipped = False
        norm = None
        if not math.isfinite(loss):
            if not self.skip_nonfinite:
                raise RunFailed(f"step {step}: the loss is {loss} (not finite) with strategy {program.strategy}; "
                                "lower the learning rate, check the data, or ask to skip such steps")
            skipped = True
        elif grad_shards is not None:
            total = self.optimizer.step(grad_shards)
            norm = float(total) if total is not None else None
        moe_losses = self._router_values(outcome.extra)
        t_end = time.perf_counter()
        memory = {}
        if state.memory is not None:
            peak, predicted, recompute = state.memory.end_step()
            offload = state.memory.offload
            memory = dict(predicted_mem_bytes=predicted, recompute_layers=recompute,
                          offload_layers=list(state.memory.step_offload),
                          host_peak_bytes=offload.host.peak_bytes if offload is not None else None,
                          peak_mem_bytes=(int(torch.cuda.max_memory_allocated(self.device))
                                          if self.device.type == "cuda" else peak))
        return StepResult(step, str(program.strategy), loss, tokens, t_end - t0, t_pull - t0,
                          t_compute - t_pull, t_push - t_compute, t_end - t_push, skipped, norm,
                          sync_step.bytes_moved(), overlapped_update=overlap,
                          pull_prefetched=sync_step.pull_prefetched,
                          push_ms=1e3 * (t_push - push_start),
                          push_exposed_ms=1e3 * (t_push - max(push_start, t_backward)),
                          push_times=tuple(wall + t for t in (push_start, t_backward, t_push)),
                          process_peak_bytes=self.peak_memory.read(),
                          compiles=self.region_compiles.total if self.compile else None,
                          cache_hit=lookup.cache_hit, switch_s=lookup.switch_s, built_ahead=lookup.built_ahead,
                          build_s=lookup.build_s, build_lead_s=lookup.build_lead_s, **moe_losses, **memory)

    def _router_shares(self) -> tuple[float, ...]:
        """This rank's shares of the step's MoE router losses, summed over the world with the loss (in its
        all-reduce, or riding with it in the overlapped update's first reduction): no collective of
        their own. Empty when the run adds none."""
        return self.router_losses.values() if self.router_losses is not None else ()

    def _router_values(self, summed: Sequence[float]) -> dict:
        """The step's MoE router losses (``moe_aux_loss``, ``moe_z_loss``: each over the MoE layers, per
        target, before its coefficient) from their world sums; nothing when the run adds none."""
        if self.router_losses is None:
            return {}
        cfg = self.router_losses.config
        return dict(moe_aux_loss=summed[0] if cfg.aux_loss != "none" and cfg.aux_coef else None,
                    moe_z_loss=summed[1] if cfg.z_coef else None)

    def _count_routing(self, state: RankState, mine: Sequence[MicroBatch], num_targets: int) -> None:
        """The global-batch load balancing's counting pass (``engine/router_losses``): this rank's
        micro-batches forward, no grad, as the step will run them (inputs, dropout keys; a block that
        recomputes runs plainly without grad), each MoE op counting its routing; then one all-reduce of
        the ``[MoE ops, E]`` counts over the world, which the step's forwards read."""
        rp = state.rank_program
        ops = self._moe_ops.get(rp.graph_module)
        if ops is None:
            ops = self._moe_ops[rp.graph_module] = moe_ops_of(self.compiled.hgraph.gm, rp.graph_module)
        losses = self.router_losses
        with losses.counting(ops, rp.tp_rank, rp.replica, self.device) as counts, torch.no_grad():
            self._forward_only(state, mine, num_targets=num_targets, scope="count")
        if self.world_size > 1:
            self.issuer.run("all_reduce", None, counts, lambda: dist.all_reduce(counts, async_op=True),
                            "moe counts global")
        losses.use_global_counts(counts)

    def _forward_only(self, state: RankState, mbs: Sequence[MicroBatch], *, evaluating: bool = False,
                      num_targets: int = 0, scope: Optional[str] = None) -> float:
        """This rank's graph over ``mbs`` (its own documents: ``MicroBatchFeed.own``) forward only (the
        caller turns grad off), its sends waited for; with ``evaluating`` (dropout off) the last stage's loss
        sum, else 0. ``scope``: the label of the micro-batches' collectives (``mb i <scope>``)."""
        rp, comm = state.rank_program, state.comm
        last, feed = rp.stage == rp.scheme.pp - 1, self._feed(state)
        loss_sum = 0.0
        for i, mb in enumerate(mbs):
            ids, pos, targets, layout, keys = feed.inputs(mb)
            mb_comm = comm.for_microbatch(cp_layout=layout, token_keys=keys, evaluating=evaluating,
                                          documents=feed.documents(mb, layout), num_targets=num_targets)
            with self.issuer.scope(f"mb {i} {scope}") if scope else contextlib.nullcontext():
                out = state.graph(feed.to_device(ids), feed.to_device(pos), mb_comm)
                if last and evaluating:
                    loss_sum += float(feed.loss_sum(out, ids, targets, mb, mb_comm))
            del out
        comm.wait_all()
        return loss_sum

    def _feed(self, state: RankState) -> MicroBatchFeed:
        """What makes this rank's inputs of a micro-batch of this step (``sequence_inputs``)."""
        rp = state.rank_program
        return MicroBatchFeed(rp.scheme, rp.cp_rank, self.cp_sharding, self.seed, self._step_index, self.device,
                              rp.doc_rank)

    @torch.no_grad()
    def evaluate(self, strategy: Union[Strategy, str, Program], microbatches: Sequence[Sequence[MicroBatch]],
                 num_targets: int) -> float:
        """The loss of ``microbatches`` (per pipeline, as ``step`` takes them) under ``strategy``'s
        Program with the current parameters, forward only: the same loss as a step's (summed
        next-token cross-entropy over ``num_targets``), dropout off, nothing updated, no hit counted.
        Collective: every rank calls it."""
        if num_targets < 1:
            raise HGraphError("evaluation: the documents have no targets; the loss is undefined")
        state = self.rank_state(strategy)
        self._activate(state)
        rp = state.rank_program
        mine = list(map(self._feed(state).own, microbatches[rp.pipeline]))     # its EP rank's documents
        with state.sync.step():         # the pulls only: nothing is pushed
            loss_sum = self._forward_only(state, mine, evaluating=True)
        value, work = self._issue_global_loss(rp, loss_sum)
        if work is not None:
            work.wait()
        return float(value[0]) / num_targets

    @staticmethod
    def _loss_share(rp: RankProgram, loss_sum: float) -> float:
        """What this rank adds to the mini-batch's loss sum: one copy per pipeline (its last stage's
        first TP rank and replica; every CP rank holds part of the loss): ``RankProgram.counts_loss``."""
        return loss_sum if rp.counts_loss else 0.0

    def _issue_global_loss(self, rp: RankProgram, loss_sum: float, extra: Sequence[float] = ()
                           ) -> tuple[torch.Tensor, Optional[dist.Work]]:
        """Start summing the mini-batch's loss (then ``extra`` values: the router losses) over the world;
        returns the buffer and the work to wait for (None on one rank)."""
        # a fill, not a copy from the host: nothing waits for the GPU's backward here
        value = torch.full((1 + len(extra),), self._loss_share(rp, loss_sum), dtype=torch.float64, device=self.device)
        if extra:
            value[1:] = torch.tensor(extra, dtype=torch.float64)
        work = (self.issuer.issue("all_reduce", None, value, lambda: dist.all_reduce(value, async_op=True), "loss")
                if self.world_size > 1 else None)
        return value, work

    def _verify_order(self, step: int, program: Program) -> None:
        """``--verify-collectives``: check the sequences every rank recorded in this Program's first step
        (collective); a mismatch or a possible deadlock ends the run naming the ranks and the first
        differing operation."""
        ok, line = check_recorded(self.issuer.sequence, self.rank, self.world_size)
        self.order_verdicts.append((step, str(program.strategy), line))
        if not ok:
            raise RunFailed(f"step {step}: --verify-collectives with strategy {program.strategy}: {line}")


def program_rounds(program: Program, rank: int) -> list[GroupRound]:
    """The process groups ``rank`` talks in under ``program``, as creation rounds (``GroupCache.create``:
    the same keys on every rank, each rank its own part): its TP, CP and Ulysses groups, the replica
    groups of its reduce-scatters and, under ``--shard-group``, its shard group and replicas. From its
    own coordinates and the layout per role: no other rank's program is built, no world list made."""
    return program.binding_rounds(rank) + ParamSync.groups_needed(program, rank)


def _strategy(strategy: Union[Strategy, str]) -> Strategy:
    return strategy if isinstance(strategy, Strategy) else Strategy.parse(strategy)


def shard_dims_of(compiled: CompiledModule) -> dict[str, int]:
    """The optimizer's shard dimension of every parameter (the HGraph's, 0 for a 0-d parameter)."""
    return {name: (info.shard_dim if tuple(info.shape) else 0) or 0
            for name, info in compiled.hgraph.params.items()}
