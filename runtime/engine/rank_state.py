"""What a rank keeps per Program (``RankState``), and its copy of the rank's graph holding working
parameters (``working_graph``)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol

import torch
import torch.fx as fx
import torch.nn as nn

from hgraph.program import Program, RankProgram
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.comm.param_sync import ParamSync
from hgraph.runtime.engine.memory import StageMemory


class ShardedOptimizer(Protocol):
    """What the executor needs of the sharded optimizer (``engine.optimizer.ShardedAdam``)."""

    params: Mapping[str, torch.Tensor]      # this rank's fp32 master shards, by parameter name
    max_grad_norm: Optional[float]          # global-norm clipping (needs every gradient before an update)
    updates_in_parts: bool                  # ``step`` may take disjoint parts of one step's gradients

    def step(self, grad_shards: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]: ...


@dataclass
class RankState:
    """What a rank keeps per Program: its program, graph, working tensors and Pull/Push engine."""

    program: Program
    rank_program: RankProgram
    graph: fx.GraphModule                  # the rank's graph (blocks outlined, regions compiled)
    working: dict[str, nn.Parameter]
    comm: CommContext                      # the Program's fixed communication state
    sync: ParamSync
    memory: Optional[StageMemory] = None   # activation accounting and recomputation, when tracked
    ready: bool = False                    # groups created (and regions compiled): ``Executor._ready_state``


def working_graph(rp: RankProgram, masters: Mapping[str, torch.Tensor], world_size: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[fx.GraphModule, dict[str, nn.Parameter], frozenset[str]]:
    """The executor's own copy of ``rp``'s graph with working parameters in place of the compiler's (the
    Program's graph, which the compiled module caches and may hand to others, keeps those): the copy,
    its working parameters by name and those that are the masters themselves (aliased)."""
    source = rp.graph_module
    gm = fx.GraphModule(source, copy.deepcopy(source.graph), type(source).__name__)
    working, aliased = {}, set()
    for name, shard in rp.params.items():
        *path, leaf = name.split(".")
        mod = gm
        for part in path:
            mod = getattr(mod, part)
        master = masters[name]
        if world_size == 1 and dtype == master.dtype and not shard.pad and master.device == device:
            # one rank in fp32: the working parameter IS the master (shares its storage), so the
            # pull and the push move nothing and the optimizer's update is seen directly
            param = nn.Parameter(master.view(shard.shard_shape))
            aliased.add(name)
        else:
            param = nn.Parameter(torch.empty(shard.shard_shape, dtype=dtype, device=device))
        setattr(mod, leaf, param)
        working[name] = param
    return gm, working, frozenset(aliased)
