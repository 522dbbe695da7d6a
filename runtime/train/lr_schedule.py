"""The learning rate of every step: ``--lr-schedule constant|cosine|linear|wsd`` with ``--warmup-steps W``,
``--min-lr`` and ``--decay-steps D`` (the usual definitions, as Megatron-LM and torchtitan use them).

Step ``s`` counts from 0 over the run's ``steps``; ``lr`` is the peak:

* warmup: ``lr * (s + 1) / W`` for ``s < W`` (no step trains at 0);
* constant: ``lr`` after the warmup;
* cosine / linear: the decay runs over ``D`` steps after the warmup (default ``steps - W``), with
  progress ``t = min(1, (s - W) / D)``: cosine ``min + (lr - min) (1 + cos(pi t)) / 2``, linear
  ``lr - (lr - min) t``; ``min`` after the decay;
* wsd (warmup, stable, decay): ``lr`` until the last ``D`` steps of the run (default 10% of
  ``steps``, at least 1), then linear down to ``min`` at the last step.

The schedule is a pure function of the step, so a resumed run continues it exactly; its settings go
into the checkpoint (``state``) and a resume with other settings is said, not refused (a new
``--lr`` takes effect on resume, as before).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from hgraph.errors import HGraphError

SCHEDULES = ("constant", "cosine", "linear", "wsd")


@dataclass(frozen=True)
class LRSchedule:
    """``lr_at(step)`` for one run."""

    kind: str
    lr: float
    steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise HGraphError(f"--lr-schedule {self.kind!r}: allowed are {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0 or (self.decay_steps is not None and self.decay_steps < 1):
            raise HGraphError("--warmup-steps must be >= 0 and --decay-steps >= 1")
        if self.min_lr > self.lr and self.kind != "constant":
            raise HGraphError(f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}: the schedule decays "
                              "to it")

    @property
    def decay(self) -> int:
        """Steps of the decay phase."""
        if self.decay_steps is not None:
            return self.decay_steps
        if self.kind == "wsd":
            return max(1, math.ceil(0.1 * self.steps))
        return max(1, self.steps - self.warmup_steps)

    def lr_at(self, step: int) -> float:
        s, w = int(step), self.warmup_steps
        if s < w:
            return self.lr * (s + 1) / w
        if self.kind == "constant":
            return self.lr
        if self.kind == "wsd":
            start = self.steps - self.decay
            if s < start:
                return self.lr
            t = min(1.0, (s - start + 1) / self.decay)
            return self.lr - (self.lr - self.min_lr) * t
        t = min(1.0, (s - w) / self.decay)
        if self.kind == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
        return self.lr - (self.lr - self.min_lr) * t

    def state(self) -> dict:
        """What a checkpoint keeps of the schedule."""
        return asdict(self)


def schedule_of(config) -> LRSchedule:
    """The run's schedule from a ``TrainConfig``: ``auto`` is constant (the command line resolves it
    to ``builtin_default`` for its built-in run), unset warmup and minimum are 0."""
    opt = config.optimizer
    kind = "constant" if opt.lr_schedule == "auto" else opt.lr_schedule
    return LRSchedule(kind, opt.lr, config.data.steps, opt.warmup_steps or 0, opt.min_lr or 0.0,
                      opt.decay_steps)


def builtin_default(lr: float, steps: int, warmup_steps: Optional[int], min_lr: Optional[float]) -> dict:
    """The built-in default run's recipe: cosine to ``lr / 10`` after a warmup of 10% of the steps
    (what is given explicitly is kept)."""
    return {"lr_schedule": "cosine",
            "warmup_steps": math.ceil(0.1 * steps) if warmup_steps is None else warmup_steps,
            "min_lr": lr / 10 if min_lr is None else min_lr}
