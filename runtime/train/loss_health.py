"""Loss health: one warning for a loss that does not move.

A loss that stays where it started while the learning rate is above zero is a classic sign of a run
that trains nothing: a learning rate so high that the logits saturate the softmax (the model predicts
one distribution, often the uniform one at ``ln(vocab)``, whatever the input) or so low that the
weights barely move. ``FlatLossWatch`` looks at the first ``FLAT_WINDOW`` steps after the warmup (the
warmup's own steps may move slowly on purpose; without a warmup from step 1, the first loss after an
update, since step 0's loss is the initial weights'): if every finite loss there lies within ``threshold``
of the first, relative to it, and every one of those steps had a learning rate above zero, it returns
one warning, once. ``--flat-loss-threshold`` sets the threshold (a fine-tune whose loss is already
low and moves little may lower it) and 0 turns the warning off.

Steps whose loss is not finite are counted elsewhere (the summary's skipped steps) and end the watch:
a run that diverged is not a flat one. A resumed run that starts after the window never completes it.
"""
from __future__ import annotations

import math
from typing import Optional

FLAT_WINDOW = 50         # steps after the warmup that the watch looks at
DEFAULT_THRESHOLD = 1e-3  # relative movement below which the loss is flat


class FlatLossWatch:
    """Feed it every step's ``(step, loss, lr)`` in order; ``observe`` returns the warning at most once."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, warmup_steps: int = 0, window: int = FLAT_WINDOW):
        self.threshold, self.first_step, self.window = threshold, max(warmup_steps, 1), window
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.done = threshold <= 0 or window < 1

    def observe(self, step: int, loss: float, lr: float) -> Optional[str]:
        if self.done or not self.first_step <= step < self.first_step + self.window:
            return None
        if step != self.first_step + len(self.losses) or not math.isfinite(loss):
            self.done = True          # a step missing (a resume inside the window) or a diverged loss
            return None
        self.losses.append(float(loss))
        self.lrs.append(float(lr))
        if len(self.losses) < self.window:
            return None
        self.done = True
        return self.verdict()

    def verdict(self) -> Optional[str]:
        """The warning for the window seen (None: the loss moved, or a learning rate was zero)."""
        first = self.losses[0]
        moved = (max(self.losses) - min(self.losses)) / max(abs(first), 1e-12)
        if moved >= self.threshold or min(self.lrs) <= 0:
            return None
        last = self.first_step + len(self.losses) - 1
        return (f"the loss has not moved over steps {self.first_step}-{last} after the warmup: {first:.6f} -> "
                f"{self.losses[-1]:.6f}, within {moved:.1e} of where it started (threshold {self.threshold:g}), "
                f"at learning rates {min(self.lrs):.3g}-{max(self.lrs):.3g}; likely causes: a learning rate too "
                "high (the logits saturate the softmax: one distribution whatever the input) or too low (the "
                "weights barely move); --flat-loss-threshold sets the threshold, 0 turns this warning off")
