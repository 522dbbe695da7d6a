"""Analytic prior for the cost model: FLOPs and activation bytes of a Llama-style layer as sympy
polynomials in the sequence length ``l``, turned into ``T(l, P) = a l^2 + b l + c`` and MaxLen for
schemes that were never profiled.

Assumptions (written down because they set the numbers):
- Llama decoder layer: multi-head attention (Q, K, V, O projections, ``4 H^2`` weights), SwiGLU MLP
  with three ``H x F`` matrices, two RMSNorms; causal attention computed by a fused kernel, so its
  matmuls cost ``2 l^2 H`` FLOPs forward (half of ``4 l^2 H``) and no ``l^2`` activations are stored.
- Backward costs twice the forward; no activation recomputation.
- Compute runs at ``device_flops * mfu``; TP uses Megatron sequence parallelism: per layer and per
  forward 2 all-gathers + 2 reduce-scatters of ``l*H`` bf16 values, the same again backward, each
  moving ``(TP-1)/TP`` of the tensor over ``tp_bandwidth`` bytes/s, not overlapped.
- The constant ``c`` is kernel-launch and collective-latency overhead: ``launch_ms_per_layer`` per
  layer on the stage.
- Activations (Korthikanti et al., flash attention, SP): ``34 H / TP`` bytes per token per layer in
  bf16, i.e. ``A = 34``; model states: 12 H^2 parameters per layer at 16 bytes (bf16 param + grad,
  fp32 master, Adam m and v), ``alpha = 12/16`` of which are fully sharded.
- UtilLen: the length at which the constant overhead is 15% of the time (85% efficiency, App. C).
- Ulysses (given ``heads``): all-to-alls at ``tp_bandwidth`` inside a node, ``inter_node_bandwidth``
  across nodes, ``all_to_all_latency_ms`` each (``cost.ulysses``).
- Mixture of experts (given ``experts``, ``cost.moe_cost``): a MoE layer's MLP is its router, the
  ``k`` routed experts and the shared ones of every token (``moe_mlp_flops_per_token``), the leading
  dense layers a plain MLP; a stage is priced as the slower of the first (the dense layers and MoE
  ones) and a stage of MoE layers only. Without EP every rank holds every expert (all of them in the
  model states) and computes its own tokens' copies; activations count the routed copies
  (``moe_activation_bytes_per_token``). EP's all-to-all uses the Ulysses links.
"""
from __future__ import annotations

import math
from typing import Iterable

import sympy as sp

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.cost_model import CostModel, MemoryModel, ModelShape
from hgraph.runtime.planner.cost.moe_cost import ExpertShape, moe_activation_bytes_per_token, moe_mlp_flops_per_token
from hgraph.runtime.planner.cost.ulysses import AllToAll
from hgraph.runtime.planner.schedule.offload import A800_HOST_LINK, HOST_LINK_KEY

L = sp.Symbol("l", positive=True)


def layer_forward_flops(hidden: int, ffn_hidden: int) -> sp.Expr:
    """Forward FLOPs of one decoder layer on ``l`` tokens (polynomial in ``l``)."""
    H, F = sp.Integer(hidden), sp.Integer(ffn_hidden)
    projections = 2 * L * H * (4 * H)  # Q, K, V, O
    attention = 2 * L ** 2 * H  # QK^T and AV, causal half of 4 l^2 H
    mlp = 2 * L * H * F * 3  # gate, up, down
    return sp.expand(projections + attention + mlp)


def moe_layer_forward_flops(hidden: int, experts: ExpertShape) -> sp.Expr:
    """Forward FLOPs of one MoE decoder layer on ``l`` tokens: attention as a dense layer's, the MLP the
    router, the ``k`` routed experts and the shared experts of every token."""
    H = sp.Integer(hidden)
    return sp.expand(2 * L * H * (4 * H) + 2 * L ** 2 * H
                     + L * sp.Integer(int(moe_mlp_flops_per_token(hidden, experts))))


def stage_forward_flops(hidden: int, ffn_hidden: int, layers: int, pp: int, experts: ExpertShape | None) -> sp.Expr:
    """Forward FLOPs of the slowest of ``pp`` stages: ``layers / pp`` dense layers, or for a MoE model
    the slower of the first stage (its dense layers, then MoE ones) and a stage of MoE layers."""
    stage_layers = layers // pp
    dense = layer_forward_flops(hidden, ffn_hidden)
    if experts is None:
        return stage_layers * dense
    moe = moe_layer_forward_flops(hidden, experts)
    first_dense = min(experts.dense_layers, stage_layers)
    first = first_dense * dense + (stage_layers - first_dense) * moe
    rest = stage_layers * moe if pp > 1 else first
    return first if sp.Poly(first - rest, L).coeff_monomial(L) >= 0 else rest


def layer_activation_bytes(hidden: int, tp: int) -> sp.Expr:
    """Activation bytes one layer keeps for backward on ``l`` tokens (bf16, flash attention, SP)."""
    H = sp.Integer(hidden)
    attention_block = 11 * H  # norm input, QKV input, Q/K/V, attention output, projection input
    mlp_block = 19 * H  # norm input, gate/up inputs and outputs, activation, down input
    norms = 4 * H
    return sp.expand(L * (attention_block + mlp_block + norms) / tp)


def layer_tp_comm_bytes(hidden: int, tp: int) -> sp.Expr:
    """Bytes one rank sends per layer for TP with sequence parallelism, forward and backward."""
    if tp == 1:
        return sp.Integer(0)
    per_collective = sp.Rational(tp - 1, tp) * L * hidden * 2
    return sp.expand(8 * per_collective)


def _coeffs(expr: sp.Expr) -> tuple[float, float, float]:
    poly = sp.Poly(expr, L)
    a = float(poly.coeff_monomial(L ** 2))
    b = float(poly.coeff_monomial(L))
    c = float(poly.coeff_monomial(1))
    return a, b, c


def analytic_cost_model(name: str = "analytic", *, hidden: int, layers: int, vocab: int, world_size: int,
                        ffn_hidden: int | None = None, gpus_per_node: int = 8,
                        tps: Iterable[int] = (1, 2, 4, 8), pps: Iterable[int] = (1, 2, 4, 8),
                        device_flops: float = 312e12, mfu: float = 0.5, tp_bandwidth: float = 150e9,
                        launch_ms_per_layer: float = 0.25, gpu_memory_bytes: int = 80 * 2 ** 30,
                        framework_gap_bytes: int = 5 * 2 ** 30, safety_margin_bytes: int = 6 * 2 ** 30,
                        heads: int | None = None, kv_heads: int | None = None,
                        inter_node_bandwidth: float = 10e9, all_to_all_latency_ms: float = 0.03,
                        experts: ExpertShape | None = None) -> CostModel:
    """A CostModel from first principles.

    ``device_flops`` (FLOP/s, bf16 dense) and ``tp_bandwidth`` (bytes/s between TP ranks) describe
    the device; defaults are an A100/A800-class GPU with NVLink. ``heads`` (and ``kv_heads``): the
    attention heads, which allow Ulysses schemes (none without them); ``experts``: a MoE model's experts
    (module docstring; ``ffn_hidden`` is then the dense layers' width).
    """
    if min(hidden, layers, vocab, world_size) < 1 or device_flops <= 0 or tp_bandwidth <= 0 or not 0 < mfu <= 1:
        raise HGraphError("analytic_cost_model: sizes, device_flops and tp_bandwidth must be positive, 0 < mfu <= 1")
    ffn = ffn_hidden if ffn_hidden is not None else int(256 * math.ceil(8 * hidden / 3 / 256))
    profiled: dict[tuple[int, int, int], tuple[float, float, float]] = {}
    util: dict[int, int] = {}
    activation_A: list[tuple[int, float]] = []
    for tp in sorted(set(tps)):
        act = float(sp.Poly(layer_activation_bytes(hidden, tp), L).coeff_monomial(L)) * tp / hidden
        activation_A.append((tp, act if experts is None else _moe_activation_A(act, hidden, layers, experts)))
        for pp in sorted(set(pps)):
            if layers % pp:
                continue
            stage_layers = layers // pp
            compute_ms = 3 * stage_forward_flops(hidden, ffn, layers, pp, experts) / tp / (device_flops * mfu) * 1e3
            comm_ms = stage_layers * layer_tp_comm_bytes(hidden, tp) / tp_bandwidth * 1e3
            overhead_ms = stage_layers * launch_ms_per_layer
            profiled[(tp, pp, 1)] = _coeffs(sp.expand(compute_ms + comm_ms + overhead_ms))
        a, b, c = profiled.get((tp, 1, 1)) or next(v for k, v in profiled.items() if k[0] == tp)
        util[tp] = int(math.ceil(c * 0.85 / (0.15 * b))) if b > 0 else 1
    params_per_layer = 4 * hidden ** 2 + 3 * hidden * ffn
    if experts is not None:     # the average layer, every expert counted (no EP holds all of them)
        moe = experts.moe_layers(layers)
        moe_mlp = hidden * experts.num_experts + 3 * hidden * experts.expert_ffn * (experts.num_experts
                                                                                   + experts.shared_experts)
        params_per_layer = 4 * hidden ** 2 + ((layers - moe) * 3 * hidden * ffn + moe * moe_mlp) / layers
    memory = MemoryModel(
        activation_coeff=tuple(activation_A),
        state_coeff=params_per_layer / hidden ** 2 * 16,
        alpha=12 / 16,
        framework_gap_bytes=framework_gap_bytes,
        safety_margin_bytes=safety_margin_bytes,
        gpu_memory_bytes=gpu_memory_bytes,
    )
    all_to_all = AllToAll(all_to_all_latency_ms, tp_bandwidth, inter_node_bandwidth, 2,
                          "analytic prior (hgraph.runtime.planner.cost.analytic_prior)") if heads else None
    return CostModel(name=name, model=ModelShape(hidden, layers, vocab, heads, kv_heads, experts), profiled=profiled,
                     util_len_tokens=util, memory=memory, world_size=world_size, gpus_per_node=gpus_per_node,
                     all_to_all=all_to_all,
                     extra={"source": "analytic prior (hgraph.runtime.planner.cost.analytic_prior)",
                            "device": {"flops": device_flops, "mfu": mfu, "tp_bandwidth": tp_bandwidth},
                            HOST_LINK_KEY: dict(A800_HOST_LINK)})


def _moe_activation_A(dense_A: float, hidden: int, layers: int, experts: ExpertShape) -> float:
    """``A`` of a MoE model: its layers' average, a MoE layer's MLP block (19 H of a dense layer's 34 H,
    ``layer_activation_bytes``) replaced by the routed copies' (``moe_activation_bytes_per_token``)."""
    moe = experts.moe_layers(layers)
    moe_A = dense_A - 19 + moe_activation_bytes_per_token(hidden, experts) / hidden
    return ((layers - moe) * dense_A + moe * moe_A) / layers
