"""Automatic restart: an attempt that a launcher restarted continues the run from its newest checkpoint.

``torchrun --max-restarts N`` starts every worker again when one fails (a rank killed, a node lost);
a requeued SLURM job starts again with ``SLURM_RESTART_COUNT`` > 0. Such an attempt knows it is a
restart (``LauncherEnv.is_restart``), so with ``--checkpoint-dir`` it resumes by itself, no
``--resume`` needed: from the newest complete checkpoint (a save cut by the failure has no manifest
and is skipped; a damaged newest one falls back to the previous, with a warning), at the saved data
position, so every document is trained exactly once and the losses are those of an uninterrupted
run. Without a complete checkpoint yet it starts again from step 0, the same run from the start;
when the checkpoints already hold every step (it failed after the last one), it ends at once.

A restarted run with the default run folder continues in the folder the checkpoint's run used
(``run_state`` records it), so its ``metrics.jsonl`` keeps the steps before the checkpoint and
rewrites the rest, and the plots cover the whole run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hgraph.runtime.checkpoint.manifest import complete_steps, latest
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launcher_env import LauncherEnv


def restart_config(config: TrainConfig, env: Optional[LauncherEnv]) -> tuple[TrainConfig, Optional[str]]:
    """``config`` set to resume when this attempt is a launcher's restart and a complete checkpoint
    exists, and the line that says what the restart does (None: not a restart)."""
    ckpts = config.checkpointing
    if env is None or not env.is_restart:
        return config, None
    what = env.restart_text()
    if ckpts.checkpoint_dir is None:
        return config, f"{what}: no --checkpoint-dir, the run starts again from step 0"
    if ckpts.resume:
        return config, None                    # resumes as asked, and so after every restart
    if latest(ckpts.checkpoint_dir) is None:
        return config, (f"{what}: no complete checkpoint in {ckpts.checkpoint_dir} yet, the run starts "
                        "again from step 0")
    return config.with_values(resume=True, resume_fallback=True), f"{what}: resuming by itself"


def finished_before_restart(config: TrainConfig, env: Optional[LauncherEnv]) -> Optional[str]:
    """The line to end a restarted attempt with when the run's checkpoints already hold all its steps
    (it failed after its last checkpoint, e.g. writing plots): there is nothing left to train, and
    starting over or failing would only spend the launcher's restarts. None otherwise."""
    ckpts = config.checkpointing
    if env is None or not env.is_restart or ckpts.checkpoint_dir is None:
        return None
    steps = complete_steps(ckpts.checkpoint_dir)
    if not steps or steps[-1] < config.data.steps:
        return None
    return (f"{env.restart_text()}: the checkpoint of step {steps[-1]} in {ckpts.checkpoint_dir} "
            f"already holds all {config.data.steps} steps; nothing left to train (hgraph export makes "
            "the final weights)")


def restart_run_dir(point: Any, env: Optional[LauncherEnv]) -> Optional[Path]:
    """The run folder a restarted attempt continues in (the one its checkpoint's run wrote), or None."""
    if point is None or env is None or not env.is_restart:
        return None
    folder = point.run.get("run_dir")
    return Path(folder) if folder else None
