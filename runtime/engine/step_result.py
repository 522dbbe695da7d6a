"""What one step did on this rank (``StepResult``) and how it found its Program (``ProgramLookup``).

Built once by ``Executor.step`` when the step has ended; what others add to a step lives beside it
(``runtime/train/step_record``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class StepResult:
    """What one step did on this rank (``loss`` is the mini-batch loss, the same on every rank); built
    once, when the step has ended (``Executor.step``), and never changed: what others add to a step
    (its throughput, the planner's figures) lives beside it, in ``runtime.train.step_record``."""

    step: int
    strategy: str
    loss: float
    tokens: int
    time_s: float
    pull_s: float = 0.0
    compute_s: float = 0.0
    push_s: float = 0.0
    optimizer_s: float = 0.0
    skipped: bool = False
    grad_norm: Optional[float] = None
    bytes: dict = field(default_factory=dict)
    peak_mem_bytes: Optional[int] = None          # activations measured (CPU) / allocator peak (CUDA)
    process_peak_bytes: Optional[int] = None      # this process's peak since the last step (peak_memory)
    predicted_mem_bytes: Optional[float] = None   # the memory model's peak (with a memory budget)
    recompute_layers: list = field(default_factory=list)   # per micro-batch of this rank
    offload_layers: list = field(default_factory=list)     # per micro-batch of this rank
    host_peak_bytes: Optional[int] = None         # offloaded activations held in host memory (peak)
    overlapped_update: bool = False   # plain data parallelism: shards updated as reductions arrived
    pull_prefetched: bool = False     # the all-gathers of this step were done by the previous one
    compiles: Optional[int] = None    # with --compile: this rank's region compilations so far
    cache_hit: Optional[bool] = None  # the strategy's Program was built before (None: a Program was given)
    switch_s: float = 0.0             # host time finding (hit) or building (miss) the Program
    built_ahead: bool = False         # the Program's first step, and it was built ahead (engine.build_ahead)
    build_s: Optional[float] = None   # on the Program's first step: its build's seconds (ahead: off this step)
    build_lead_s: Optional[float] = None   # built ahead: how long before this step its build began
    moe_aux_loss: Optional[float] = None   # the MoE load-balancing loss (per target, before its coefficient)
    moe_z_loss: Optional[float] = None     # the MoE router z-loss (per target, before its coefficient)
    # the step's push (reductions, transfers to the owners, the loss; with the overlapped update, the
    # shards' updates too), host clock: from its first reduction's issue to its end, and the part of
    # that after the backward ended (what the backward did not hide)
    push_ms: float = 0.0
    push_exposed_ms: float = 0.0
    # the same three moments on the wall clock (s: first reduction issued, backward ended, push ended),
    # comparable across ranks: the step's exposed push is counted from the backward that ended last
    push_times: tuple = ()


@dataclass(frozen=True)
class ProgramLookup:
    """How a step found its Program: a hit (None: a Program was given), the lookup's host time and, on
    the Program's first step, its build (``built_ahead``, ``build_s``, ``build_lead_s``)."""

    cache_hit: Optional[bool]
    switch_s: float
    built_ahead: bool = False
    build_s: Optional[float] = None
    build_lead_s: Optional[float] = None
