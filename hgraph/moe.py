"""hgraph's mixture-of-experts op: a top-k softmax router and SwiGLU experts, dropless.

``moe_layer(x, router_weight, *expert_weights, top_k=k, normalize_top_k=...)`` is what the frontends
put in place of a recognised MoE block (``hgraph.frontends.moe_blocks``) and what the zoo's MoE decoder
computes: the routed experts' output ``y``, the shape of ``x`` (shared experts are the block's own dense
code, kept beside this op). It computes each token from that token alone, so it runs on any slice of the
tokens (a CP or Ulysses rank's), and it runs unchanged on a TP rank's slices of the experts (each expert's
gate / up rows and down columns over the same intermediate range): its output is then that rank's partial
sum, which the TP exit after it reduces (``passes/tp_roles``: the op's role EXPERTS). ``moe_layer_with_logits`` also
returns the router's logits ``[tokens, experts]``, which the auxiliary losses read
(``load_balancing_loss``, ``router_z_loss``).

Routing (as Hugging Face's Mixtral / Qwen-MoE routers): ``logits = x @ router_weight^T``, probabilities
``softmax(logits)`` in fp32, the ``top_k`` experts of each token by probability (renormalised to sum
to one when ``normalize_top_k``), the weights cast back to ``x``'s dtype. Dropless: every token reaches
its ``top_k`` experts, whatever their load; there is no capacity factor.

Expert weights come in one of three layouts, told apart by their number and rank:

* ``3 * E`` matrices: ``gate_0 .. gate_{E-1}, up_0 .. up_{E-1}, down_0 .. down_{E-1}``, each as an
  ``nn.Linear`` holds it (gate / up ``[I, H]``, down ``[H, I]``): a ModuleList of expert MLPs;
* three stacked tensors ``gate [E, I, H]``, ``up [E, I, H]``, ``down [E, H, I]``;
* two: ``gate_up [E, 2I, H]`` (gate rows first) and ``down [E, H, I]``, Hugging Face 5.x's fused experts.

The experts' GEMMs run on the token-expert assignments sorted by expert (a stable sort, so a token's
order inside an expert is its order in the batch): ``torch._grouped_mm`` over the whole sorted batch
where the device and dtype support it (``grouped_gemm_supported``), else a loop over the experts (an
expert no token chose runs on zero rows: its weights get an exact-zero gradient on every rank, never
none, so every rank pushes the same parameters whatever its tokens). Both read the same rows in the
same order, and the outputs are scaled by the routing weights and summed into the tokens by one
``index_add_`` in the same order, so they differ only by what the GEMM kernels round differently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.fx import wrap

from hgraph.errors import HGraphError
from hgraph.ops import CommRuntime, reads_host_values

#: the expert GEMM implementations ``moe_layer`` takes: "auto" picks by ``grouped_gemm_supported``
IMPLEMENTATIONS = ("auto", "grouped_mm", "loop")
#: the auxiliary loss forms (``load_balancing_loss``); "document" is the strategy-invariant default
AUX_LOSS_FORMS = ("document", "global", "hf")
_GROUPED_MM_MIN_CAPABILITY = (8, 0)     # torch._grouped_mm's CUDA kernel: SM80 and later (torch >= 2.9)


@dataclass(frozen=True)
class ExpertWeights:
    """The experts' weights in one layout: per-expert ``gate`` / ``up`` ``[I, H]`` and ``down`` ``[H, I]``
    (sequences of E matrices, or views of stacked ``[E, ...]`` tensors) and, for ``torch._grouped_mm``,
    the stacked tensors (None for a list of matrices until asked for)."""

    gate: Sequence[torch.Tensor]
    up: Sequence[torch.Tensor]
    down: Sequence[torch.Tensor]
    stacked: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    def stack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``gate [E, I, H]``, ``up [E, I, H]``, ``down [E, H, I]``."""
        if self.stacked is not None:
            return self.stacked
        return torch.stack(list(self.gate)), torch.stack(list(self.up)), torch.stack(list(self.down))


def expert_layout(weights: Sequence[torch.Tensor]) -> ExpertWeights:
    """The layout of ``moe_layer``'s expert weights (module docstring); a bad count or rank -> HGraphError."""
    n = len(weights)
    if n == 2 and all(w.dim() == 3 for w in weights):
        gate_up, down = weights
        inter = down.shape[-1]
        if gate_up.shape[1] != 2 * inter:
            raise HGraphError(f"moe_layer: fused gate_up {tuple(gate_up.shape)} must hold 2 x {inter} rows "
                              f"(down is {tuple(down.shape)})")
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        return ExpertWeights(gate.unbind(0), up.unbind(0), down.unbind(0), (gate, up, down))
    if n == 3 and all(w.dim() == 3 for w in weights):
        gate, up, down = weights
        return ExpertWeights(gate.unbind(0), up.unbind(0), down.unbind(0), (gate, up, down))
    if n and n % 3 == 0 and all(w.dim() == 2 for w in weights):
        e = n // 3
        return ExpertWeights(tuple(weights[:e]), tuple(weights[e:2 * e]), tuple(weights[2 * e:]), None)
    raise HGraphError(f"moe_layer: expert weights must be 3 x E matrices, three stacked [E, ...] tensors or a "
                      f"fused gate_up and down; got {n} of ranks {[w.dim() for w in weights]}")


def route(logits: torch.Tensor, top_k: int, normalize_top_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[N, k]`` in ``logits``' dtype, experts ``[N, k]``) of the router's ``logits [N, E]``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def grouped_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts here: a CUDA device of compute capability 8.0 or
    more with bf16 (its tensor-core kernel). Elsewhere (CPU, fp32, older GPUs) the per-expert loop runs:
    the CPU kernel of recent torch asks for 16-byte aligned strides that arbitrary widths do not have."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= _GROUPED_MM_MIN_CAPABILITY


def _swiglu_grouped(xs: torch.Tensor, counts: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    gate, up, down = w.stack()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = F.silu(torch._grouped_mm(xs, gate.transpose(-2, -1), offs=offs)) \
        * torch._grouped_mm(xs, up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)


def _swiglu_loop(xs: torch.Tensor, counts: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    pieces = []
    # one split (its backward one concatenation, not a zero-filled gradient of all rows per expert); an
    # expert no token reached runs on no rows: its weights still take part in the backward, with an
    # exact-zero gradient, so every rank pushes every expert's gradient whatever its tokens
    for e, part in enumerate(xs.split(counts.tolist())):
        pieces.append(F.linear(F.silu(F.linear(part, w.gate[e])) * F.linear(part, w.up[e]), w.down[e]))
    return torch.cat(pieces)


def expert_implementation(implementation: str, x: torch.Tensor) -> str:
    """"grouped_mm" or "loop": what ``implementation`` ("auto" or one of them) runs for ``x``."""
    if implementation not in IMPLEMENTATIONS:
        raise HGraphError(f"moe_layer: unknown implementation {implementation!r}; allowed: "
                          f"{', '.join(IMPLEMENTATIONS)}")
    if implementation == "auto":
        return "grouped_mm" if grouped_gemm_supported(x.device, x.dtype) else "loop"
    return implementation


def swiglu_rows(xs: torch.Tensor, counts: torch.Tensor, w: ExpertWeights, implementation: str = "auto") -> torch.Tensor:
    """The experts of ``w`` on rows grouped by expert (``counts[e]`` rows of expert ``e``, in order): the
    grouped GEMM or the loop (``expert_implementation``); the expert-parallel form runs it on the rows
    the dispatch brought (``hgraph.moe_dispatch``)."""
    kind = expert_implementation(implementation, xs)
    return (_swiglu_grouped if kind == "grouped_mm" else _swiglu_loop)(xs, counts, w)


def experts_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w: ExpertWeights,
                    implementation: str = "auto") -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for every token ``t`` of ``x [N, H]``."""
    k = experts.shape[-1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)                 # assignments grouped by expert, tokens in order
    token = order // k
    counts = torch.bincount(flat, minlength=w.num_experts)
    out = swiglu_rows(x.index_select(0, token), counts, w, implementation)
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    return x.new_zeros(x.shape).index_add_(0, token, out)


@wrap
@reads_host_values          # the loop reads the experts' counts on the host: compiled regions leave it eager
def moe_layer(x: torch.Tensor, router_weight: torch.Tensor, *expert_weights: torch.Tensor, top_k: int,
              normalize_top_k: bool = False, implementation: str = "auto",
              comm: Optional[CommRuntime] = None) -> torch.Tensor:
    """The routed experts of an MoE block over ``x [..., H]``: ``y [..., H]`` (module docstring).
    ``implementation``: "auto" (``torch._grouped_mm`` where supported, else the loop), "grouped_mm" or
    "loop". ``comm`` (a rank graph's, given by the instantiation passes): the run's router losses see
    the router's logits (``CommRuntime.moe_router_losses``: they add their gradient to ``y``'s).

    Under expert parallelism (``EP<n>``) a rank's graph runs the op's EP form instead
    (``hgraph.moe_dispatch``, made by ``passes/moe_ep``): its tokens go to the EP ranks holding their
    experts and come back, dropless. That costs, per layer and micro-batch, one all-to-all of the
    per-expert counts read back to the host (the split sizes of the next two), the dispatch all-to-all
    of ``N·k`` rows of the hidden size and the combine all-to-all of as many (both again, reversed, in
    backward), and on the most loaded rank as many received rows as routing sends it. No capacity
    factor is offered: no token is dropped or padded."""
    if torch.compiler.is_exporting():    # torch.export: one opaque node (``exported_moe_layer``)
        return torch.ops.hgraph.moe_layer(x, router_weight, list(expert_weights), top_k, normalize_top_k)
    y, logits = moe_layer_with_logits(x, router_weight, *expert_weights, top_k=top_k,
                                      normalize_top_k=normalize_top_k, implementation=implementation)
    return y if comm is None or x.device.type == "meta" else comm.moe_router_losses(y, logits, top_k)


def moe_layer_with_logits(x: torch.Tensor, router_weight: torch.Tensor, *expert_weights: torch.Tensor, top_k: int,
                          normalize_top_k: bool = False, implementation: str = "auto"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_layer``'s ``y`` and the router's logits ``[N, E]`` (``N`` the tokens of ``x``)."""
    w = expert_layout(expert_weights)
    if router_weight.shape[0] != w.num_experts:
        raise HGraphError(f"moe_layer: the router scores {router_weight.shape[0]} experts but "
                          f"{w.num_experts} are given")
    if not 0 < top_k <= w.num_experts:
        raise HGraphError(f"moe_layer: top_k must be in 1..{w.num_experts}, got {top_k}")
    flat = x.reshape(-1, x.shape[-1])
    logits = F.linear(flat, router_weight)
    if x.device.type == "meta":          # shape propagation on a model built on the meta device: no routing
        return x.new_empty(x.shape), logits
    weights, experts = route(logits, top_k, normalize_top_k)
    return experts_forward(flat, weights, experts, w, implementation).reshape(x.shape), logits


# torch.export cannot trace the routing (data-dependent sizes): under export ``moe_layer`` is this custom
# op, which the export frontend turns back into a call of ``moe_layer`` (its only reader); its fake kernel
# gives the shapes, its CPU kernel the values (without autograd: it never runs in training).
@torch.library.custom_op("hgraph::moe_layer", mutates_args=())
def exported_moe_layer(x: torch.Tensor, router_weight: torch.Tensor, expert_weights: list[torch.Tensor],
                       top_k: int, normalize_top_k: bool) -> torch.Tensor:
    return moe_layer(x, router_weight, *expert_weights, top_k=top_k, normalize_top_k=normalize_top_k).clone()


@exported_moe_layer.register_fake
def _exported_moe_layer_shapes(x, router_weight, expert_weights, top_k, normalize_top_k):
    return x.new_empty(x.shape)


# ---- auxiliary losses -------------------------------------------------------------------------------
# Which form, and why (training adds them through ``runtime/engine/router_losses``: ``[model]
# moe-aux-loss``; off unless asked). The per-document form is the one to choose: it is exact under any
# strategy and any schedule, because a document's counts are complete once its own micro-batch's router
# has run (summed over the CP / Ulysses / sequence-parallel ranks that hold its pieces: one forward-only
# all-reduce of a [documents, E] count matrix among the ranks sharing the micro-batch), so every
# micro-batch's backward has what its gradient needs. The global-batch form needs the counts of every
# micro-batch of the mini-batch before the first backward, which 1F1B does not have (the last
# micro-batches' forwards run after the first backwards), and its gradient does not split per
# micro-batch (it flows through the router's input into everything before it): it is exact only after a
# forward-only counting pass over the whole mini-batch (one more forward per step, about a third more
# compute: what training does, ``runtime/engine/router_losses``) or with every forward before the first
# backward (GPipe's memory). Hugging Face's form (means
# over the tokens as grouped) changes with the micro-batch split and is offered for comparison only.
def expert_counts(experts: torch.Tensor, num_experts: int, segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """How many of each segment's token-expert assignments went to each expert: ``[S, E]`` for the
    ``segments`` (token counts summing to ``N``; None: one segment of all tokens) of ``experts [N, k]``."""
    n = experts.shape[0]
    sizes = [n] if segments is None else list(segments)
    if sum(sizes) != n:
        raise HGraphError(f"expert_counts: segments {sizes} do not cover the {n} tokens")
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=experts.device),
                                  torch.tensor(sizes, device=experts.device))
    index = seg.unsqueeze(-1) * num_experts + experts
    return torch.bincount(index.reshape(-1), minlength=len(sizes) * num_experts).reshape(len(sizes), num_experts)


def load_balancing_loss(logits: torch.Tensor, top_k: int, form: str = "document",
                        documents: Optional[Sequence[int]] = None,
                        counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss ``E * sum_e f_e * P_e`` of router ``logits [N, E]``,
    with ``f_e`` the fraction of the token-expert assignments that chose ``e`` (not differentiated) and
    ``P_e`` the mean router probability of ``e``, in one of three ``form``s:

    * ``"document"``: over each document (``documents``: their token counts, in order), summed over the
      documents. A document's terms need only its own tokens, so no strategy changes it as long as the
      ranks that hold pieces of one document sum its counts (``counts``: ``[D, E]`` already summed);
    * ``"global"``: one ``f`` and ``P`` over all ``N`` tokens (``counts``: ``[1, E]`` over the whole
      mini-batch when the tokens here are a part of it; ``P`` is then this part's probabilities summed and
      divided by the mini-batch's token count: pass ``counts`` and the part's share is exact);
    * ``"hf"``: Hugging Face's ``load_balancing_loss_func``: ``f`` and ``P`` as means over the tokens
      *as grouped here*, so its value depends on how the tokens are split into micro-batches and ranks.
    """
    if form not in AUX_LOSS_FORMS:
        raise HGraphError(f"load_balancing_loss: unknown form {form!r}; allowed: {', '.join(AUX_LOSS_FORMS)}")
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    experts = torch.topk(probs, top_k, dim=-1).indices
    if form == "hf":
        mask = F.one_hot(experts, num_experts).float()          # [N, k, E]
        return num_experts * (mask.mean(0) * probs.mean(0).unsqueeze(0)).sum()
    sizes = [logits.shape[0]] if form == "global" or documents is None else list(documents)
    own = expert_counts(experts, num_experts, sizes)
    counts = own if counts is None else counts
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=logits.device),
                                  torch.tensor(sizes, device=logits.device))
    prob_sums = probs.new_zeros(len(sizes), num_experts).index_add_(0, seg, probs)   # [S, E]
    tokens = counts.sum(-1, keepdim=True).float() / top_k                              # each segment's whole size
    f = counts.float() / (tokens * top_k)
    return num_experts * (f * prob_sums / tokens).sum()


def load_balancing_sum(logits: torch.Tensor, top_k: int, segment: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss as a sum of per-token terms, what training adds to the loss sum:
    ``E * sum_s sum_e f_se * sum_{t in s} p_te`` over the segments (documents) of the tokens here
    (``segment [N]``: each token's segment), with ``f_se = counts[s, e] / (k * n_s)`` from ``counts [S, E]``:
    each segment's assignments counted over all its tokens, wherever they are (``n_s = counts[s].sum() / k``).
    A segment's term is its ``load_balancing_loss`` times its token count: per document, every piece of a
    document (a CP or Ulysses rank's) adds its own tokens' share, so the sum over ranks is the one-device
    value; one segment of a part's own tokens is Hugging Face's form for that part."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    num_experts = logits.shape[-1]
    prob_sums = probs.new_zeros(counts.shape[0], num_experts).index_add_(0, segment, probs)
    f = counts.float() / counts.sum(-1, keepdim=True).clamp(min=1).float()
    return num_experts * (f * prob_sums).sum()


def router_z_loss(logits: torch.Tensor, documents: Optional[Sequence[int]] = None,
                  tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ST-MoE's router z-loss, ``mean_t logsumexp(logits_t)^2``: per document (``documents``: token counts;
    ``tokens``: each document's whole token count when the tokens here are a piece of it) summed over the
    documents, or over all tokens when ``documents`` is None. A sum of per-token terms: any split of the
    tokens gives the same value once each piece is divided by its document's whole size."""
    z = torch.logsumexp(logits.float(), dim=-1).square()
    sizes = [logits.shape[0]] if documents is None else list(documents)
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=logits.device),
                                  torch.tensor(sizes, device=logits.device))
    sums = z.new_zeros(len(sizes)).index_add_(0, seg, z)
    whole = torch.tensor(sizes, dtype=z.dtype, device=z.device) if tokens is None else tokens.to(z.dtype)
    return (sums / whole).sum()
