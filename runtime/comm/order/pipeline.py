"""The order of a pipeline stage's forwards and backwards in one step (1F1B).

It lives beside the collective order because it fixes that order: a stage's sends, receives and
activation collectives follow its micro-batches in this order (``derive``), and the executor runs
them in it (``runtime/engine/executor``)."""
from __future__ import annotations


def one_f_one_b(num_microbatches: int, num_stages: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage: ``[("F", i) | ("B", i)]``."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order
