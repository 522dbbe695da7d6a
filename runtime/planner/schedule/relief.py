"""How far relief (recomputation and offload) lengthens a scheme's micro-batches, and what it costs a
document alone.

Without relief a scheme's MaxLen is the longest micro-batch whose activations all fit the device's
room (``MemoryModel.max_len``). With relief the engine keeps a micro-batch's peak within its budget
by recomputing or offloading layers (``engine.memory.StageMemory``), so a micro-batch fits when the
least device memory its relieved layers leave (``schedule.offload.layer_roles``: within the host
budget, the others of the first stage's ``PP`` micro-batches counted as ``schedule.recompute`` does)
is within the device's room: ``relieved_max_len`` is the longest such micro-batch (the peak is
linear in the tokens for given roles and the host budget only binds more as they grow, so fitting
is monotone: a doubling then a bisection find it). The dispatch's per-document costs
(``dispatch_result.SchemeCosts``) and the packer add what relief costs a document alone
(``doc_relief_ms``), so "a narrow scheme and its relief" is weighed against "a wider scheme" before
the final estimate prices each packed micro-batch (``CostModel.microbatch_time``).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from hgraph.runtime.planner.schedule.offload import layer_roles
from hgraph.runtime.planner.schedule.recompute import others_held, stage_activation_model

LONGEST = 2 ** 40           # tokens: beyond any micro-batch (the search's ceiling)


def relieved_fits(cost: Any, scheme: Any, tokens: int) -> bool:
    """Whether a micro-batch of ``tokens`` fits a rank of ``scheme`` with its layers relieved as the
    engine relieves them under ``cost.relief_budget(scheme)`` (``--offload on`` without a budget:
    every layer offloaded within the host budget)."""
    # the chunked loss's transient logits sit beside the activations while the loss runs
    room = cost.memory.activation_room(cost.model, scheme, cost.world_size) \
        - cost.memory.transient_bytes(scheme, tokens)
    budget = cost.relief_budget(scheme)
    limit = room if budget is None else min(room, budget)
    if limit <= 0:
        return False
    roles, _ = layer_roles(cost, [tokens], scheme, budget, offload=cost.offload,
                           host_budget_bytes=cost.host_budget_bytes)
    return roles.fits and roles.predicted_peak <= limit


def relieved_max_len(cost: Any, scheme: Any, plain: int) -> int:
    """The longest micro-batch (tokens) of ``scheme`` that fits with relief, never below ``plain``
    (the MaxLen without it)."""
    if stage_activation_model(cost, scheme) is None:
        return plain
    lo = max(plain, 0)
    if lo and not relieved_fits(cost, scheme, lo + 1):
        return lo
    hi = max(lo, 1)
    while relieved_fits(cost, scheme, hi):
        lo, hi = hi, 2 * hi
        if hi > LONGEST:
            return lo
    while hi - lo > 1:              # lo fits (or is ``plain``), hi does not
        mid = (lo + hi) // 2
        if relieved_fits(cost, scheme, mid):
            lo = mid
        else:
            hi = mid
    return lo


def unrelieved_len(cost: Any, scheme: Any) -> int:
    """The longest micro-batch the engine runs with nothing relieved (``LONGEST`` without relief;
    0 where every micro-batch is, ``--offload on`` without a budget)."""
    budget = cost.relief_budget(scheme)
    if not cost.relieves:
        return LONGEST
    model = stage_activation_model(cost, scheme)
    if budget is None:
        return 0 if cost.offload == "on" and model is not None else LONGEST
    if model is None:
        return LONGEST
    layers = max(math.ceil(cost.model.layers / scheme.pp), 1)
    per_token = model.peak((1.0, 0.0), layers, 0, others_held(model, (1.0, 0.0), layers, scheme.pp))
    return int(budget // per_token) if per_token > 0 else LONGEST


def doc_relief_ms(cost: Any, scheme: Any, lengths: np.ndarray) -> np.ndarray:
    """What relief adds (ms) to a micro-batch of each document alone (0 where none is relieved)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(lengths.shape, dtype=np.float64)
    if not cost.relieves or lengths.size == 0:
        return out
    over = lengths > unrelieved_len(cost, scheme)
    if not over.any():
        return out
    for l in np.unique(lengths[over]):
        out[lengths == l] = cost.relief_ms([int(l)], scheme)
    return out


def packing_capacity(cost: Any, scheme: Any, longest: int) -> int:
    """The most tokens the packer puts in one micro-batch of ``scheme`` holding documents of at most
    ``longest`` tokens: what runs without relief, or the longest document where it needs relief
    (packing never makes a micro-batch relieved that its documents alone would not make so: the
    packer prices documents, not the relief of their sum), within MaxLen (an EP micro-batch's, its
    replicas': ``CostModel.microbatch_capacity``)."""
    return min(cost.microbatch_capacity(scheme, longest), max(unrelieved_len(cost, scheme), int(longest)))

