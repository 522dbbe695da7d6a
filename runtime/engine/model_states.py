"""The bytes of the model a rank holds, counted from shapes alone: the optimization phase's model
states and the working tensors of one strategy's layout (Hydraulis §5.2), as the engine allocates them.

* ``ShardedAdam`` (``optimizer``) keeps, per parameter, this rank's segment along the parameter's
  shard dimension (``shard_bounds``: sizes differ by one row at most, a rank may own none) in fp32
  three times: the master and Adam's two moments, 12 bytes an element, about 1/N of the model.
* Its step holds, for as long as the step runs, the fp32 gradient segments the push hands over and
  Adam's denominator (8 bytes an element of the segment): the *step transient*. The backward has
  freed the activations by then, so it competes with them for memory, not in addition to them.
* The ``Executor`` keeps one Program's working parameters (this rank's ``ParamShard.shard_shape``,
  padding rows included, in the working dtype) and their gradients; a strategy switch frees the last
  layout's (``ParamSync.release_working``), so only one layout counts. On one rank in fp32 a working
  parameter without padding is the master itself (``Executor.rank_state``): no bytes of its own.

Nothing is allocated: the shards come from ``CompiledModule.param_shards`` (the layouts every
Program's ranks get, without graphs or plans), the segments from the parameters' shapes, so a
70B-parameter model on 64 ranks is counted in milliseconds once traced. ``hgraph memory`` prints
these figures, the planner's memory model bounds MaxLen with them
(``planner.cost.runtime_memory``), and a test holds them equal to what a run allocates.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Optional

import torch

from hgraph.compiled import CompiledModule
from hgraph.errors import StrategyError
from hgraph.program import ParamShard
from hgraph.runtime.engine.executor import shard_dims_of
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.shard_rule import group_shard_bounds
from hgraph.strategy import Cluster, Scheme, Strategy

MASTER_BYTES = 4          # fp32 master segment, per element
MOMENT_BYTES = 8          # Adam's exp_avg and exp_avg_sq, fp32
STEP_TRANSIENT_BYTES = 8  # the step's fp32 gradient segments and Adam's denominator


@dataclass(frozen=True)
class RankStates:
    """One rank's bytes of model states (optimizer) and of its working layout."""

    masters: int
    moments: int
    working_params: int
    working_grads: int
    step_transient: int

    @property
    def optimizer(self) -> int:
        """Masters and moments: the strategy-independent ~1/N."""
        return self.masters + self.moments

    @property
    def resident(self) -> int:
        """What the rank holds through a step: optimizer states and one working layout with gradients."""
        return self.masters + self.moments + self.working_params + self.working_grads

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "optimizer": self.optimizer, "resident": self.resident}


def param_dims(compiled: CompiledModule) -> dict[str, tuple[tuple[int, ...], int]]:
    """``name -> (full shape, optimizer shard dim)`` of every parameter, in model order."""
    dims = shard_dims_of(compiled)
    return {name: (tuple(int(d) for d in info.shape), dims[name]) for name, info in compiled.hgraph.params.items()}


def optimizer_elements(dims: Mapping[str, tuple[tuple[int, ...], int]], rank: int, world_size: int,
                       group_size: Optional[int] = None) -> int:
    """Elements of every parameter's segment that ``rank`` of ``world_size`` owns (``ShardLayout``:
    a 0-d parameter is one element along dim 0); ``group_size``: the states sharded over groups of
    that many ranks (``--shard-group``; None: the world)."""
    total = 0
    for shape, dim in dims.values():
        shape = shape or (1,)
        lo, hi = group_shard_bounds(shape[dim], rank, group_size or world_size)
        total += math.prod(shape) // shape[dim] * (hi - lo) if shape[dim] else 0
    return total


def working_bytes(shards: Mapping[str, ParamShard], dtype: torch.dtype, aliased: bool = False) -> tuple[int, int]:
    """``(parameters, gradients)`` bytes of a rank's working shards in ``dtype``; ``aliased``: one
    rank in fp32, where a shard without padding is the master's storage (its gradient is not)."""
    size = dtype.itemsize
    params = grads = 0
    for shard in shards.values():
        n = math.prod(shard.shard_shape) * size
        grads += n
        if not (aliased and not shard.pad):
            params += n
    return params, grads


def _aliased(world_size: int, dtype: torch.dtype) -> bool:
    return world_size == 1 and dtype == torch.float32


def rank_states(compiled: CompiledModule, strategy: Strategy, cluster: Cluster, dtype: torch.dtype) -> list[RankStates]:
    """Every rank's ``RankStates`` under ``strategy`` on ``cluster`` (working tensors in ``dtype``).
    Bad strategies (rank count, node boundaries, TP degrees the model refuses) are ``StrategyError``."""
    strategy.validate(cluster)
    dims = param_dims(compiled)
    shards = {p: compiled.param_shards(p) for p in dict.fromkeys(strategy.pipelines)}
    aliased = _aliased(cluster.world_size, dtype)
    out = []
    for c in strategy.coords():
        opt = optimizer_elements(dims, c.rank, cluster.world_size, cluster.group_size)
        wp, wg = working_bytes(shards[strategy.pipelines[c.pipeline]][(c.stage, c.tp_rank)], dtype, aliased)
        out.append(RankStates(opt * MASTER_BYTES, opt * MOMENT_BYTES, wp, wg, opt * STEP_TRANSIENT_BYTES))
    return out


def scheme_states(compiled: CompiledModule, schemes: Iterable[Scheme], world_size: int, dtype: torch.dtype, *,
                  skip_refused: bool = False, group_size: Optional[int] = None) -> dict[tuple[int, int], tuple[int, int]]:
    """Per ``(tp, pp)``: ``(resident, step transient)`` bytes of the fullest rank a pipeline of that
    scheme can have on ``world_size`` ranks (any of its ranks may sit at any world rank, so the largest
    optimizer segment plus the largest working layout; CP does not change either). The planner's
    model states (``MemoryModel.scheme_states``). A scheme the model refuses (TP not dividing its
    heads, PP above its layers) is a ``StrategyError``, or left out with ``skip_refused``. ``group_size``:
    the optimizer states sharded over groups of that many ranks (None: the world)."""
    dims = param_dims(compiled)
    opt = max(optimizer_elements(dims, r, world_size, group_size) for r in range(group_size or world_size))
    aliased = _aliased(world_size, dtype)
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for p in schemes:
        key = (p.tp, p.pp)
        if key in out:
            continue
        try:
            layouts = compiled.param_shards(Scheme(p.tp, p.pp))
        except StrategyError:
            if skip_refused:
                continue
            raise
        work = max(sum(working_bytes(s, dtype, aliased)) for s in layouts.values())
        out[key] = (opt * (MASTER_BYTES + MOMENT_BYTES) + work, opt * STEP_TRANSIENT_BYTES)
    return out


def allocated_bytes(optimizer: ShardedAdam, working: Mapping[str, torch.Tensor]) -> RankStates:
    """What a rank holds now, measured on its tensors: ``optimizer``'s segments and the ``working``
    parameters (``RankState.working``) with their gradients, each storage once (an aliased working
    parameter shares its master's). ``step_transient`` is 0: nothing of it outlives a step."""
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if s._cdata not in seen:
                seen.add(s._cdata)
                total += s.nbytes()
        return total

    masters = count(optimizer.params.values())
    moments = count(optimizer.exp_avg.values()) + count(optimizer.exp_avg_sq.values())
    params = count(working.values())
    grads = count(w.grad for w in working.values() if w.grad is not None)
    return RankStates(masters, moments, params, grads, 0)
