"""Where rank 0 sends every step's scalars besides the metrics file: TensorBoard and Weights & Biases.

``--tensorboard DIR`` writes an event file with ``torch.utils.tensorboard.SummaryWriter`` (the
``tensorboard`` package: ``pip install -e '.[tensorboard]'`` in the hgraph checkout); ``--wandb PROJECT`` logs to a wandb run
in offline mode (no network needed; ``wandb sync`` uploads it later) when ``wandb`` is installed, and
says so in one line and goes on without it when it is not. The scalars of a step (``step_scalars``):
``train/loss``, ``throughput/tokens_per_s``, ``throughput/tflops_per_device``, ``throughput/mfu`` (only
with a known peak), ``time/step_s`` and ``memory/peak_bytes/rank_R`` per rank (when measured).
"""
from __future__ import annotations

from typing import Any, Optional

from hgraph.errors import HGraphError
from hgraph.runtime.process.run_log import run_log

log = run_log(__name__)


def step_scalars(loss: float, time_s: float, throughput: dict, memory: dict,
                 extra: Optional[dict] = None) -> dict[str, float]:
    """The scalars of one step, by tag; ``extra``: the step's ``lr`` and, when
    measured, ``eval_loss``."""
    extra = extra or {}
    out = {"train/loss": float(loss), "time/step_s": float(time_s),
           "throughput/tokens_per_s": float(throughput["tokens_per_s"]),
           "throughput/tflops_per_device": float(throughput["tflops_per_device"])}
    if throughput.get("mfu") is not None:
        out["throughput/mfu"] = float(throughput["mfu"])
    if extra.get("lr") is not None:
        out["train/lr"] = float(extra["lr"])
    if extra.get("eval_loss") is not None:
        out["eval/loss"] = float(extra["eval_loss"])
    for rank, peak in enumerate(memory.get("rank_peak_bytes") or []):
        if peak is not None:
            out[f"memory/peak_bytes/rank_{rank}"] = float(peak)
    return out


class TensorBoardLogger:
    """Scalars into a TensorBoard event file under ``log_dir``."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package
        except ImportError as exc:
            raise HGraphError(f"--tensorboard {log_dir}: the tensorboard package is not installed "
                              "(pip install -e '.[tensorboard]' in the hgraph checkout, or pip install tensorboard)") from exc
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Scalars into an offline wandb run of ``project`` (files under ``directory``)."""

    def __init__(self, wandb: Any, project: str, directory: Optional[str], config: dict) -> None:
        self.run = wandb.init(project=project, mode="offline", dir=directory, config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class StepLoggers:
    """The loggers a run asked for (none: nothing is done); rank 0 only."""

    def __init__(self, tensorboard: Optional[str] = None, wandb_project: Optional[str] = None,
                 directory: Optional[str] = None, config: Optional[dict] = None) -> None:
        self.loggers: list[Any] = []
        if tensorboard:
            self.loggers.append(TensorBoardLogger(tensorboard))
        if wandb_project:
            try:
                import wandb  # optional: only this flag needs it
            except ImportError:
                log.warning("hgraph: --wandb %s: wandb is not installed (pip install wandb); not logging to it",
                            wandb_project)
            else:
                self.loggers.append(WandbLogger(wandb, wandb_project, directory, config or {}))

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, scalars)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []
