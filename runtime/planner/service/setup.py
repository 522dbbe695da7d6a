"""Wiring of the planner into a training run: the planner process's owner side (``planner_process``)
and the ranks' side (``start_planner``: cost model, candidates, and rank 0's job for the planner
process). See ``hgraph.runtime.planner.service.plan_ahead`` for the process and its channel."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from hgraph.runtime.checkpoint.run import resumed_planner
from hgraph.runtime.data.outlier_delay import run_mini_batches
from hgraph.runtime.engine.compiled_regions import compile_wanted
from hgraph.runtime.planner.cost.calibration import calibration_phases
from hgraph.runtime.planner.cost.runtime_memory import max_len_table
from hgraph.runtime.planner.service.iteration import IterationPlanner, model_cost_model
from hgraph.runtime.planner.service.plan_ahead import PlanConsumer, PlannerProcess


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


def start_planner(trainer: Any, groups: Any, channel: Any) -> Any:
    """The trainer's ``IterationPlanner`` (collective on every rank); on rank 0 with a ``channel``,
    the planner process gets the run's mini-batches to plan ahead."""
    cfg, rank = trainer.config, trainer.rank
    plan = cfg.planner
    counts = trainer.compiled.hgraph.slot_counts()
    kept = resumed_planner(trainer.resumed, cfg, rank, trainer.world_size)
    phases = int(kept is None and plan.strategies.strip() == "auto")
    if plan.profile == "measure" and kept is None:
        try:
            phases += calibration_phases(model_cost_model("measure", trainer.model, trainer.world_size,
                                                          cfg.cluster.gpus_per_node), trainer.world_size)
        except Exception:   # noqa: BLE001 - the bar's length only; create() reports the real error
            pass
    bar = trainer.progress_bar(phases, "planner setup", plain=cfg.log_steps and rank == 0)
    t0 = time.perf_counter()
    try:
        planner = kept if kept is not None else IterationPlanner.create(
            plan.strategies, plan.profile, trainer.model, trainer.docs, cfg.data.tokens_per_iter, rank,
            trainer.world_size, cfg.cluster.gpus_per_node, groups=groups,
            tp_slots=counts.get("tp_enter", 0) + counts.get("tp_exit", 0),
            progress=lambda what: bar.update(1, what), device_memory=cfg.cluster.device_memory,
            working_bytes=2 if cfg.model.dtype == "bf16" else 4, max_candidates=plan.max_candidates,
            compiled=trainer.compiled, device=trainer.device,     # measure times the run's device and dtype
            dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32,
            compiled_step=compile_wanted(cfg.model.compile, trainer.device))
    finally:
        bar.close()
    planner.method, planner.time_limit_s = plan.method, plan.time_limit
    # the planner's micro-batch times include the recomputation the budget forces (set before the
    # planner process gets its copy of the cost model)
    planner.cost.activation_budget_bytes = plan.memory_budget
    if rank == 0 and cfg.log_steps:
        c = planner.cost
        print(f"planner: {len(planner.candidates)} candidates ({planner.source}): "
              f"{', '.join(map(str, planner.candidates))}; cost model {c.name}; "
              f"set up in {time.perf_counter() - t0:.1f} s"
              + (f"; device memory {planner.device_memory / 2 ** 20:.1f} MiB per rank, MaxLen "
                 f"{max_len_table(c)}" if planner.device_memory is not None else "")
              + (f"; plans {plan.plan_ahead} steps ahead in process {channel.pid}" if channel is not None
                 else "; plans inline"), flush=True)
    if rank == 0 and plan.profile == "measure" and cfg.logging.metrics:
        # kept with the run: what the planner believed, and ``--profile FILE`` skips the measuring next time
        path = Path(cfg.logging.metrics).parent / "profile.json"
        path.write_text(json.dumps(planner.cost.to_profile_dict(), indent=1) + "\n", encoding="utf-8")
    if channel is not None and rank == 0:
        # a resumed run plans only the steps it has left
        start = trainer.resumed
        planner.plan_ahead(PlanConsumer(channel), [b for b, _ in run_mini_batches(
            trainer.docs, cfg, trainer.world_size, start, trainer.order.copy())])
    return planner
