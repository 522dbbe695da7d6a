"""Per-rank memory of a strategy before anything runs: what ``hgraph memory`` prints.

For every rank of a strategy on a cluster: the model states it holds (``engine.model_states``: fp32
master and Adam moment segments, ~1/N; the working parameters and gradients of its shard of the
strategy's layout; the optimizer step's transient), the activations of its stage under 1F1B from
this runtime's memory model (``runtime_memory.measured_activation_coeffs``: the bytes per token a
layer and the rest of the model save, counted on fake tensors), and its peak against a device memory;
with ``offload``, every block's stash in host memory instead (``stage_offloaded_bytes``), against a
host budget.

Activations: ``tokens`` is the length of one packed micro-batch (what MaxLen bounds). Under 1F1B
stage ``s`` of a ``PP``-stage pipeline holds ``PP - s`` micro-batches in flight (enough micro-batches
assumed: the worst case), each of its layers saving ``A[TP] * hidden / (TP * CP)`` bytes a token; the
last stage also holds the head's and the loss's (``other_coeff``: the head's input and the targets, the
loss being made chunk by chunk; the embedding saves only token ids); under sequence parallelism
(TP > 1) what the norms save is a TP rank's token slice (``runtime_memory``). The last stage's figure
also holds the chunked loss's transient logits of one chunk (``runtime_memory.loss_transient_bytes``:
growing with the tokens up to one chunk, at most a few times 64 MiB; the planner's MaxLen counts it
beside the activations: ``MemoryModel.transient_bytes``). CP ranks
see ``tokens / CP`` each. The planner's MaxLen takes B.1's bound of a scheme instead (all layers of the
model for one micro-batch plus the head, on the first stage), which
is at least every stage's figure here. They are measured for zoo Llama models; for other models the
activations are not known (``None``) and the totals are the model states alone.

The peak is the resident states plus the larger of the activations and the step transient: the
optimizer steps after the backward has freed the activations. Communication buffers (all-gather
and reduce-scatter buckets, received pipeline activations) and the process itself (the framework,
one parameter at a time materialised at start) come on top.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hgraph.frontends.zoo import llama
from hgraph.runtime.engine.model_states import RankStates, rank_states
from hgraph.runtime.planner.cost.runtime_memory import (is_runtime_model, loss_transient_bytes,
                                                        measured_activation_coeffs)
from hgraph.strategy import Cluster, Scheme, Strategy


@dataclass(frozen=True)
class RankMemory:
    """One rank's figures (bytes)."""

    rank: int
    pipeline: int
    scheme: Scheme
    stage: int
    tp_rank: int
    cp_rank: int
    states: RankStates
    activations: Optional[int]
    host_activations: Optional[int] = None     # offloaded to host memory (``--offload on``)

    @property
    def peak(self) -> int:
        return self.states.resident + max(self.activations or 0, self.states.step_transient)

    def figures(self) -> tuple:
        """What makes two ranks' rows the same (all but the rank and where it sits)."""
        return (self.scheme, self.stage, self.states, self.activations, self.host_activations)

    def to_dict(self, device_memory: Optional[float]) -> dict[str, Any]:
        return {"rank": self.rank, "pipeline": self.pipeline, "scheme": str(self.scheme), "stage": self.stage,
                "tp_rank": self.tp_rank, "cp_rank": self.cp_rank, **self.states.to_dict(),
                "activations": self.activations, "host_activations": self.host_activations, "peak": self.peak,
                "fits": None if device_memory is None else self.peak <= device_memory}


@dataclass
class MemoryEstimate:
    """Every rank's memory under one strategy."""

    strategy: Strategy
    cluster: Cluster
    dtype: torch.dtype
    tokens: int
    parameters: int
    ranks: list[RankMemory]
    device_memory: Optional[float] = None
    activations_from: Optional[str] = None     # None: not known for this model
    max_len: dict[str, int] = field(default_factory=dict)   # scheme -> MaxLen under device_memory
    offload: bool = False                      # every block's stash in host memory (``--offload on``)
    host_memory: Optional[float] = None        # host bytes per rank the offload may hold

    def exceeding(self) -> list[int]:
        """Ranks whose peak is over the device memory (none without one)."""
        if self.device_memory is None:
            return []
        return [r.rank for r in self.ranks if r.peak > self.device_memory]

    def host_exceeding(self) -> list[int]:
        """Ranks whose offloaded activations pass the host budget (none without offload)."""
        if not self.offload or self.host_memory is None:
            return []
        return [r.rank for r in self.ranks if (r.host_activations or 0) > self.host_memory]

    def groups(self) -> list[tuple[list[int], RankMemory]]:
        """Ranks with the same figures together, in order of their first rank."""
        out: dict[tuple, tuple[list[int], RankMemory]] = {}
        for r in self.ranks:
            out.setdefault(r.figures(), ([], r))[0].append(r.rank)
        return list(out.values())

    def to_json(self) -> dict[str, Any]:
        return {"strategy": str(self.strategy), "world_size": self.cluster.world_size,
                "gpus_per_node": self.cluster.gpus_per_node, "dtype": str(self.dtype).replace("torch.", ""),
                "tokens": self.tokens, "parameters": self.parameters, "device_memory": self.device_memory,
                "activations_from": self.activations_from,
                "ranks": [r.to_dict(self.device_memory) for r in self.ranks],
                "exceeding_ranks": self.exceeding(), "max_len": dict(self.max_len),
                "offload": self.offload, "host_memory": self.host_memory,
                "host_exceeding_ranks": self.host_exceeding()}


def stage_activation_bytes(A: float, other: float, hidden: int, layers: int, scheme: Scheme, stage: int,
                           tokens: int) -> int:
    """Bytes a rank of ``stage`` of a ``scheme`` pipeline saves for backward at the 1F1B peak with
    micro-batches of ``tokens`` tokens; ``A``, ``other``: the memory model's
    coefficients for the scheme's TP degree, ``layers``: the stage's."""
    per_layer = A * hidden / (scheme.tp * scheme.seq)   # CP or Ulysses: tokens / degree
    in_flight = scheme.pp - stage
    last = other / scheme.seq if stage == scheme.pp - 1 else 0.0
    return int(round((in_flight * layers * per_layer + last) * tokens))


def stage_offloaded_bytes(A: float, other: float, hidden: int, layers: int, scheme: Scheme, stage: int,
                          tokens: int) -> tuple[int, int]:
    """``stage_activation_bytes`` with every block's stash in host memory (``engine.offload``): the
    bytes left on the device (the rest of the stage and, in a backward, the two layers brought back:
    one in use, one prefetched; the tensors under the offload threshold that stay are not counted),
    and the bytes in host memory."""
    per_layer = A * hidden / (scheme.tp * scheme.seq)
    last = other / scheme.seq if stage == scheme.pp - 1 else 0.0
    host = (scheme.pp - stage) * layers * per_layer * tokens
    return int(round((last + min(layers, 2) * per_layer) * tokens)), int(round(host))


def estimate_memory(compiled: Any, strategy: Strategy, cluster: Cluster, tokens: int, *,
                    device_memory: Optional[float] = None, cost: Any = None,
                    compiled_step: bool = False, offload: bool = False,
                    host_memory: Optional[float] = None) -> MemoryEstimate:
    """Every rank's memory under ``strategy`` for micro-batches of ``tokens`` tokens (module
    docstring); ``cost``: a cost model bounded by ``device_memory`` whose MaxLen of the strategy's
    schemes is reported; ``compiled_step``: the activations a ``--compile`` step keeps (``cost``'s
    must be counted alike); ``offload``: every block offloaded, within ``host_memory`` bytes of host
    memory per rank. Nothing is allocated. Bad strategies are a ``StrategyError``."""
    dtype = compiled.options.working_dtype or torch.float32
    states = rank_states(compiled, strategy, cluster, dtype)
    cfg = compiled.config
    coeffs: dict[int, tuple[float, float]] = {}
    source = None
    if isinstance(cfg, llama.LlamaConfig):
        tps = sorted({p.tp for p in strategy.pipelines})
        if cost is not None and is_runtime_model(cost, compiled) and \
                all(cost.memory.activation_A(tp) is not None for tp in tps):     # counted already
            A, other = cost.memory.activation_coeff, cost.memory.other_coeff
        else:
            sp = compiled.sequence_parallel_status() == "on"
            A, other = measured_activation_coeffs(cfg, tps, dtype=dtype, sequence_parallel=sp,
                                                  compiled_step=compiled_step)
        coeffs = {tp: (a, dict(other).get(tp, 0.0)) for tp, a in A}
        source = "runtime memory model (zoo Llama, counted on fake tensors" + \
            (", compiled step)" if compiled_step else ")")
    ranks = []
    for c in strategy.coords():
        scheme = strategy.pipelines[c.pipeline]
        act = host = None
        if coeffs:
            layers = len(compiled.stage_blocks(scheme.pp)[c.stage])
            if offload:
                act, host = stage_offloaded_bytes(*coeffs[scheme.tp], cfg.hidden_size, layers, scheme, c.stage, tokens)
            else:
                act = stage_activation_bytes(*coeffs[scheme.tp], cfg.hidden_size, layers, scheme, c.stage, tokens)
            if c.stage == scheme.pp - 1:        # the chunked loss's logits of one chunk, while it runs
                act += loss_transient_bytes(cfg.vocab_size, -(-tokens // scheme.seq), scheme.tp, dtype)
        ranks.append(RankMemory(c.rank, c.pipeline, scheme, c.stage, c.tp_rank, c.cp_rank, states[c.rank], act,
                                host))
    parameters = sum(int(torch.Size(p.shape).numel()) for p in compiled.hgraph.params.values())
    max_len = {}
    if cost is not None:
        max_len = {str(p): cost.max_len(p) if cost.has(p) else 0 for p in dict.fromkeys(strategy.pipelines)}
    return MemoryEstimate(strategy, cluster, dtype, tokens, parameters, ranks, device_memory, source, max_len,
                          offload, host_memory if offload else None)
