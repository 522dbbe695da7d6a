"""One rank's part of a run (``train_worker``) and the run of a config on its ranks (``run_training``):
the local processes it spawns, or this process as one rank under a launcher.

A rank's result is a plain dict (it crosses a pipe when the rank was spawned): its step rows, cache
figures and what the run reports; rank 0 adds the trained parameters when the config asks for them
(``return_final``): in memory when the rank is this process, through shared memory when it was
spawned (``runtime/train/shared_state.py``), never pickled through the pipe.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from hgraph.errors import HGraphError, RunFailed
from hgraph.runtime.checkpoint.run import find_resume_point
from hgraph.runtime.planner.service.setup import planner_process
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.data_setup import ready_data
from hgraph.runtime.train.devices import backend_for
from hgraph.runtime.train.exit_signal import ExitSignal, saves_on_sigterm
from hgraph.runtime.train.launch import init_from_env, local_backend, process_context, spawn
from hgraph.runtime.train.launcher_env import default_timeout, read_launcher_env
from hgraph.runtime.train.model_setup import record_model
from hgraph.runtime.train.shared_state import SharedState
from hgraph.runtime.train.trainer import Trainer


def train_worker(rank: int, world_size: int, config: TrainConfig, planner_channel: Any = None,
                 spawned: bool = False) -> dict:
    """Spawn target: run ``config`` on this rank; returns steps and cache figures and, on rank 0 with
    ``return_final``, the trained parameters (``spawned``: as a ``SharedState`` for the spawning
    process to take, else the state dict itself).

    Bad input (HGraphError) is returned as ``{"error": message}``: it happens at the same point on
    every rank (before any collective, or after the loss all-reduce), so no rank is left waiting.
    """
    # installed first: a SIGTERM while the rank sets up is noted, not fatal
    exit_signal = ExitSignal.install() if saves_on_sigterm(config) else None
    try:
        summary = Trainer(config, rank, world_size,
                          planner_channel=planner_channel if rank == 0 else None).run(exit_signal)
    except HGraphError as exc:
        return {"error": str(exc), "failed": isinstance(exc, RunFailed)}
    finally:
        if exit_signal is not None:
            exit_signal.close()
    final = summary.final_params if rank == 0 and config.return_final else None
    if final is not None and spawned:
        final = SharedState.publish(final)
    return {"rank": rank, "steps": [r.row() for r in summary.records], "cache": summary.cache,
            "planned": summary.planned, "final_params": final,
            "checkpoints": summary.checkpoints, "resumed_from": summary.resumed_from,
            "candidates": summary.candidates, "dropout": summary.dropout,
            "sequence_parallel": summary.sequence_parallel,
            "long_documents": summary.long_documents, "step_extra": summary.step_extra,
            "stopped": summary.stopped, "shard_group": summary.shard_group}


def run_training(config: TrainConfig, *, timeout_s: Optional[float] = None) -> dict:
    """Run ``config`` and return rank 0's ``train_worker`` result (bad input: HGraphError); under a
    launcher this process's own result (its ``"rank"`` says which).

    Under a launcher (``torchrun``, a SLURM step: ``hgraph.runtime.train.launcher_env``) this process is
    one rank of the run; otherwise ``config.cluster.world_size`` local processes are spawned.
    ``timeout_s`` (default ``config.cluster.timeout``, else 60 s local, 600 s launched) bounds each
    collective, so a lost rank is reported within it; a spawned run also names a rank whose process died.
    Raw text sources are tokenized once, before any process starts (the command line does it into its
    run folder; here into a temporary one).
    """
    ckpts, cluster = config.checkpointing, config.cluster
    env = read_launcher_env()
    if timeout_s is None:
        timeout_s = cluster.timeout if cluster.timeout is not None else default_timeout(env)
    if ckpts.resume and config.resume_from is None and ckpts.checkpoint_dir is not None:
        # resolved once, before any process starts: every rank loads the same checkpoint
        point = find_resume_point(ckpts.checkpoint_dir, fallback=ckpts.resume_fallback)
        config = config.with_values(resume_from=str(point.folder))
    with contextlib.ExitStack() as stack:
        data = config.data
        if config.data_sources is None and (data.data is not None or data.eval_data is not None):
            cache = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hgraph-data-")))
            config = ready_data(config, record_model(config).model, cache)
        return _launch(config, env, timeout_s)


def _launch(config: TrainConfig, env: Any, timeout_s: float) -> dict:
    cluster = config.cluster
    if env is not None:
        backend = None if cluster.backend == "auto" else cluster.backend
        ours = not dist.is_initialized()        # a group the caller made stays the caller's
        rank, world = init_from_env(backend, timeout_s=timeout_s, env=env)
        with planner_process(config, rank == 0) as channel:      # rank 0's process owns the planner
            results = [train_worker(rank, world, config, channel)]
        if ours and "error" not in results[0]:
            # the groups' backend threads end now, not in the interpreter's teardown, where a torchrun
            # worker was seen to abort ("terminate called without an active exception"); after a
            # failure they are left to the process's exit (a destroy could wait on a lost peer)
            dist.destroy_process_group()
    else:
        total = 120.0 + timeout_s * (config.data.steps + 1)
        # the launcher owns the planner, forked by the ranks' forkserver
        with planner_process(config, True, process_context()) as channel:
            backend = (local_backend(cluster.backend, cluster.world_size) if cluster.device == "auto"
                       else backend_for(cluster.device, cluster.backend, cluster.world_size))
            results = spawn(train_worker, cluster.world_size, backend=backend,
                            args=(config, channel, True), timeout_s=total,
                            forward_sigterm=saves_on_sigterm(config))
    result = results[0]
    if isinstance(result.get("final_params"), SharedState):      # taken (and its block freed) in any case
        result["final_params"] = result["final_params"].take()
    error = next((r for r in results if "error" in r), None)
    if error is not None:       # bad input (exit 2) or a run that failed (exit 1), said once
        raise (RunFailed if error.get("failed") else HGraphError)(error["error"])
    return result
