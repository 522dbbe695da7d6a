"""One run object under every front door: ``prepare(config) -> PreparedRun``, ``PreparedRun.execute()
-> RunSummary``.

``hgraph train`` (``tools/cli/train.py``), ``hgraph.train()`` (``hgraph/training.py``) and a rank under
torchrun or SLURM (the same two, run by the launcher on every rank) resolve their options into a
``TrainConfig`` (``runtime/train/run_config.py``) and hand it here; what they add is only theirs:
the flags and the lines a person reads, or the keyword arguments and the ``TrainResult``.

``prepare`` does, before any rank starts, what a run needs besides its options: the hold on its
folders (one run per folder, ``run_folders``), the end of a restarted attempt whose run had finished,
the checkpoint a resume continues from (checked against the run), the weights checked against the
model, the run folder (default ``runs/<UTC timestamp>``; a restart continues in its checkpoint's) and
its metrics file and ``run.json``, raw data tokenized into it, the built-in documents kept there as a
token store, and the ``auto`` learning-rate recipe of the built-in run. ``execute`` runs the ranks
(``rank_run.run_training``: spawned, or this process under a launcher) and returns this process's
``RunSummary``; a run that fails raises ``RunFailed`` with its one line (``errors_named`` adds the rank
and host under a launcher), bad input ``HGraphError``.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch

from hgraph.errors import HGraphError, RunFailed
from hgraph.frontends.zoo import ZOO_CONFIGS
from hgraph.runtime.checkpoint.run import ResumePoint, find_resume_point
from hgraph.runtime.checkpoint.manifest import latest
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.outlier_delay import check_resume_queues
from hgraph.runtime.data.token_store import write_documents
from hgraph.runtime.process.lifetime import end_process
from hgraph.runtime.process.writable import probe_writable
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.data_setup import ready_data
from hgraph.runtime.train.devices import backend_for, describe
from hgraph.runtime.train.launch import SpawnError
from hgraph.runtime.train.launcher_env import LauncherEnv, default_timeout, read_launcher_env
from hgraph.runtime.train.lr_schedule import builtin_default
from hgraph.runtime.train.model_setup import check_weights, record_model
from hgraph.runtime.train.progress import ProgressFactory
from hgraph.runtime.train.rank_run import run_training
from hgraph.runtime.train.restart import finished_before_restart, restart_config, restart_run_dir
from hgraph.runtime.train.run_folders import Refused, RunFolders
from hgraph.runtime.train.run_record import write_run_record

BUILTIN_SEED = 0        # the built-in documents' seed (the same for a run and the run it resumes)


@dataclass(frozen=True)
class RunSummary:
    """What one process of a run keeps: its global ``rank``, per step its row (``StepRecord.row``), the
    planner's figures (``planned``) and the extras (``step_extra``), the program cache's figures, what
    the run reports (dropout, sequence parallelism, ``--long``, the optimizer's shard group, the
    checkpoints saved, the one resumed from, the planner's candidates), ``stopped`` (a SIGTERM with a
    checkpoint: signal, step, checkpoint), the run folder and metrics file, and on rank 0 of a run that
    asked for them (``return_final``) the trained parameters keyed like the model's ``state_dict``.
    ``finished``: a restarted attempt whose run had already finished (nothing ran; the line says so)."""

    rank: int = 0
    steps: tuple = ()
    planned: tuple = ()
    step_extra: tuple = ()
    cache: Mapping[str, Any] = field(default_factory=dict)
    checkpoints: tuple = ()
    resumed_from: Optional[Mapping[str, Any]] = None
    candidates: tuple = ()
    dropout: str = "none"
    sequence_parallel: str = "on"
    long_documents: Mapping[str, Any] = field(default_factory=dict)
    shard_group: Mapping[str, Any] = field(default_factory=dict)
    stopped: Optional[Mapping[str, Any]] = None
    run_dir: Optional[str] = None
    metrics: Optional[str] = None
    final_state: Optional[Mapping[str, torch.Tensor]] = None
    finished: Optional[str] = None

    @classmethod
    def of(cls, result: Mapping[str, Any], run_dir: Optional[str], metrics: Optional[str]) -> "RunSummary":
        """From a rank's result (``rank_run.train_worker``)."""
        return cls(rank=int(result.get("rank", 0)), steps=tuple(result["steps"]),
                   planned=tuple(result.get("planned", ())), step_extra=tuple(result.get("step_extra", ())),
                   cache=result["cache"], checkpoints=tuple(result.get("checkpoints", ())),
                   resumed_from=result.get("resumed_from"), candidates=tuple(result.get("candidates", ())),
                   dropout=result.get("dropout", "none"), sequence_parallel=result.get("sequence_parallel", "on"),
                   long_documents=result.get("long_documents", {}), shard_group=result.get("shard_group", {}),
                   stopped=result.get("stopped"), run_dir=run_dir, metrics=metrics,
                   final_state=result.get("final_params"))

    def check_trained(self) -> None:
        """A run whose every step was skipped (non-finite loss) trained nothing: ``RunFailed``."""
        if self.steps and all(s["skipped"] for s in self.steps):
            raise RunFailed(f"every one of the {len(self.steps)} steps was skipped (non-finite loss): nothing was "
                            "trained; check the initial weights and the data, or lower the learning rate")


@dataclass(frozen=True)
class PreparedRun:
    """A run ready to start: its final ``config`` (run folder, data, resume point resolved), the
    launcher's environment (None: local processes), and the hold on its folders, released when
    ``execute`` ends (or by ``close``; a ``with`` block does it too)."""

    config: TrainConfig
    env: Optional[LauncherEnv]
    run_dir: Optional[str]
    metrics: Optional[str]
    held: contextlib.ExitStack
    finished: Optional[str] = None      # a restarted attempt of a finished run: nothing to execute

    @property
    def speaker(self) -> bool:
        """Whether this process says the run's lines and writes its folder (global rank 0)."""
        return self.env is None or self.env.rank == 0

    def execute(self) -> RunSummary:
        """Run the ranks (once: the hold on the folders ends with it); this process's summary. Ctrl-C
        (``KeyboardInterrupt``) and SIGTERM without a checkpoint folder (``launch.Stopped``) end every
        process of the run and propagate."""
        with self.held:
            if self.finished is not None:
                return RunSummary(rank=0 if self.env is None else self.env.rank, run_dir=self.run_dir,
                                  metrics=self.metrics, finished=self.finished)
            config = self.config
            if config.log_steps and config.planner_driven and self.speaker:
                say_header(config, self.env)
            try:
                result = run_training(config, timeout_s=config.cluster.timeout)
            except SpawnError as exc:
                raise RunFailed(f"{str(exc).splitlines()[0]}{resume_hint(config)}") from None
            return RunSummary.of(result, self.run_dir, self.metrics)

    def close(self) -> None:
        """Release the run's folders without running it."""
        self.held.close()

    def __enter__(self) -> "PreparedRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prepare(config: TrainConfig, *, progress_bars: Optional[ProgressFactory] = None,
            env: Union[LauncherEnv, None, str] = "read") -> PreparedRun:
    """``config`` (resolved: ``run_config.config_from_options``) made ready to run on this machine (see
    the module's docstring); ``progress_bars``: rank 0's bars (None: plain lines); ``env``: the
    launcher's environment (default: this process's). Bad input: HGraphError, before any rank starts."""
    env = read_launcher_env() if env == "read" else env
    held = contextlib.ExitStack()
    try:
        return _prepare(config, env, progress_bars, held)
    except BaseException:
        held.close()
        raise


def _prepare(config: TrainConfig, env: Optional[LauncherEnv], progress_bars: Optional[ProgressFactory],
             held: contextlib.ExitStack) -> PreparedRun:
    log = config.logging
    # one run per folder: taken before anything reads a checkpoint or writes into a folder
    folders = held.enter_context(_held_folders(config, env))
    ckpt_dir = config.checkpointing.checkpoint_dir
    if config.checkpointing.resume and ckpt_dir is not None and not Path(ckpt_dir).is_dir():
        ckpt_dir = None                # not made here: the resume says that it does not exist
    folders.hold([("checkpoint folder", ckpt_dir), ("run folder", log.run_dir)], "start")
    speaker = env is None or env.rank == 0       # global rank 0 prints and writes the run folder
    out = sys.stderr if log.json else sys.stdout    # stdout stays one JSON object with --json
    finished = finished_before_restart(config, env)
    if finished is not None:
        if speaker:
            print(f"hgraph train: {finished}", file=out, flush=True)
        return PreparedRun(config, env, None, None, held, finished=finished)
    config, restart_note = restart_config(config, env)
    if restart_note is not None and speaker:
        print(f"hgraph train: {restart_note}", file=out, flush=True)
    point = resume_point(config, quiet=log.json, speaker=speaker)
    if config.model.init_from is not None or is_hf_dir(config.model.model):
        check_weights(config)             # bad weights: one line, before any process starts
    run_dir, metrics = None, log.metrics
    if config.planner_driven or log.run_dir is not None:
        if log.run_dir is not None:
            run_dir = Path(log.run_dir)
        else:       # a restart continues in its checkpoint's run folder
            run_dir = restart_run_dir(point, env) or default_run_dir()
            folders.hold([("run folder", run_dir)], "run folder")
    probe_folders(config, run_dir, env)      # an unwritable folder: one line now, not at the first save
    if run_dir is not None:
        if speaker:
            run_dir.mkdir(parents=True, exist_ok=True)
        if metrics is None:       # every rank knows that there are metrics (their figures are collective)
            metrics = str(run_dir / "metrics.jsonl")
    config, docs = _ready_data(config, run_dir, env, point)
    # rank 0 prints each step's line as it finishes (flushed), in every mode: a failed or stopped
    # run's log keeps the steps it did; with --json stdout is the one object at the end
    config = config.with_values(
        metrics=metrics, docs=docs, run_dir=str(run_dir) if run_dir is not None else None,
        resume_from=str(point.folder) if point is not None else None,
        log_steps=not log.json, progress_bars=progress_bars)
    if run_dir is not None and speaker:
        write_run_record(run_dir, config)
    return PreparedRun(config, env, str(run_dir) if run_dir is not None else None, metrics, held)


def _ready_data(config: TrainConfig, run_dir: Optional[Path], env: Optional[LauncherEnv],
                point: Optional[ResumePoint]) -> tuple[TrainConfig, Optional[list]]:
    """The run's data made ready before the launch, and the built-in documents if they stay in memory."""
    log, data = config.logging, config.data
    docs = None
    # data files are written into the run folder by a local run; under a launcher every rank runs this,
    # so each prepares its own in a temporary folder (run_training) instead of racing here
    data_dir = run_dir / "data" if run_dir is not None and env is None else None
    if data.data is not None:
        # raw text tokenized into the run folder, stores verified, vocabulary and --long checked: one
        # line before the launch (without a run folder, run_training does it in a temporary one)
        if data_dir is not None:
            config = ready_data(config, record_model(config).model, data_dir,
                                say=None if log.json else (lambda line: print(line, flush=True)))
        return config, None
    # a resumed run regenerates the same built-in documents as the run it continues
    saved_n = point.data_position.get("num_documents") if point is not None else None
    docs = builtin_documents(config.model.model, config.model.model_args, data.steps, data.tokens_per_iter,
                             data.builtin_docs or saved_n, data.builtin_scale)
    if data_dir is not None:
        # kept as a token store in the run folder: every rank maps it instead of holding the tokens
        prefix = data_dir / f"builtin-{len(docs)}"
        vocab = record_model(config).model.config.vocab_size
        config = config.with_values(data_sources=str(write_documents(prefix, docs, vocab).prefix))
        docs = None
    if config.optimizer.lr_schedule == "auto":      # the built-in default run's recipe
        opt = config.optimizer
        config = config.with_values(**builtin_default(opt.lr, data.steps, opt.warmup_steps, opt.min_lr))
    if data.eval_data is not None and data_dir is not None:
        config = ready_data(config, record_model(config).model, data_dir)
    return config, docs


@contextlib.contextmanager
def errors_named(env: Optional[LauncherEnv]) -> Iterator[None]:
    """Under a launcher, every rank's error names its global rank and host: bad input stays an
    ``HGraphError`` (exit 2), anything else becomes a ``RunFailed`` line (exit 1), so the launcher
    may restart it. A refused folder (``run_folders.Refused``) passes: every rank said it already."""
    if env is None:
        yield
        return
    try:
        yield
    except Refused:
        raise
    except HGraphError as exc:      # the same kind: bad input exits 2, a failed run 1
        raise (RunFailed if isinstance(exc, RunFailed) else HGraphError)(f"{env.where()}: {exc}") from None
    except Exception as exc:     # noqa: BLE001 - a failed collective, a lost peer: one line, not a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RunFailed(f"{env.where()}: {type(exc).__name__}: {first}") from None


def say_header(config: TrainConfig, env: Optional[LauncherEnv]) -> None:
    """The run's first line: model, ranks, data, steps, strategies, profile."""
    c, data = config.cluster, config.data
    where = (describe(c.device, c.world_size, backend_for(c.device, c.backend, c.world_size))
             if env is None else f"{c.world_size} processes")
    print(f"hgraph train: {config.model.model} on {where}, {data.data or 'built-in long-tail documents'}, "
          f"{data.steps} steps of {data.tokens_per_iter} tokens, strategies {config.planner.strategies}, "
          f"profile {config.planner.profile}", flush=True)


def builtin_documents(model: str, model_args: dict, steps: int, tokens_per_iter: int,
                      num_docs: Optional[int] = None, scale: Optional[float] = None) -> list[list[int]]:
    """The built-in long-tail documents for ``model`` (its vocabulary and context length): ``num_docs``
    of them, by default enough for ``steps`` mini-batches without wrapping around (the scaled lengths
    average ~62 tokens); ``scale``: the length scale (default the generator's)."""
    # the model on the meta device: only its config is read (a pretrained hf:DIR is never allocated here)
    cfg = getattr(record_model(TrainConfig.from_values(model=model, model_args=model_args)).model, "config", None)
    vocab, max_len = getattr(cfg, "vocab_size", None), getattr(cfg, "max_seq_len", None)
    if not vocab or not max_len:
        raise HGraphError(f"--model {model}: the built-in data needs a zoo model with vocab_size and "
                          "max_seq_len; give --data FILE.jsonl")
    num_docs = num_docs or max(64, math.ceil(steps * tokens_per_iter / 24))
    extra = {} if scale is None else {"scale": scale}
    return synthetic_documents(num_docs, int(vocab), min(int(max_len), tokens_per_iter), BUILTIN_SEED, **extra)


def default_run_dir() -> Path:
    """``runs/<UTC timestamp>`` (with a suffix if a run of the same second exists)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _held_folders(config: TrainConfig, env: Optional[LauncherEnv]) -> RunFolders:
    """The run's hold on its folders (``runtime.train.run_folders``): a holder silent for the heartbeat
    timeout is gone; a launched rank waits for rank 0's verdict as long as for its peers."""
    cluster = config.cluster
    timeout = cluster.timeout if cluster.timeout is not None else default_timeout(env)

    def line(kind: str) -> Callable[[str], None]:
        return lambda text: print(f"hgraph train: {kind}{text}", file=sys.stderr, flush=True)
    return RunFolders(env, cluster.heartbeat_timeout, timeout, say=line("error: "), warn=line("warning: "),
                      on_lost=end_process)


def probe_folders(config: TrainConfig, run_dir: Optional[Path], env: Optional[LauncherEnv]) -> None:
    """The folders this node writes, probed before any rank starts (``runtime/process/writable.py``):
    by a local run's launcher, or by each node's local rank 0 under a launcher (every node writes
    checkpoint shards; global rank 0 the run folder, the metrics and the final state)."""
    if env is not None and env.local_rank != 0:
        return
    ckpts, log = config.checkpointing, config.logging
    folders = [("--checkpoint-dir", ckpts.checkpoint_dir)]
    if env is None or env.rank == 0:
        folders += [("--run-dir", run_dir),
                    ("--metrics", Path(log.metrics).parent if log.metrics else None),
                    ("--save-final", Path(ckpts.save_final).parent if ckpts.save_final else None)]
    probe_writable(folders)


def resume_hint(config: TrainConfig) -> str:
    """``; --resume continues from DIR`` when the run has a checkpoint to continue from."""
    if config.checkpointing.checkpoint_dir is None:
        return ""
    last = latest(config.checkpointing.checkpoint_dir)
    return f"; --resume continues from {last}" if last is not None else ""


def is_hf_dir(model: str) -> bool:
    """``hf:DIR`` (or a name that is neither a zoo name nor a directory: its one-line error)."""
    return model.startswith("hf:") and model[3:] not in ZOO_CONFIGS["hf"]


def resume_point(config: TrainConfig, quiet: bool, speaker: bool = True) -> Optional[ResumePoint]:
    """With ``resume``: the checkpoint to continue from, checked before any process starts (the ranks
    then all load it); its warnings go to stderr (``speaker``: this rank says them). None for a fresh
    run."""
    ckpts, steps, world_size = config.checkpointing, config.data.steps, config.cluster.world_size
    if not ckpts.resume:
        return None
    point = find_resume_point(ckpts.checkpoint_dir, fallback=ckpts.resume_fallback)
    for w in point.warnings if speaker else ():
        sys.stderr.write(f"hgraph train: warning: {w}\n")
    if point.step >= steps:
        raise HGraphError(f"--resume: {str(point.folder)!r} is at step {point.step} and --steps is "
                          f"{steps}: nothing left to train (--steps is the run's total)")
    check_resume_queues(point.manifest.get("delay_queues", {}), config.planner.outlier_queues, point.folder)
    if speaker and not quiet and point.manifest.get("foreign"):
        print(f"resuming from {point.folder}, a DCP checkpoint of another program: its Adam step count "
              f"{point.step} is taken as the steps done ({point.step} of {steps}); the data goes on after this "
              f"run's first {point.step} mini-batches", flush=True)
    elif speaker and not quiet:
        pos = point.data_position
        resharded = (f", resharded from {point.world_size} to {world_size} ranks"
                     if point.world_size != world_size else "")
        print(f"resuming from {point.folder}: {point.step} of {steps} steps done, next document "
              f"{pos.get('next_document')} (epoch {pos.get('epoch')}){resharded}", flush=True)
    return point
