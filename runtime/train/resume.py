"""The run's side of a resume: which checkpoint this run continues from, checked against the run's
configuration, and what a checkpoint records of the run that wrote it.

``hgraph.runtime.checkpoint.run`` finds, stores and checks checkpoints without knowing the run's
configuration; this module reads the ``TrainConfig`` for it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import foreign
from hgraph.runtime.checkpoint import shards as ckpt
from hgraph.runtime.checkpoint.run import NO_DELAY_QUEUES, check_resume, data_position, find_resume_point
from hgraph.runtime.data.documents import Document
from hgraph.runtime.data.outlier_delay import run_mini_batches
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.lr_schedule import schedule_of


def load_resume(config: TrainConfig, rank: int, world_size: int, fingerprint: str, docs: Sequence[Document] = (),
                order: Any = None, shard_group: Any = None) -> Any:
    """This rank's part of the checkpoint to resume (``checkpoint.Checkpoint``; resharded when the
    world size changed), or None for a fresh run; checks that it fits the run (``check_resume``).
    ``docs`` and ``order`` (the run's documents and ``DataOrder``) place a foreign DCP checkpoint in
    the data (``foreign_resume``); ``shard_group``: the run's optimizer shards over groups of that many
    ranks (None: the world), read from any layout the checkpoint was written at."""
    ckpts = config.checkpointing
    if not ckpts.resume:
        return None
    if ckpts.checkpoint_dir is None:
        raise HGraphError("--resume needs --checkpoint-dir DIR")
    folder = config.resume_from or find_resume_point(ckpts.checkpoint_dir, fallback=ckpts.resume_fallback).folder
    if foreign.is_foreign(Path(folder)):
        loaded = foreign_resume(Path(folder), config, world_size, fingerprint, docs, order)
    else:
        loaded = ckpt.load(folder, rank, world_size, shard_group=shard_group)
    check_resume(loaded.step, loaded.path, loaded.run, loaded.data_position, model=config.model.model,
                 model_args=dict(config.model.model_args), fingerprint=fingerprint, total_steps=config.data.steps)
    return loaded


def foreign_resume(folder: Path, config: TrainConfig, world_size: int, fingerprint: str,
                   docs: Sequence[Document], order: Any) -> ckpt.Checkpoint:
    """The resume point of a DCP checkpoint another program wrote (``hgraph.runtime.checkpoint.foreign``):
    its step is the largest Adam step count, and the data goes on after this run's first ``step``
    mini-batches, formed again here (with outlier delay, the queues as they stand after them)."""
    manifest = foreign.resume_manifest(folder)
    step, steps = manifest["step"], config.data.steps
    if step >= steps:
        raise HGraphError(f"--resume: {str(folder)!r} is at step {step} (its Adam step count) and --steps is "
                          f"{steps}: nothing left to train (--steps is the run's total)")
    next_document, queues = 0, None
    if step > 0:
        for batch, delay_state in run_mini_batches(docs, world_size, tokens_per_iter=config.data.tokens_per_iter,
                                                   steps=config.data.steps,
                                                   outlier_queues=config.planner.outlier_queues, order=order.copy()):
            if batch.step == step - 1:
                next_document, queues = batch.next_position, delay_state
                break
    position = data_position(step, next_document, docs, config.data.tokens_per_iter, fingerprint, order)
    return ckpt.Checkpoint(path=folder, step=step, saved_world_size=manifest["world_size"], optimizer=None,
                           data_position=position, delay_queues=queues or NO_DELAY_QUEUES,
                           resharded=manifest["world_size"] != world_size,
                           foreign=foreign.ForeignCheckpoint(folder))


def run_state(config: TrainConfig, world_size: int, module: Any = None) -> dict:
    """What produced the checkpoint (checked on resume; ``hgraph export`` rebuilds the model from it)
    and the run folder it wrote (a launcher's restart continues in it, ``hgraph.runtime.train.restart``).

    A Hugging Face ``module`` (one with ``config.to_json_string``) also records its config as JSON
    (``hf_config``), so the export of an ``hf:DIR`` run does not need DIR any more."""
    model = config.model
    state = {"model": model.model, "model_args": dict(model.model_args), "seed": model.seed, "dtype": model.dtype,
             "optimizer": config.optimizer.optimizer, "world_size": world_size, "steps": config.data.steps,
             "init_from": model.init_from, "run_dir": config.logging.run_dir,
             "lr_schedule": schedule_of(config).state()}
    to_json = getattr(getattr(module, "config", None), "to_json_string", None)
    if callable(to_json):
        state["hf_config"] = json.loads(to_json(use_diff=False))
    return state
