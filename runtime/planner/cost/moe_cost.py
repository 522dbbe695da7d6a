"""Mixture-of-experts terms of the cost model: expert FLOPs, the all-to-all per EP degree, expert memory
per EP rank and routing imbalance.

**Shape** (``ExpertShape``, read from the model's config by ``expert_shape_of``, never from a table of
names): ``E`` routed experts of width ``F`` (``moe_intermediate_size``), ``k`` of them per token, ``S``
shared experts (one SwiGLU of width ``S F`` every token runs), and the first ``dense_layers`` layers
dense (a plain MLP of width ``dense_ffn``). A MoE layer has a router ``H x E`` and ``3 H F`` weights per expert.

**Expert FLOPs** (``routed_flops_per_token``): a token's forward through its ``k`` routed experts is
``2 * 3 H F * k`` FLOPs, the shared experts ``2 * 3 H F * S`` and the router ``2 H E``; backward twice
that. Under ``EP n`` the routed copies of the EP group's tokens are split over its ``n`` ranks, each
sharded over TP inside; a CP or Ulysses rank holds ``1/seq`` of its replica's tokens.

**All-to-all** (``all_to_all_bytes_per_token``): per MoE layer a rank sends its tokens' ``k`` copies
to their experts (dispatch) and receives them back (combine), forward and backward: 4 exchanges of
``H x bytes x k`` per token, ``(n - 1)/n`` of which leave the rank. A TP rank sends its
sequence-parallel slice (``1/TP`` of its tokens); a CP or Ulysses rank its ``1/seq``. The exchange
runs over the intra-node bandwidth when the EP group's ranks sit in one node (the rank layout puts EP
outside TP, UL and CP: the group spans ``stride(EP) x n`` consecutive ranks), else inter-node
(``ulysses.AllToAll``: measured by ``--profile measure``, else the prior's). Its time is not
overlapped with compute: ``ep_terms``.

**Routing imbalance** (``routing_imbalance``): the most loaded EP rank sets a layer's time. A rank
holds ``E/n`` experts; with ``T`` tokens each choosing ``k`` distinct experts at random, the copies a
rank receives are a sum of ``T`` hypergeometric draws: mean ``T k / n`` and variance
``T k (1/n)(1 - 1/n)(E - k)/(E - 1)``; the expected maximum of ``n`` such loads is about
``mean + sigma * sqrt(2 ln n)``, and the factor is that over the mean. A measured factor (a profile's
``model.experts.imbalance``: ``ExpertShape.imbalance``) replaces it: real routers are less even than random.

**Memory** (``expert_state_bytes``): an EP rank holds the working weights and gradients of its ``E/n``
experts of its stage's MoE layers (sharded over TP); the optimizer's masters and moments stay in the
fixed layout, ``1/N`` per rank for every strategy (nothing here changes them). The routed tokens'
activations (``moe_activation_bytes_per_token``) are the ``k`` copies' expert inputs and SwiGLU
intermediates, on the rank that computes them.

**An EP micro-batch** (``ep_microbatch_ms``): its documents are split over the ``n`` EP replicas by
``split_documents`` (the runtime's own split); each replica runs attention, the dense parts and the
shared experts on its documents, and the all-to-all of its tokens; the routed experts run the group's
copies, ``imbalance x k x tokens / n`` on the busiest rank. The micro-batch costs its slowest replica
plus the routed experts (the all-to-all synchronises the group at every MoE layer). Its even split
(``EpTerms.surrogate``: every replica ``1/n`` of the work, no imbalance) never exceeds that and is the
scheme's ``coeffs``, which the latency bounds read; the dispatch balances documents by
``EpTerms.balancing`` (a document's attention whole on its replica, the linear work shared), and the
packer deals them onto replica slots by it but prices each candidate micro-batch by ``ep_microbatch_ms``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hgraph import dims
from hgraph.errors import HGraphError
from hgraph.strategy import Scheme

ALL_TO_ALLS_PER_MOE_LAYER = 4      # dispatch and combine, forward and backward


@dataclass(frozen=True)
class ExpertShape:
    """The experts of a MoE model (module docstring): ``num_experts`` routed experts of width
    ``expert_ffn``, ``top_k`` per token, ``shared_experts`` shared ones (width ``shared_experts *
    expert_ffn``), the first ``dense_layers`` layers dense (an MLP of width ``dense_ffn``); ``imbalance``: a measured routing
    imbalance factor (None: the multinomial default)."""

    num_experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0
    imbalance: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_ffn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HGraphError(f"experts: {name} must be a positive integer, got {v!r}")
        for name in ("shared_experts", "dense_layers", "dense_ffn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise HGraphError(f"experts: {name} must be a non-negative integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise HGraphError(f"experts: top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.imbalance is not None and not self.imbalance >= 1:
            raise HGraphError(f"experts: imbalance must be >= 1 (the busiest rank over the mean), got {self.imbalance!r}")

    def moe_layers(self, layers: int) -> int:
        return max(layers - self.dense_layers, 0)

    def ep_degrees(self, limit: int) -> list[int]:
        """EP degrees ``2..limit`` that split the experts evenly (``n`` divides ``E``)."""
        return [n for n in range(2, min(limit, self.num_experts) + 1) if self.num_experts % n == 0]

    def to_dict(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "top_k": self.top_k, "expert_ffn": self.expert_ffn,
                "shared_experts": self.shared_experts, "dense_layers": self.dense_layers, "dense_ffn": self.dense_ffn,
                **({"imbalance": self.imbalance} if self.imbalance is not None else {})}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "ExpertShape":
        keys = ("num_experts", "top_k", "expert_ffn")
        if not isinstance(d, dict) or any(k not in d for k in keys):
            raise HGraphError(f"{where}: model.experts needs the keys {', '.join(keys)}")
        try:
            return cls(int(d["num_experts"]), int(d["top_k"]), int(d["expert_ffn"]), int(d.get("shared_experts", 0)),
                       int(d.get("dense_layers", 0)), int(d.get("dense_ffn", 0)),
                       float(d["imbalance"]) if d.get("imbalance") is not None else None)
        except (TypeError, ValueError) as exc:
            raise HGraphError(f"{where}: malformed model.experts value ({exc})") from None


def expert_shape_of(config: Any) -> Optional[ExpertShape]:
    """The experts of a model config (the zoo's ``LlamaMoeConfig`` names, and Hugging Face's
    ``num_experts_per_tok``); None for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not experts:
        return None
    top_k = getattr(config, "top_k", None) or getattr(config, "num_experts_per_tok", None)
    width = getattr(config, "moe_intermediate_size", None)
    if not top_k or not width:
        raise HGraphError(f"a model with {experts} experts needs top_k (or num_experts_per_tok) and "
                          "moe_intermediate_size in its config for the cost model")
    shared = getattr(config, "num_shared_experts", None) or getattr(config, "n_shared_experts", None) or 0
    dense = getattr(config, "first_dense_layers", None) or getattr(config, "first_k_dense_replace", None) or 0
    ffn = getattr(config, "intermediate_size", None) or 0
    return ExpertShape(int(experts), int(top_k), int(width), int(shared), int(dense), int(ffn))


# ---- FLOPs ----------------------------------------------------------------------------------------
def routed_flops_per_token(hidden: int, shape: ExpertShape) -> float:
    """Forward FLOPs of one token through its ``k`` routed experts in one MoE layer."""
    return 2.0 * 3 * hidden * shape.expert_ffn * shape.top_k


def moe_mlp_flops_per_token(hidden: int, shape: ExpertShape) -> float:
    """Forward FLOPs of one token through a MoE layer's MLP: router, routed and shared experts."""
    return 2.0 * hidden * shape.num_experts + routed_flops_per_token(hidden, shape) \
        + 2.0 * 3 * hidden * shape.expert_ffn * shape.shared_experts


def routed_share(hidden: int, layers: int, shape: ExpertShape) -> float:
    """The routed experts' share of a stage's per-token (linear) FLOPs: what of a scheme's ``b`` the EP
    group splits (the rest, attention's projections, dense MLPs, shared experts and router, each
    replica runs on its own tokens)."""
    projections = 2.0 * hidden * 4 * hidden
    moe = shape.moe_layers(layers)
    dense = layers - moe
    total = layers * projections + moe * moe_mlp_flops_per_token(hidden, shape) + dense * 2.0 * 3 * hidden * shape.dense_ffn
    return moe * routed_flops_per_token(hidden, shape) / total if total > 0 else 0.0


# ---- all-to-all -----------------------------------------------------------------------------------
def all_to_all_bytes_per_token(hidden: int, shape: ExpertShape, *, tp: int, seq: int, ep: int,
                               bytes_per_element: int) -> float:
    """Bytes one rank sends per MoE layer per token of its replica's micro-batch: dispatch and combine,
    forward and backward, ``(ep - 1)/ep`` of the ``k`` copies leaving the rank; 0 without EP."""
    if ep == 1:
        return 0.0
    return ALL_TO_ALLS_PER_MOE_LAYER * hidden * bytes_per_element * shape.top_k * (ep - 1) / ep / (tp * seq)


def ep_intra_node(ep_span: int, gpus_per_node: int) -> bool:
    """Whether an EP group whose ranks span ``ep_span`` consecutive ranks sits in one node."""
    return ep_span <= gpus_per_node


# ---- routing imbalance ----------------------------------------------------------------------------
def routing_imbalance(tokens: float, shape: ExpertShape, ep: int) -> float:
    """The busiest EP rank's routed copies over the mean for ``tokens`` tokens routed in one EP group of
    ``ep`` ranks (module docstring): the measured factor when the shape has one, else the expected
    maximum of the random (hypergeometric per token) loads; 1 without EP or without tokens."""
    if ep <= 1 or tokens <= 0:
        return 1.0
    if shape.imbalance is not None:
        return shape.imbalance
    E, k = shape.num_experts, shape.top_k
    mean = tokens * k / ep
    var = tokens * k * (1 / ep) * (1 - 1 / ep) * ((E - k) / (E - 1) if E > 1 else 0.0)
    return 1.0 + math.sqrt(var) * math.sqrt(2 * math.log(ep)) / mean


# ---- memory ---------------------------------------------------------------------------------------
def expert_params_per_layer(hidden: int, shape: ExpertShape) -> int:
    """Routed experts' parameters of one MoE layer (``3 H F`` each)."""
    return 3 * hidden * shape.expert_ffn * shape.num_experts


def expert_state_bytes(hidden: int, shape: ExpertShape, *, stage_moe_layers: int, tp: int, ep: int,
                       bytes_per_param: float) -> float:
    """Working weights and gradients (``bytes_per_param`` together) of the ``E/ep`` experts an EP rank
    holds in its stage's MoE layers, sharded over TP."""
    return stage_moe_layers * expert_params_per_layer(hidden, shape) / ep / tp * bytes_per_param


def ep_states_saved(hidden: int, layers: int, shape: ExpertShape, *, pp: int, tp: int, ep: int,
                    bytes_per_param: float) -> float:
    """The replicated model-state bytes an EP rank does not hold beside a rank of the same scheme
    without EP: all but ``1/ep`` of its stage's experts (the slowest stage's ``ceil(moe layers / PP)``)."""
    stage = math.ceil(shape.moe_layers(layers) / pp)
    return expert_state_bytes(hidden, shape, stage_moe_layers=stage, tp=tp, ep=1, bytes_per_param=bytes_per_param) \
        - expert_state_bytes(hidden, shape, stage_moe_layers=stage, tp=tp, ep=ep, bytes_per_param=bytes_per_param)


def moe_activation_bytes_per_token(hidden: int, shape: ExpertShape, bytes_per_element: int = 2) -> float:
    """Activation bytes one MoE layer's MLP keeps per token (all TP ranks together): for each of the
    ``k`` routed copies and the shared experts, the expert's input row, its gate and up outputs, the
    activation and the down projection's input (``H + 4F``); the router's input and probabilities."""
    per_copy = hidden + 4 * shape.expert_ffn
    shared = (hidden + 4 * shape.expert_ffn * shape.shared_experts) if shape.shared_experts else 0
    return (shape.top_k * per_copy + shared + hidden + shape.num_experts) * bytes_per_element


# ---- one EP micro-batch ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EpTerms:
    """What one EP micro-batch's price needs (ms): the base scheme's ``a`` and its ``b`` without the
    routed experts (``rest_b``, per replica token), the routed experts' ``routed_b`` per token of the
    group on one rank without EP, the all-to-all's ``comm_b`` per replica token and the constant ``c``
    (the base's plus the all-to-alls' latencies)."""

    ep: int
    a: float
    rest_b: float
    routed_b: float
    comm_b: float
    c: float

    @property
    def balancing(self) -> tuple[float, float, float]:
        """``(a, b, c)`` the dispatch and the packer balance: a document's attention on one replica
        (``a`` whole: a long document is not split, the runtime's split keeps documents whole) and the
        linear work spread over the ``ep`` replicas. Neither bound nor exact: the packer's candidate
        micro-batches and the strategies are compared by ``ep_microbatch_ms``."""
        n = self.ep
        return self.a, (self.rest_b + self.routed_b + self.comm_b) / n, self.c

    @property
    def surrogate(self) -> tuple[float, float, float]:
        """``(a, b, c)`` of the even split: every replica ``1/ep`` of the work, no imbalance. It never
        exceeds ``ep_microbatch_ms`` (a max is at least the mean, the imbalance at least 1), so the
        dispatch, packing and lower bounds read it as the scheme's coefficients."""
        n = self.ep
        return self.a / n, (self.rest_b + self.routed_b + self.comm_b) / n, self.c


def ep_terms(base: tuple[float, float, float], *, hidden: int, layers: int, shape: ExpertShape, pp: int, tp: int,
             seq: int, ep: int, intra_node: bool, comm: Any) -> EpTerms:
    """The terms of a ``<TP, PP, CP, UL>`` scheme with ``EP ep`` from the base scheme's ``(a, b, c)``:
    the routed experts' part of ``b`` (``routed_share``), the all-to-all of the slowest stage's
    ``ceil(moe layers / PP)`` MoE layers over ``comm`` (a ``ulysses.AllToAll``, intra- or inter-node)
    and its latencies."""
    a, b, c = base
    routed_b = b * routed_share(hidden, layers, shape)
    stage_moe = math.ceil(shape.moe_layers(layers) / pp)
    per_token = all_to_all_bytes_per_token(hidden, shape, tp=tp, seq=seq, ep=ep, bytes_per_element=comm.bytes_per_element)
    comm_b = stage_moe * per_token / comm.bytes_per_s(intra_node) * 1e3
    latency = stage_moe * ALL_TO_ALLS_PER_MOE_LAYER * comm.latency_ms if ep > 1 else 0.0
    return EpTerms(ep, a, b - routed_b, routed_b, comm_b, c + latency)


def ep_schemes(bases: dict, *, hidden: int, layers: int, shape: Optional[ExpertShape], comm: Any,
               gpus_per_node: int, world_size: int, max_ep: Optional[int]) -> tuple[dict, dict]:
    """The EP schemes of every base scheme: degrees dividing the experts up to ``max_ep`` (None: a node),
    within ``world_size``; their coefficients (``EpTerms.surrogate``) and terms. The all-to-all runs
    intra-node when the group's ``stride(EP) x n`` consecutive ranks fit a node. None without experts
    or an all-to-all model."""
    if shape is None or comm is None:
        return {}, {}
    coeffs, terms = {}, {}
    for base, abc in bases.items():
        for n in shape.ep_degrees(max_ep if max_ep is not None else gpus_per_node):
            s = Scheme(base.tp, base.pp, base.cp, base.ul, n)
            if s.num_ranks > world_size:
                break
            terms[s] = ep_terms(abc, hidden=hidden, layers=layers, shape=shape, pp=s.pp, tp=s.tp, seq=s.seq, ep=n,
                                intra_node=ep_intra_node(s.stride(dims.EP) * n, gpus_per_node), comm=comm)
            coeffs[s] = terms[s].surrogate
    return coeffs, terms


def ep_microbatch_ms(lengths: np.ndarray, terms: EpTerms, shape: ExpertShape, split) -> float:
    """One EP micro-batch (module docstring): its slowest replica under ``split`` (the runtime's
    ``split_documents``) plus the busiest rank's routed experts."""
    lengths = np.asarray(lengths, dtype=np.float64)
    total = float(lengths.sum())
    slowest = 0.0
    for part in split([int(x) for x in lengths], terms.ep):
        ls = lengths[list(part)]
        slowest = max(slowest, float(np.sum(terms.a * ls * ls + (terms.rest_b + terms.comm_b) * ls)))
    routed = routing_imbalance(total, shape, terms.ep) * terms.routed_b * total / terms.ep
    return slowest + routed + terms.c
