"""The functions that instantiated per-rank graphs call (``call_function`` targets).

Every communication op takes the rank's communication context ``comm`` as its first argument and
names its peers by a *binding key* (``hgraph.dims.BindingKey``: ``"tp"``, ``"pp_prev"``, ``"pp_next"``,
``"cp"``, ``"ul"``, ``"ep"``) that the context resolves to ranks (``comm.bindings[key]``); that is why ranks of
the same role can share one graph. With ``comm=None`` the graph runs in one process: ops whose group has one rank are the
identity, and anything that really needs a peer raises a clear error.

A collective is an *issue* op followed by a *wait* op, so the schedule is the node order.

The ops that need peers call the method of the same name on ``comm``: the IR names what a graph
needs (``CommRuntime``), the runtime's communication context provides it, and this module imports no
runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch.fx import wrap

from hgraph.dims import BindingKey
from hgraph.errors import HGraphError
from hgraph.varlen_attention import DocumentBounds, allowed_keys, masked_attention, varlen_attention


class CommRuntime(Protocol):
    """What the ops below need of a rank's communication context (``hgraph.runtime.comm.context``)."""

    def pull_issue(self, name: str) -> None: ...
    def pull_wait(self, name: str) -> None: ...
    def push_gradient(self, w: torch.Tensor, name: str, eager: bool) -> torch.Tensor: ...
    def tp_copy(self, x: torch.Tensor, key: BindingKey) -> torch.Tensor: ...
    def tp_reduce_issue(self, x: torch.Tensor, key: BindingKey) -> torch.Tensor: ...
    def tp_gather_issue(self, x: torch.Tensor, key: BindingKey, dim: int,
                        sizes: Optional[Sequence[int]]) -> torch.Tensor: ...
    def wait(self, t: torch.Tensor) -> torch.Tensor: ...
    def pp_recv(self, key: BindingKey, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...
    def pp_send(self, x: torch.Tensor, key: BindingKey) -> torch.Tensor: ...
    def cp_kv_gather_issue(self, x: torch.Tensor, key: BindingKey, dim: int) -> torch.Tensor: ...
    def cp_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                     enable_gqa: bool, dropout_p: float = 0.0, site: int = 0, heads: int = 0,
                     softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor: ...
    def ulysses_heads_issue(self, x: torch.Tensor, key: BindingKey, kv: bool) -> torch.Tensor: ...
    def ulysses_tokens_issue(self, y: torch.Tensor, key: BindingKey) -> torch.Tensor: ...
    def ulysses_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                          enable_gqa: bool, dropout_p: float = 0.0, site: int = 0, heads: int = 0,
                          softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor: ...
    def dropout(self, x: torch.Tensor, p: float, site: int, tokens: Optional[BindingKey] = None) -> torch.Tensor: ...
    def token_slice(self, key: BindingKey, total: int) -> tuple[int, int]: ...
    def document_bounds(self, total: int) -> Optional[DocumentBounds]: ...
    def sp_scatter_issue(self, x: torch.Tensor, key: BindingKey, dim: int) -> torch.Tensor: ...
    def sp_gather_issue(self, x: torch.Tensor, key: BindingKey, dim: int, total: int) -> torch.Tensor: ...
    def sp_linear(self, whole: torch.Tensor, part: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  key: BindingKey, dim: int) -> torch.Tensor: ...
    def output_head(self, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], key: BindingKey,
                    sizes: Optional[Sequence[int]], vocab: Optional[int]) -> Any: ...
    def attention_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, site: int,
                          scale: Optional[float], enable_gqa: bool, heads: int,
                          softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor: ...
    def moe_router_losses(self, y: torch.Tensor, logits: torch.Tensor, top_k: int) -> torch.Tensor: ...
    def moe_split_exchange(self, routing: Any, key: BindingKey) -> Any: ...
    def moe_dispatch_issue(self, routing: Any, splits: Any, key: BindingKey) -> torch.Tensor: ...
    def moe_combine_issue(self, out: torch.Tensor, splits: Any, key: BindingKey) -> torch.Tensor: ...


#: attribute set on an op that reads tensor values on the host to steer Python control flow (packed
#: attention finds its documents from the positions): ``torch.compile`` must not trace it
READS_HOST_VALUES = "hgraph_reads_host_values"


def reads_host_values(fn):
    """Mark ``fn`` as an op the compiled regions of a rank's graph leave eager (``READS_HOST_VALUES``)."""
    setattr(fn, READS_HOST_VALUES, True)
    return fn


def _need_runtime(op: str) -> HGraphError:
    return HGraphError(f"{op} needs peers: run this rank's program under the hgraph runtime "
                       "(a communication context), not as a plain module")


# ---- Pull Parameter / Push Gradient -------------------------------------------------------------
def pull_issue(comm: Optional[CommRuntime], name: str) -> None:
    """Start bringing this rank the slices of parameter ``name`` it needs (LNK), once per iteration."""
    if comm is not None:
        comm.pull_issue(name)


def pull_wait(comm: Optional[CommRuntime], w: torch.Tensor, name: str) -> torch.Tensor:
    """Wait until the working parameter ``w`` holds this iteration's values; returns it."""
    if comm is not None:
        comm.pull_wait(name)
    return w


def to_working_dtype(w: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The cast of the Pull Parameter subgraph (fp32 master -> working precision); no-op if equal."""
    return w if dtype is None or w.dtype == dtype else w.to(dtype)


def push_gradient(comm: Optional[CommRuntime], w: torch.Tensor, name: str, eager: bool) -> torch.Tensor:
    """Identity in forward; in backward the gradient of ``w`` is pushed to the optimizer shard owners.

    ``eager``: issue the push as soon as the last micro-batch finishes the gradient (first PP stage),
    otherwise group it with the other pushes at the end of the step (later stages, inside the bubble).
    """
    if comm is None:
        return w
    return comm.push_gradient(w, name, eager)


# ---- Communicate Activation: tensor parallelism --------------------------------------------------
def tp_copy(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey) -> torch.Tensor:
    """Megatron f: identity forward, all-reduce of the gradient in backward."""
    if comm is None:
        return x
    return comm.tp_copy(x, key)


def tp_reduce_issue(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey) -> torch.Tensor:
    """Megatron g, issue half: start the all-reduce (sum) of ``x`` over the TP group."""
    if comm is None:
        raise _need_runtime("tp_reduce_issue")
    return comm.tp_reduce_issue(x, key)


def tp_gather_issue(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey, dim: int,
                    sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Start the all-gather of ``x`` along ``dim`` over the TP group (uneven ``sizes`` allowed)."""
    if comm is None:
        raise _need_runtime("tp_gather_issue")
    return comm.tp_gather_issue(x, key, dim, sizes)


def comm_wait(comm: Optional[CommRuntime], t: torch.Tensor) -> torch.Tensor:
    """Wait for the collective issued for ``t``; identity for autograd."""
    if comm is None:
        return t
    return comm.wait(t)


# ---- Communicate Activation: sequence parallelism (Megatron SP, ``passes/sequence_parallel``) ----------
#: a received activation's dim holding this TP rank's slice of the micro-batch's ``T`` tokens
SP_TOKENS = "T/tp"


def sp_scatter_issue(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey, dim: int) -> torch.Tensor:
    """SP exit, issue half: start the reduce-scatter (sum) of ``x`` over the TP group ``key`` along the
    token ``dim``; rank ``r`` of ``tp`` keeps tokens ``[T*r//tp, T*(r+1)//tp)``. Backward all-gathers."""
    if comm is None:
        raise _need_runtime("sp_scatter_issue")
    return comm.sp_scatter_issue(x, key, dim)


def sp_gather_issue(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey, dim: int,
                    input_ids: torch.Tensor) -> torch.Tensor:
    """SP enter, issue half: start the all-gather of the TP ranks' token slices along ``dim`` (the whole
    micro-batch: ``input_ids``' tokens). Backward reduce-scatters the gradient."""
    if comm is None:
        raise _need_runtime("sp_gather_issue")
    return comm.sp_gather_issue(x, key, dim, input_ids.shape[1])


def sp_linear(comm: Optional[CommRuntime], whole: torch.Tensor, part: torch.Tensor, w: torch.Tensor,
              b: Optional[torch.Tensor], key: BindingKey, dim: int) -> torch.Tensor:
    """A column-parallel linear of the all-gathered ``whole`` (``sp_gather_issue`` of ``part``): the same
    ``F.linear(whole, w, b)``, keeping only this rank's token slice ``part`` for backward (Megatron), the
    weight's gradient gathering it again."""
    if comm is None:
        return F.linear(whole, w, b)
    return comm.sp_linear(whole, part, w, b, key, dim)


def sp_narrow(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey, dim: int) -> torch.Tensor:
    """This TP rank's slice of the tokens of a whole (replicated) value, where it meets a sliced one."""
    if comm is None:
        return x
    lo, hi = comm.token_slice(key, x.shape[dim])
    return x.narrow(dim, lo, hi - lo)


def whole_shape(x: torch.Tensor, dim: int, input_ids: torch.Tensor, index: Optional[int] = None) -> Any:
    """``x.shape`` (or ``x.size(index)``) of a token-sliced ``x`` as if it held the whole micro-batch."""
    shape = list(x.shape)
    shape[dim] = input_ids.shape[1]
    return torch.Size(shape) if index is None else shape[index]


@wrap
def vocab_parallel_embedding(ids: torch.Tensor, w: torch.Tensor, lo: int, hi: int,
                             padding_idx: Optional[int] = None) -> torch.Tensor:
    """Look up the rows [lo, hi) held by this rank; other ids give zeros (summed by the TP all-reduce).

    ``padding_idx`` (a row of the whole vocabulary, as ``F.embedding`` takes it) gets no gradient on
    the rank that holds it, as in the unsharded embedding.
    """
    inside = (ids >= lo) & (ids < hi)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    local_padding = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else None
    out = F.embedding(local, w, padding_idx=local_padding)
    return out * inside.unsqueeze(-1).to(out.dtype)


# ---- Communicate Activation: pipeline parallelism ------------------------------------------------
def _resolve_shape(dims: Sequence[Any], input_ids: torch.Tensor,
                   comm: Optional[CommRuntime] = None) -> list[int]:
    sym = {"B": input_ids.shape[0], "T": input_ids.shape[1]}
    if SP_TOKENS in dims and comm is not None:
        lo, hi = comm.token_slice(BindingKey.TP, input_ids.shape[1])
        sym[SP_TOKENS] = hi - lo
    return [sym[d] if isinstance(d, str) else int(d) for d in dims]


def pp_recv(comm: Optional[CommRuntime], key: BindingKey, index: int, dims: Sequence[Any], dtype: torch.dtype,
            input_ids: torch.Tensor) -> torch.Tensor:
    """Receive activation ``index`` of this micro-batch from the previous stage.

    Its shape comes from the plan (``dims`` with ``"B"``/``"T"`` taken from ``input_ids``, ``SP_TOKENS``:
    this TP rank's slice of ``T``), so no shape message is exchanged. In backward, the gradient is sent
    back to the previous stage.
    """
    if comm is None:
        raise _need_runtime("pp_recv")
    return comm.pp_recv(key, _resolve_shape(dims, input_ids, comm), dtype)


def pp_send(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey, index: int) -> torch.Tensor:
    """Send activation ``index`` to the next stage; returns a token whose backward receives dL/dx."""
    if comm is None:
        raise _need_runtime("pp_send")
    return comm.pp_send(x, key)


# ---- attention ------------------------------------------------------------------------------------
def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                     scale: Optional[float] = None, enable_gqa: bool = False, softcap: Optional[float] = None,
                     window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of one sequence per row with what SDPA cannot say: logit ``softcap`` and a
    sliding ``window`` (``hgraph.varlen_attention``). The frontends write attention that needs either
    as this op (otherwise as ``F.scaled_dot_product_attention(..., is_causal=True)``); the packed
    attention pass makes it per document like SDPA. ``dropout_p`` drops probabilities as SDPA does."""
    pos = torch.arange(query.shape[-2], device=query.device)
    return masked_attention(query, key, value, allowed_keys(pos, pos, window), scale, enable_gqa, softcap, dropout_p)


@reads_host_values
def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor,
                     scale: Optional[float] = None, enable_gqa: bool = False, softcap: Optional[float] = None,
                     window: Optional[int] = None, comm: Optional[CommRuntime] = None) -> torch.Tensor:
    """Causal attention inside each document of a packed row, none across documents (with the logit
    ``softcap`` and sliding ``window`` of ``causal_attention`` when given).

    A one-row micro-batch run by the runtime takes its documents from ``comm`` (known on the host,
    so the GPU is never waited for); otherwise they are found from ``position_ids``: a document
    starts where its position is 0 (and at the start of the row). A row holding one document is plain
    causal SDPA.
    """
    B, T = q.shape[0], q.shape[-2]
    known = comm.document_bounds(T) if comm is not None and B == 1 else None
    pos = position_ids.expand(B, T)
    plain = softcap is None and window is None
    rows = []
    for b in range(B):
        if known is not None:
            cu, bounds = known, known.cu
        else:
            starts = (pos[b] == 0).nonzero().flatten().tolist()
            cu = bounds = sorted({0, *starts}) + [T]
        qb, kb, vb = q[b:b + 1], k[b:b + 1], v[b:b + 1]
        if len(bounds) == 2 and plain:
            rows.append(F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                                       enable_gqa=enable_gqa))
        else:
            rows.append(varlen_attention(qb, kb, vb, cu, scale=scale, enable_gqa=enable_gqa, softcap=softcap,
                                         window=window))
    return rows[0] if B == 1 else torch.cat(rows, dim=0)


# ---- Communicate Activation: context parallelism --------------------------------------------------
def cp_kv_gather_issue(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey, dim: int) -> torch.Tensor:
    """Start the all-gather of keys / values along the sequence ``dim`` over the CP group.

    The piece sizes come from this micro-batch's CP layout (``comm.cp_layout``); the backward
    reduce-scatters the gradient.
    """
    if comm is None:
        raise _need_runtime("cp_kv_gather_issue")
    return comm.cp_kv_gather_issue(x, key, dim)


def cp_attention(comm: Optional[CommRuntime], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: Optional[float] = None, enable_gqa: bool = False, dropout_p: float = 0.0, site: int = 0,
                 heads: int = 0, softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor:
    """Attention of this CP rank's queries against the gathered keys, per document and causal (with
    dropout on the probabilities when ``dropout_p``: see ``packed_attention_dropout``; ``softcap`` and
    ``window`` as in ``causal_attention``)."""
    if comm is None:
        raise _need_runtime("cp_attention")
    return comm.cp_attention(q, k, v, scale, enable_gqa, dropout_p, site, heads, softcap, window)


def ulysses_heads_issue(comm: Optional[CommRuntime], x: torch.Tensor, key: BindingKey, kv: bool = False) -> torch.Tensor:
    """Ulysses, issue half: start the all-to-all over the group ``key`` of ``x`` [1, H, T_local, D] (this
    rank's tokens) into [1, H / n, T_shard, D] (every token of the rank's CP shard, this rank's chunk of
    the heads); ``comm_wait`` gives it. ``kv``: key / value heads, repeated when ``n`` does not divide
    them (query heads must divide)."""
    if comm is None:
        raise _need_runtime("ulysses_heads_issue")
    return comm.ulysses_heads_issue(x, key, kv)


def ulysses_tokens_issue(comm: Optional[CommRuntime], y: torch.Tensor, key: BindingKey) -> torch.Tensor:
    """The inverse all-to-all, issued: [1, H / n, T_shard, D] -> (after ``comm_wait``) [1, H, T_local, D]."""
    if comm is None:
        raise _need_runtime("ulysses_tokens_issue")
    return comm.ulysses_tokens_issue(y, key)


def ulysses_attention(comm: Optional[CommRuntime], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: Optional[float] = None, enable_gqa: bool = False, dropout_p: float = 0.0,
                      site: int = 0, heads: int = 0, softcap: Optional[float] = None,
                      window: Optional[int] = None) -> torch.Tensor:
    """Attention of a Ulysses rank between its all-to-alls: ``q`` [1, H / n, T_shard, D], every token of
    its CP shard with its chunk of the heads, per document and causal; against the CP group's gathered
    ``k``/``v`` when the scheme has CP, else against ``k``/``v`` of the shard (the whole micro-batch).
    Dropout as in ``packed_attention_dropout`` (``heads``: the model's query heads); ``softcap`` and
    ``window`` as in ``causal_attention``."""
    if comm is None:
        raise _need_runtime("ulysses_attention")
    return comm.ulysses_attention(q, k, v, scale, enable_gqa, dropout_p, site, heads, softcap, window)


# ---- Communicate Activation: expert parallelism (``hgraph.moe_dispatch``) -----------------------------
def moe_split_exchange(comm: Optional[CommRuntime], routing: Any, key: BindingKey) -> Any:
    """The count exchange of the MoE dispatch: an all-to-all over the EP group ``key`` of ``routing``'s
    per-expert counts (``moe_dispatch.ExpertRouting``), read back to the host: the rows this rank sends
    to and receives from each EP rank (``moe_dispatch.ExpertSplits``)."""
    if comm is None:
        raise _need_runtime("moe_split_exchange")
    return comm.moe_split_exchange(routing, key)


def moe_dispatch_issue(comm: Optional[CommRuntime], routing: Any, splits: Any, key: BindingKey) -> torch.Tensor:
    """The MoE dispatch, issue half: start the variable-size all-to-all over the EP group ``key`` of the
    sorted assignments' rows (``routing.rows``) to the EP ranks holding their experts; ``comm_wait``
    gives the rows this rank's experts run on. Backward: the reversed all-to-all of their gradients."""
    if comm is None:
        raise _need_runtime("moe_dispatch_issue")
    return comm.moe_dispatch_issue(routing, splits, key)


def moe_combine_issue(comm: Optional[CommRuntime], out: torch.Tensor, splits: Any, key: BindingKey) -> torch.Tensor:
    """The MoE combine, issue half: start the all-to-all that takes the experts' outputs ``out`` back to
    the EP ranks their tokens came from (the dispatch's inverse); backward: the reversed all-to-all."""
    if comm is None:
        raise _need_runtime("moe_combine_issue")
    return comm.moe_combine_issue(out, splits, key)


# ---- dropout -----------------------------------------------------------------------------------------
def keyed_dropout(x: torch.Tensor, p: float, comm: Optional[CommRuntime] = None, site: int = 0,
                  tokens: Optional[BindingKey] = None) -> torch.Tensor:
    """Dropout of a token-major activation ``[1, T, ...]`` whose masks depend on what each element is
    (document, position, feature, site, step), never on the strategy (``runtime/kernels/dropout``).
    The frontends turn a model's train-mode dropout into this op; the dropout pass gives it ``comm``
    and its ``site`` (and ``tokens``, the TP group key, when ``x`` holds that TP rank's slice of the tokens
    under sequence parallelism). Without a runtime (``comm=None``) it is the identity, as in eval mode."""
    if comm is None or p == 0.0:
        return x
    return comm.dropout(x, p, site, tokens)


def packed_attention_dropout(comm: Optional[CommRuntime], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             p: float, site: int, scale: Optional[float] = None, enable_gqa: bool = False,
                             heads: int = 0, softcap: Optional[float] = None,
                             window: Optional[int] = None) -> torch.Tensor:
    """``packed_attention`` with SDPA's ``dropout_p`` on the probabilities, masks keyed per (document,
    head, query position, key position); ``heads``: the model's query heads (a TP rank holds a slice)."""
    if comm is None:
        raise _need_runtime("packed_attention_dropout")
    return comm.attention_dropout(q, k, v, p, site, scale, enable_gqa, heads, softcap, window)


# ---- the output head -----------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadInputs:
    """What a last stage returns instead of logits when the runtime computes the loss from the output
    head's inputs (chunk by chunk, never the whole ``[tokens, vocab]`` logits): the head's input
    ``hidden`` ``[..., H]``, this rank's ``weight`` rows ``[rows, H]`` (and ``bias``), which hold the
    vocabulary rows ``[vocab_start, vocab_start + vocab_local)`` of ``vocab`` (the rest is TP padding),
    and the TP ranks holding the vocabulary's pieces in order (``()`` when this rank holds it whole)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    vocab_start: int
    vocab_local: int
    vocab: int
    piece_ranks: tuple[int, ...] = ()


def cut_vocab(logits: torch.Tensor, vocab: Optional[int]) -> torch.Tensor:
    """The logits of the real vocabulary (TP padding rows cut off)."""
    return logits if vocab is None or logits.shape[-1] == vocab else logits.narrow(-1, 0, vocab)


def output_head(comm: Optional[CommRuntime], h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                key: BindingKey = BindingKey.TP, sizes: Optional[Sequence[int]] = None, vocab: Optional[int] = None) -> Any:
    """The model's output head ``F.linear(h, w, b)``: the logits, gathered over the TP group ``key``
    when the vocabulary is split (``sizes``: each rank's rows, padding included) and cut to the real
    ``vocab``. The runtime may instead take the head's inputs (``HeadInputs``, ``comm.output_head``)
    and compute the loss without ever holding the whole logits."""
    if comm is None:
        if sizes is not None and len(sizes) > 1:
            raise _need_runtime("output_head")
        return cut_vocab(F.linear(h, w, b), vocab)
    return comm.output_head(h, w, b, key, sizes, vocab)
