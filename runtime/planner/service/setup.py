"""Wiring of the planner into a training run: the planner process's owner side (``planner_process``)
and the ranks' side (``start_planner`` from a ``PlannerSetup``: cost model, candidates, and rank 0's
job for the planner process), and what a checkpoint keeps of the planner (``planner_state``) to give
a resumed run the same planner back (``resumed_planner``). See
``hgraph.runtime.planner.service.plan_ahead`` for the process and its channel."""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence, Union

import torch
import torch.nn as nn

from hgraph.compiled import CompiledModule
from hgraph.runtime.checkpoint.shards import Checkpoint
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.documents import Document, MiniBatch
from hgraph.runtime.process.run_log import run_log
from hgraph.runtime.planner.cost.calibration import calibration_phases
from hgraph.runtime.engine.offload import rank_host_budget
from hgraph.runtime.planner.schedule.offload import host_link_bytes_per_s
from hgraph.runtime.planner.cost.cost_model import (cost_model_from_entry, with_activation_budget, with_offload,
                                                    with_push)
from hgraph.runtime.planner.cost.runtime_memory import bytes_text, max_len_table
from hgraph.runtime.planner.service.iteration import (IterationPlanner, measured_ulysses_degrees, model_cost_model,
                                                      parse_candidates)
from hgraph.runtime.planner.service.plan_ahead import PlanConsumer, PlannerChannel, PlannerProcess

log = run_log(__name__)


@contextlib.contextmanager
def planner_process(config: Any, owner: bool, context: Any = None) -> Iterator[Optional[Any]]:
    """The channel of a planner process started here for the run (None: inline planning, i.e.
    deterministic mode, ``plan_ahead`` 0 or not the owner); the process is stopped on exit.
    ``context``: the multiprocessing context to start it from (``PlannerProcess``)."""
    if not owner or not config.planner_driven or config.planner.plan_ahead < 1:
        yield None
        return
    with PlannerProcess(config.planner.plan_ahead, context) as proc:
        yield proc.channel


@dataclass(frozen=True)
class PlannerSetup:
    """What a run's planner is built from: the planner settings of the run's configuration and the
    figures of the run and its model. Built once by the trainer; nothing is attached afterwards."""

    strategies: str = "auto"                   # the candidates: "auto" (proposed) or "S1;S2"
    profile: str = "measure"                   # the cost model: measure | analytic | NAME | FILE
    max_candidates: Optional[int] = None       # most candidates of "auto"
    method: str = "fast"                       # dispatch method: fast | greedy | cpsat
    time_limit_s: float = 10.0                 # seconds per CP-SAT solve
    memory_budget: Optional[float] = None      # activation bytes per rank: the recomputation it forces is priced
    offload: str = "off"                       # activation offload (off | on | auto): priced with the recomputation
    host_memory_budget: Optional[float] = None  # its host bytes per rank (None: half the RAM over the node's ranks)
    plan_ahead: int = 2                        # steps planned ahead in the planner process (0: inline)
    tokens_per_iter: int = 8192
    gpus_per_node: int = 8
    device_memory: Union[int, float, str, None] = "auto"   # bytes per rank bounding MaxLen, "auto" or None
    working_bytes: int = 4                     # bytes of a working parameter (2 in bf16)
    tp_slots: int = 0                          # the model's TP enter/exit slots (a measured profile times them)
    log: bool = False                          # this rank prints the planner's line
    profile_path: Optional[Path] = None        # where a measured profile is kept with the run (None: not kept)
    device: Optional[torch.device] = None      # where and in what a measured profile times the model:
    dtype: Optional[torch.dtype] = None        # the run's device and working dtype
    compiled_step: bool = False                # the run compiles its graphs (what they keep bounds MaxLen)
    shard_group: Optional[int] = None          # the optimizer states sharded over groups of G ranks (--shard-group)
    push_bucket_bytes: int = DEFAULT_BUCKET_BYTES  # the push as the run issues it (--push-bucket-bytes,
    overlap_push: bool = True                  # --no-overlap-push): how a push model prices it


class Progress(Protocol):
    """A progress bar (``hgraph.runtime.train.progress``): ``update`` steps it, ``close`` ends it."""

    def update(self, n: int = 1, note: str = "") -> None: ...

    def close(self) -> None: ...


def start_planner(setup: PlannerSetup, *, rank: int, world_size: int, model: nn.Module, compiled: CompiledModule,
                  docs: Sequence[Document], groups: Optional[GroupCache] = None,
                  channel: Optional[PlannerChannel] = None, resumed: Optional[Checkpoint] = None,
                  progress_bar: Callable[[int, str], Progress], run_batches: Callable[[], Iterable[MiniBatch]]
                  ) -> IterationPlanner:
    """The run's ``IterationPlanner`` (collective on every rank): the one a checkpoint kept
    (``resumed``, ``resumed_planner``) or a new one for ``docs``. On rank 0 with a ``channel``, the
    planner process gets the mini-batches the run has left (``run_batches()``) to plan ahead.
    ``progress_bar(total, label)`` shows the setup's phases."""
    kept = resumed_planner(resumed, setup, rank, world_size)
    phases = int(kept is None and setup.strategies.strip() == "auto")
    if setup.profile == "measure" and kept is None:
        try:
            prior = model_cost_model("measure", model, world_size, setup.gpus_per_node)
            phases += calibration_phases(prior, world_size,
                                         measured_ulysses_degrees(prior, world_size, setup.device, None))
        except Exception:   # noqa: BLE001 - the bar's length only; create() reports the real error
            pass
    bar = progress_bar(phases, "planner setup")
    t0 = time.perf_counter()
    try:
        planner = kept if kept is not None else IterationPlanner.create(
            setup.strategies, setup.profile, model, docs, setup.tokens_per_iter, rank,
            world_size, setup.gpus_per_node, groups=groups, tp_slots=setup.tp_slots,
            progress=lambda what: bar.update(1, what), device_memory=setup.device_memory,
            working_bytes=setup.working_bytes, max_candidates=setup.max_candidates,
            compiled=compiled, method=setup.method, time_limit_s=setup.time_limit_s,
            activation_budget_bytes=setup.memory_budget, device=setup.device, dtype=setup.dtype,
            compiled_step=setup.compiled_step, shard_group=setup.shard_group)
    finally:
        bar.close()
    planner.cost = with_push(planner.cost, setup.push_bucket_bytes, setup.overlap_push)
    if setup.offload != "off":
        host = rank_host_budget(setup.host_memory_budget, setup.gpus_per_node, world_size)
        planner.cost = with_offload(planner.cost, setup.offload, host)
    if rank == 0 and setup.log:
        c = planner.cost
        log.info(f"planner: {len(planner.candidates)} candidates ({planner.source}): "
              f"{', '.join(map(str, planner.candidates))}; cost model {c.name}; "
              f"set up in {time.perf_counter() - t0:.1f} s"
              + (f"; device memory {bytes_text(planner.device_memory)} per rank, MaxLen "
                 f"{max_len_table(c)}" if planner.device_memory is not None else "")
              + (f"; offload {setup.offload}, host budget {c.host_budget_bytes / 2 ** 30:.1f} GiB per rank, "
                 f"host link {host_link_bytes_per_s(c) / 1e9:.1f} GB/s" if setup.offload != "off" else "")
              + (f"; plans {setup.plan_ahead} steps ahead in process {channel.pid}" if channel is not None
                 else "; plans inline"))
    if rank == 0 and setup.profile == "measure" and setup.profile_path is not None:
        # kept with the run: what the planner believed, and ``--profile FILE`` skips the measuring next time
        setup.profile_path.write_text(json.dumps(planner.cost.to_profile_dict(), indent=1) + "\n", encoding="utf-8")
    if channel is not None and rank == 0:
        planner.plan_ahead(PlanConsumer(channel), run_batches())   # a resumed run: the steps it has left
    return planner


def resumed_planner(loaded: Optional[Checkpoint], setup: PlannerSetup, rank: int,
                    world_size: int) -> Optional[IterationPlanner]:
    """The resumed run's planner: the checkpoint's candidates and cost model (no new proposal, no new
    measurement, so it plans as the interrupted run would have), when they were made for this world
    size, the same ``--strategies``, profile and ``--max-candidates``; else None (a fresh planner).
    Its dispatch settings and activation budget are this run's (``setup``)."""
    state = loaded.planner_state if loaded is not None else {}
    if (state.get("mode") != "planner" or state.get("world_size") != world_size
            or state.get("strategies") != setup.strategies or state.get("profile") != setup.profile
            or state.get("max_candidates") != setup.max_candidates
            or not isinstance(state.get("cost_profile"), dict) or len(state["cost_profile"]) != 1):
        return None
    (name, entry), = state["cost_profile"].items()
    cost = cost_model_from_entry(name, entry, world_size=world_size, gpus_per_node=setup.gpus_per_node)
    return IterationPlanner(with_activation_budget(cost, setup.memory_budget),
                            parse_candidates(";".join(state["candidates"]), world_size), rank,
                            source=state.get("source", "checkpoint"), method=setup.method,
                            time_limit_s=setup.time_limit_s)


def planner_state(setup: Optional[PlannerSetup], planner: Optional[IterationPlanner], schedule: Sequence[Any],
                  world_size: int) -> dict:
    """What a resume needs of the strategy choice: the schedule (no planner), or the planner's
    candidates and the ``setup`` they were made for."""
    if planner is None or setup is None:
        return {"mode": "schedule", "schedule": [str(s) for s in schedule]}
    return {"mode": "planner", "strategies": setup.strategies, "profile": setup.profile,
            "max_candidates": setup.max_candidates,
            "world_size": world_size, "candidates": [str(c) for c in planner.candidates],
            "source": planner.source, "method": planner.method, "cost_profile": planner.cost.to_profile_dict()}
