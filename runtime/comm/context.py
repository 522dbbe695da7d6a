"""The communication context of one rank: what its graphs' ops need, every field declared.

The per-rank graphs call the op vocabulary of ``hgraph.ops`` with this context as their ``comm``
argument; each op that needs peers calls the method of the same name here (the ``CommRuntime``
protocol of ``hgraph.ops``), which resolves the graph's binding key (``hgraph.dims.BindingKey``:
``"tp"``, ``"pp_prev"``, ...) to ranks and runs the collective of ``hgraph.runtime.comm.collectives``.

A context is immutable. The executor builds one per Program and rank with its fixed state
(``bindings``, ``param_sync``, the loss settings); what changes per micro-batch (its CP layout, its
dropout keys, which blocks recompute or offload, its view of the activation meter, whether it is an evaluation)
enters through ``for_microbatch``, a view with those values that shares the rank's fixed state and
its work in flight. A graph runs with its micro-batch's view as its ``comm`` input, so whatever
keeps it (the autograd of a collective, a recomputed block's replay) sees that micro-batch's values
without anything being saved and restored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hgraph import moe_dispatch, ops
from hgraph.dims import BindingKey
from hgraph.errors import HGraphError
from hgraph.runtime.comm import collectives, issuing
from hgraph.runtime.comm.issuing import InFlight, PendingWork
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.kernels import cp_attention as cp_kernel, dropout as dropout_kernel
from hgraph.runtime.kernels.cp_attention import CPLayout
from hgraph.runtime.kernels.dropout import TokenKeys
from hgraph.runtime.kernels.ulysses_layout import UlyssesLayout
from hgraph.shard_rule import shard_bounds
from hgraph.varlen_attention import DocumentBounds, varlen_attention


class ParamExchangeOps(Protocol):
    """What the Pull Parameter / Push Gradient ops ask of the Program's engine (``comm/param_sync.ParamSync``)."""

    def pull_issue(self, name: str) -> None: ...
    def pull_wait(self, name: str) -> None: ...
    def push_gradient(self, w: torch.Tensor, name: str, eager: bool) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class CommContext:
    """Everything a rank's comm ops need: who it is, its groups, the Program's fixed state, the
    micro-batch's values (on a ``for_microbatch`` view), and the work still in flight."""

    rank: int
    world_size: int
    groups: GroupCache
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    comm_stream: Optional[torch.cuda.Stream] = None   # the dedicated CUDA stream of collectives (None on CPU)
    bindings: Mapping[BindingKey, Sequence[int]] = field(default_factory=dict)   # role key -> ranks, per program
    param_sync: Optional[ParamExchangeOps] = None  # the Pull / Push engine of the program being run
    head_inputs: bool = False                     # the output head returns its inputs (chunked loss)
    vocab_parallel_loss: bool = True              # a split vocabulary's loss: Megatron's, or chunks gathered
    router_losses: Any = None                     # the run's MoE router losses (``engine/router_losses``), or None
    # the rank's one choke point for what it issues (its order and record), shared by every view
    issuer: CollectiveIssuer = field(default_factory=CollectiveIssuer, repr=False)
    # the micro-batch's own values: set on the view ``for_microbatch`` gives
    cp_layout: Optional[CPLayout | UlyssesLayout] = None   # its tokens' layout (CP > 1 or UL > 1)
    documents: Optional[DocumentBounds] = None    # its documents' boundaries (host and device), CP 1
    token_keys: Optional[TokenKeys] = None        # what its tokens are (dropout masks)
    recompute_layers: Optional[frozenset] = None  # layers whose blocks recompute in it
    offload: Any = None                           # its offloaded blocks (``engine.offload``), or None
    activation_meter: Any = None                  # its view of the saved-tensor accounting (``engine/recompute``)
    evaluating: bool = False                      # a forward-only evaluation: dropout is the identity
    defer_sends: bool = False                     # its activation sends go with the next backward's receive
    num_targets: int = 0                          # the mini-batch's targets (the losses' normalisation)
    in_flight: InFlight = field(default_factory=InFlight, repr=False)

    @classmethod
    def single(cls, device: Optional[torch.device] = None, **fixed: Any) -> "CommContext":
        """A context for one process without a process group (every TP op is the identity)."""
        return cls(0, 1, GroupCache(0, 1), device=torch.device(device or "cpu"), **fixed)

    @classmethod
    def from_default_group(cls, device: Optional[torch.device] = None,
                           groups: Optional[GroupCache] = None, **fixed: Any) -> "CommContext":
        """A context for this process of the initialised default group (comm stream on CUDA)."""
        device = torch.device(device or "cpu")
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        return cls(dist.get_rank(), dist.get_world_size(), groups or GroupCache(), device=device,
                   comm_stream=stream, **fixed)

    def for_microbatch(self, *, cp_layout: Optional[CPLayout] = None, token_keys: Optional[TokenKeys] = None,
                       recompute_layers: Optional[frozenset] = None, evaluating: bool = False,
                       documents: Optional[DocumentBounds] = None, offload: Any = None,
                       activation_meter: Any = None, defer_sends: bool = False,
                       num_targets: int = 0) -> "CommContext":
        """The context one micro-batch's graph runs with: this context's fixed state and work in
        flight, with the micro-batch's own values (``defer_sends``: a backward follows its forward,
        whose gradient receive carries its activation sends, ``collectives.flush_deferred``)."""
        return replace(self, cp_layout=cp_layout, token_keys=token_keys, recompute_layers=recompute_layers,
                       evaluating=evaluating, documents=documents, offload=offload,
                       activation_meter=activation_meter, defer_sends=defer_sends, num_targets=num_targets)

    # ---- work in flight ---------------------------------------------------------------------------
    def register(self, t: torch.Tensor, pending: PendingWork) -> None:
        self.in_flight.pending[id(t)] = (t, pending)

    def take(self, t: torch.Tensor) -> Optional[PendingWork]:
        entry = self.in_flight.pending.get(id(t))
        if entry is None or entry[0] is not t:
            return None
        del self.in_flight.pending[id(t)]
        return entry[1]

    def detach_work(self, pending: PendingWork) -> None:
        self.in_flight.detached.append(pending)

    def num_pending(self) -> int:
        """Issued ops not waited yet (forward issues plus backward sends)."""
        return (sum(not p.done for _, p in self.in_flight.pending.values())
                + sum(not p.done for p in self.in_flight.detached))

    def wait_all(self) -> None:
        """Wait for every op still in flight (end of a step)."""
        collectives.flush_deferred(self)      # none are left in 1F1B: a backward follows every deferring forward
        for _, pending in self.in_flight.pending.values():
            pending.wait(self)
        for pending in self.in_flight.detached:
            pending.wait(self)
        self.in_flight.pending.clear()
        self.in_flight.detached.clear()

    # ---- the ops of hgraph.ops that need peers (its CommRuntime protocol) ---------------------------
    def ranks(self, key: BindingKey) -> tuple[int, ...]:
        """The ranks a graph's binding key names for the program being run."""
        return tuple(self.bindings[key])

    def pull_issue(self, name: str) -> None:
        self.param_sync.pull_issue(name)

    def pull_wait(self, name: str) -> None:
        self.param_sync.pull_wait(name)

    def push_gradient(self, w: torch.Tensor, name: str, eager: bool) -> torch.Tensor:
        return self.param_sync.push_gradient(w, name, eager)

    def tp_copy(self, x: torch.Tensor, key: BindingKey) -> torch.Tensor:
        return collectives.tp_copy_issue(self, x, self.ranks(key))

    def tp_reduce_issue(self, x: torch.Tensor, key: BindingKey) -> torch.Tensor:
        return collectives.tp_reduce_issue(self, x, self.ranks(key))

    def tp_gather_issue(self, x: torch.Tensor, key: BindingKey, dim: int,
                        sizes: Optional[Sequence[int]]) -> torch.Tensor:
        return collectives.tp_gather_issue(self, x, self.ranks(key), dim, list(sizes) if sizes else None)

    def moe_router_losses(self, y: torch.Tensor, logits: torch.Tensor, top_k: int) -> torch.Tensor:
        """``y`` of an MoE op, with the run's router losses of its ``logits`` attached (none: ``y``)."""
        return y if self.router_losses is None else self.router_losses.add(self, y, logits, top_k)

    def moe_split_exchange(self, routing: moe_dispatch.ExpertRouting, key: BindingKey) -> moe_dispatch.ExpertSplits:
        """The MoE dispatch's counts exchanged over the EP group ``key`` and read back to the host, both
        vectors in one read (the one host round trip of the dropless exchange per layer and micro-batch)."""
        ranks = tuple(sorted(self.ranks(key)))          # the group's order: the process group's
        index, n = ranks.index(self.rank), len(ranks)
        bounds = moe_dispatch.expert_bounds(routing.num_experts, n)
        mine = bounds[index][1] - bounds[index][0]
        received = collectives.expert_counts_exchange(self, routing.counts, ranks, [b - a for a, b in bounds],
                                                      [mine] * n)
        # NCCL's all_to_all_single takes its split sizes on the host: this read-back (the compute stream
        # waits for the counts) is what the dropless exchange costs per layer and micro-batch; split sizes
        # that stay on the device (an all-to-all-v over torch's symmetric memory) would remove it, later
        host = torch.cat([routing.counts, received]).tolist()
        return moe_dispatch.exchange_splits(host[:routing.num_experts], host[routing.num_experts:], n, index)

    def moe_dispatch_issue(self, routing: moe_dispatch.ExpertRouting, splits: moe_dispatch.ExpertSplits,
                           key: BindingKey) -> torch.Tensor:
        return collectives.expert_rows_issue(self, routing.rows, sorted(self.ranks(key)), splits.send, splits.recv,
                                             "moe_dispatch")

    def moe_combine_issue(self, out: torch.Tensor, splits: moe_dispatch.ExpertSplits, key: BindingKey) -> torch.Tensor:
        return collectives.expert_rows_issue(self, out, sorted(self.ranks(key)), splits.recv, splits.send,
                                             "moe_combine")

    def token_slice(self, key: BindingKey, total: int) -> tuple[int, int]:
        """Tokens ``[lo, hi)`` of ``total`` this rank holds under sequence parallelism over group ``key``."""
        ranks = self.ranks(key) if key in self.bindings else (self.rank,)
        return shard_bounds(total, ranks.index(self.rank), len(ranks))

    def document_bounds(self, total: int) -> Optional[DocumentBounds]:
        """The micro-batch's document boundaries when they span ``total`` tokens (packed attention's
        row), else None (the op then finds them from the positions)."""
        known = self.documents
        return known if known is not None and known.cu[-1] == total else None

    def sp_scatter_issue(self, x: torch.Tensor, key: BindingKey, dim: int) -> torch.Tensor:
        return collectives.sp_scatter_issue(self, x, self.ranks(key), dim)

    def sp_gather_issue(self, x: torch.Tensor, key: BindingKey, dim: int, total: int) -> torch.Tensor:
        return collectives.sp_gather_issue(self, x, self.ranks(key), dim, total)

    def sp_linear(self, whole: torch.Tensor, part: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  key: BindingKey, dim: int) -> torch.Tensor:
        return collectives.sp_gathered_linear(self, whole, part, w, b, self.ranks(key), dim)

    def wait(self, t: torch.Tensor) -> torch.Tensor:
        return issuing.comm_wait(self, t)

    def pp_recv(self, key: BindingKey, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        (src,) = self.ranks(key)
        return collectives.pp_recv(self, src, tuple(shape), dtype)

    def pp_send(self, x: torch.Tensor, key: BindingKey) -> torch.Tensor:
        (dst,) = self.ranks(key)
        return collectives.pp_send(self, x, dst)

    def cp_kv_gather_issue(self, x: torch.Tensor, key: BindingKey, dim: int) -> torch.Tensor:
        """All-gather of K or V over the CP group ``key``: pieces of the CP shards' sizes (under
        Ulysses, of the head slices the all-to-all gave: every token of this rank's shard)."""
        layout = self._cp_layout("cp_kv_gather_issue")
        sizes = (layout.shards if isinstance(layout, UlyssesLayout) else layout).sizes
        return collectives.cp_gather_issue(self, x, self.ranks(key), dim, sizes)

    def cp_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                     enable_gqa: bool, dropout_p: float = 0.0, site: int = 0, heads: int = 0,
                     softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor:
        layout = self._cp_layout("cp_attention")
        if not dropout_p or self.evaluating:
            return cp_kernel.cp_attention(q, k, v, layout, scale, enable_gqa, softcap, window)
        keys = self._token_keys("cp_attention")
        groups = dropout_kernel.cp_groups(layout, keys, q.device, window)
        return dropout_kernel.attention_with_dropout(q, k, v, groups, dropout_p, site, keys, scale, enable_gqa,
                                                     self._head_offset(q.shape[1], heads), softcap)

    def ulysses_heads_issue(self, x: torch.Tensor, key: BindingKey, kv: bool) -> torch.Tensor:
        """Ulysses: start the all-to-all of this rank's tokens with all its heads into every token of its
        CP shard with ``1/n`` of the heads (group ``key``). Key/value heads not divisible by ``n`` are
        repeated first (each the least number of times that makes them divisible), so every rank holds
        the key/value heads its query heads read."""
        layout = self._ulysses_layout("ulysses_heads_issue")
        n, heads = layout.ul, x.shape[1]
        if heads % n and not kv:
            raise HGraphError(f"Ulysses UL{n}: this rank's {heads} query heads do not divide by {n}; "
                              "the model's query heads must divide by TP x UL")
        if heads % n:
            x = x.repeat_interleave(n // math.gcd(heads, n), dim=1)
        return collectives.ulysses_to_heads_issue(self, x, self.ranks(key), layout.sizes)

    def ulysses_tokens_issue(self, y: torch.Tensor, key: BindingKey) -> torch.Tensor:
        layout = self._ulysses_layout("ulysses_tokens_issue")
        return collectives.ulysses_to_tokens_issue(self, y, self.ranks(key), layout.sizes)

    def ulysses_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                          enable_gqa: bool, dropout_p: float = 0.0, site: int = 0, heads: int = 0,
                          softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor:
        """Attention between the all-to-alls: the CP shard's queries with this rank's chunk of the heads,
        per document, against the shard's keys or (with CP, USP's 2-D) the keys the ``"cp"`` group
        gathered (the ranks holding the same heads), as a CP rank's queries attend. Dropout masks are
        keyed by (document, global head, query position, key position), as on one device."""
        layout = self._ulysses_layout("ulysses_attention")
        shards = layout.shards
        gqa = enable_gqa or q.shape[1] != k.shape[1]
        if dropout_p and not self.evaluating:
            keys = self._token_keys("ulysses_attention").of_packed(layout.shard_tokens, shards.doc_of,
                                                                   shards.pos_of)
            part = q.shape[1]             # this rank's chunk of the TP rank's query heads
            offset = self._head_offset(part * layout.ul, heads) + layout.ul_rank * part
            groups = dropout_kernel.cp_groups(shards, keys, q.device, window)
            return dropout_kernel.attention_with_dropout(q, k, v, groups, dropout_p, site, keys, scale, gqa,
                                                         offset, softcap)
        if shards.cp > 1:
            return cp_kernel.cp_attention(q, k, v, shards, scale, gqa, softcap, window)
        docs = self.documents
        if docs is None or docs.cu[-1] != len(shards.doc_of):
            raise HGraphError("ulysses_attention needs the whole micro-batch's documents: run this "
                              "rank's program under the hgraph executor")
        return varlen_attention(q, k, v, docs, scale=scale, enable_gqa=gqa, softcap=softcap, window=window)

    def dropout(self, x: torch.Tensor, p: float, site: int, tokens: Optional[BindingKey] = None) -> torch.Tensor:
        """Keyed dropout of ``x``; ``tokens``: the TP group key when ``x`` holds this rank's token slice."""
        if self.evaluating:
            return x
        keys = self._token_keys("dropout")
        if tokens is not None:
            keys = keys.narrow(*self.token_slice(tokens, keys.documents.numel()))
        return dropout_kernel.dropout(x, p, site, keys)

    def attention_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, site: int,
                          scale: Optional[float], enable_gqa: bool, heads: int, softcap: Optional[float] = None,
                          window: Optional[int] = None) -> torch.Tensor:
        keys = self._token_keys("attention dropout")
        p = 0.0 if self.evaluating else p         # the same attention, no probability dropped
        groups = dropout_kernel.packed_groups(keys, q.device, window)
        return dropout_kernel.attention_with_dropout(q, k, v, groups, p, site, keys, scale, enable_gqa,
                                                     self._head_offset(q.shape[1], heads), softcap)

    def output_head(self, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], key: BindingKey,
                    sizes: Optional[Sequence[int]], vocab: Optional[int]) -> Any:
        """The logits of the output head, or with ``head_inputs`` its inputs (``ops.HeadInputs``):
        this rank's vocabulary rows start after the pieces of the TP ranks before it."""
        split = sizes is not None and len(sizes) > 1
        if self.head_inputs:
            rows = int(w.shape[0])
            if not split:
                return ops.HeadInputs(h, w, b, 0, rows if vocab is None else min(rows, int(vocab)),
                                      rows if vocab is None else int(vocab))
            ranks = self.ranks(key)
            if len(set(sizes)) != 1:
                raise HGraphError(f"output head: the vocabulary's TP pieces {list(sizes)} must be equal "
                                  "(shard_tp pads it to a multiple of TP)")
            start = rows * ranks.index(self.rank)
            whole = int(vocab) if vocab is not None else rows * len(ranks)
            return ops.HeadInputs(h, w, b, start, max(0, min(rows, whole - start)), whole, tuple(ranks))
        logits = F.linear(h, w, b)
        if split:
            logits = self.wait(self.tp_gather_issue(logits, key, -1, sizes))
        return ops.cut_vocab(logits, vocab)

    def _head_offset(self, local: int, heads: int) -> int:
        """The global index of this rank's first query head (a TP rank holds an equal slice)."""
        if not heads or local == heads:
            return 0
        tp = self.ranks(BindingKey.TP) if BindingKey.TP in self.bindings else (self.rank,)
        if local * len(tp) != heads:
            raise HGraphError(f"attention dropout: {local} local heads of {heads} over TP{len(tp)}")
        return tp.index(self.rank) * local

    def _token_keys(self, op: str) -> TokenKeys:
        if self.token_keys is None:
            raise HGraphError(f"{op} needs this micro-batch's token keys: run this rank's program under the "
                              "hgraph executor")
        return self.token_keys

    def _ulysses_layout(self, op: str) -> UlyssesLayout:
        layout = self.cp_layout
        if not isinstance(layout, UlyssesLayout):
            raise HGraphError(f"{op} needs this micro-batch's Ulysses layout: run this rank's program under "
                              "the hgraph executor")
        return layout

    def _cp_layout(self, op: str) -> CPLayout | UlyssesLayout:
        if self.cp_layout is None:
            raise HGraphError(f"{op} needs this micro-batch's CP layout: run this rank's program under "
                              "the hgraph executor")
        return self.cp_layout
