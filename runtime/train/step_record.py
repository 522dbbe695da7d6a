"""What one training step reports, in one immutable record.

A step mode (``runtime.train.step_modes``) builds a ``StepRecord`` once, when its step has run: the
executor's ``StepResult``, the program cache's counts after it, the planner's figures (planner-driven)
or DCP-inter's balance figures, and the ``StepExtras`` the trainer adds once the result is known (its
learning rate, the validation loss, the throughput, the memory figures). The trainer hands the record
to its reporters (the metrics line, the step line, the loggers, the run's summary); none of them
reads the mode, the executor or the trainer for the step's figures, and nobody changes a record.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from hgraph.runtime.data.documents import MiniBatch
from hgraph.runtime.engine.executor import StepResult

NO_FIGURES: Mapping[str, Any] = MappingProxyType({})


def figures(values: Optional[Mapping[str, Any]]) -> Mapping[str, Any]:
    """A read-only copy of ``values`` (None: empty)."""
    return MappingProxyType(dict(values)) if values else NO_FIGURES


@dataclass(frozen=True)
class CacheCounts:
    """The program cache's hits and misses once the step ran (``engine.program_cache``)."""

    hits: int
    misses: int


@dataclass(frozen=True)
class StepExtras:
    """What the trainer adds to a step once its result is known: the learning rate it ran at,
    ``eval_loss`` when it was followed by an evaluation (None: not evaluated), its throughput
    (``runtime.train.throughput``), its memory figures (``metrics.memory_figures``; empty when nothing
    logs them) and whether the run delays outliers (the metrics line then says what was held back)."""

    lr: float
    eval_loss: Optional[float] = None
    throughput: Mapping[str, Any] = field(default_factory=lambda: NO_FIGURES)
    memory: Mapping[str, Any] = field(default_factory=lambda: NO_FIGURES)
    outlier_delay: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "throughput", figures(self.throughput))
        object.__setattr__(self, "memory", figures(self.memory))

    def fields(self) -> dict:
        """``{"lr"}`` and, when evaluated, ``"eval_loss"``: the step's own extra figures."""
        return {"lr": self.lr} if self.eval_loss is None else {"lr": self.lr, "eval_loss": self.eval_loss}


@dataclass(frozen=True)
class StepRecord:
    """One step's report, built once by the step mode (``StepMode.step``)."""

    batch: MiniBatch
    result: StepResult
    cache: CacheCounts
    extras: StepExtras
    plan: Mapping[str, Any] = field(default_factory=lambda: NO_FIGURES)   # planner-driven: the planner's figures
    balance: Mapping[str, Any] = field(default_factory=lambda: NO_FIGURES)   # DCP-inter: its balance figures

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", figures(self.plan))
        object.__setattr__(self, "balance", figures(self.balance))

    @property
    def step(self) -> int:
        return self.batch.step

    def row(self) -> dict:
        """The step's row in a run's summary: the result's fields with its ``tflops_per_device`` and
        ``mfu`` (None without a throughput)."""
        return {**asdict(self.result), "tflops_per_device": self.extras.throughput.get("tflops_per_device"),
                "mfu": self.extras.throughput.get("mfu")}

    def extra_row(self) -> dict:
        """``{"step", "lr"[, "eval_loss"]}``: the step's extras in a run's summary."""
        return {"step": self.step, **self.extras.fields()}
