"""The context the instantiation passes share while compiling the graph of one role.

A pass is a function ``name_pass(gm, ctx: PassContext) -> GraphModule`` (``passes/pipeline``). The
instantiation passes run once per role (scheme, stage, TP rank, CP rank) with a ``PassContext``
built by ``passes/instantiate.build_role_module``; its fields are everything they read, and the
results they hand to a later pass or to the role's ``RoleProgram``. The frontend passes
(``annotate_pass``, ``insert_slots_pass``) read nothing and run with ``ctx=None``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hgraph.graph import HGraph
from hgraph.options import CompileOptions
from hgraph.program import ParamShard, RankRole

#: ``(dims, dtype)`` of a tensor node, dims with ``"B"``/``"T"`` for the micro-batch's batch and
#: sequence (``extract_stage.symbolic_shapes``)
ShapeSpec = tuple[tuple[Any, ...], torch.dtype]


@dataclass
class PassContext:
    """What the instantiation passes read and write for one role; comments name the passes."""

    # ---- inputs, set by ``build_role_module`` ----------------------------------------------------
    hgraph: HGraph                   # the model's HGraph: shard_tp (TP roles), schedule_comm (block order)
    role: RankRole                   # extract_stage, shard_tp, fill_activation_comm, packed_attention,
    #                                  schedule_comm
    stage_blocks: tuple[tuple[str, ...], ...]   # repeated blocks of each stage of the role's pipeline:
    #                                             extract_stage
    shapes: dict[str, ShapeSpec]     # node name -> shape of the HGraph's tensors: extract_stage,
    #                                  fill_activation_comm (the CP key/value sequence dim)
    options: CompileOptions          # the working dtype: extract_stage, fill_param_slots
    params: dict[str, ParamShard]    # the shards this role holds: shard_tp (then the module's parameters)
    # the sequence-parallel plan when this role runs SP (TP > 1 and SP on), else None: extract_stage,
    # fill_activation_comm, sequence_parallel, dropout
    sp: Optional[Any] = None
    # ---- written by the passes -------------------------------------------------------------------
    # TP_GATHER slot name -> (per-rank sizes along the last dim, real size), None where the op before
    # is not sharded: written by shard_tp, read by fill_activation_comm
    gathers: dict[str, Optional[tuple[list[int], int]]] = field(default_factory=dict)
    # (dims, dtype) of the activations received from the previous stage / sent to the next one:
    # written by extract_stage, read by ``RoleProgram.recv_specs`` / ``send_specs``
    recv_specs: list[ShapeSpec] = field(default_factory=list)
    send_specs: list[ShapeSpec] = field(default_factory=list)
