"""Every rank's collective sequence of one step, derived from the Program and a plan (no process runs).

``derive_step(program, plan)`` returns ``{rank: [Collective, ...]}`` in the order the runtime issues
them on that rank (``runtime/engine/executor``):

1. **Pull** (entering ``ParamSync.step``'s ``SyncStep``): the all-gather buckets (``pull.gather_buckets``, model order,
   inside the shard group; all-to-alls on gloo), then the point-to-point rounds of the LNK transfers
   (``pull.pull_message_rounds``: round ``k`` is one ``batch_isend_irecv`` of bucket ``k`` of every peer).
2. **Micro-batches in 1F1B** (``order.pipeline.one_f_one_b``). A forward issues the graph's
   collectives in node order (a pipeline receive, TP / sequence-parallel / CP / Ulysses collectives,
   the MoE count exchange, dispatch and combine all-to-alls under EP, a send), preceded by the recomputation agreement (an all-reduce of the stage's TP x CP ranks) under
   a memory budget (in 1F1B's steady state, a forward followed by a backward sends its activations
   with that backward's first gradient receive, one batch), and followed on a last stage by the loss's collectives over the TP group of a
   split vocabulary (per chunk of tokens: the logits all-gathered, forward and backward, in fp32;
   three all-reduces, forward only, with the vocabulary-parallel loss that is training's default
   below fp32). A backward runs autograd's order: the CPU engine runs the ready node
   created last, which is the reverse of the forward's creation order, so the collectives of the
   nodes' backwards come in reverse node order (the loss's first); a recomputed block replays its
   forward collectives where its backward begins (non-reentrant checkpoint unpacks then). An MoE
   op under per-document load balancing all-reduces its routing counts over the Ulysses then the CP
   group in forward (``comm/moe_counts``), replayed with its block; under global-batch load balancing
   a counting pass precedes the 1F1B: every micro-batch's forward (no loss, no agreement, sends not
   deferred), then one int64 all-reduce of the counts over the world (``engine/router_losses``).
3. **Push buckets** (``grad_buckets.GradBuckets``, their one global order, keyed by where backward
   completes a bucket): with the push in the backward, during the last backward a bucket is issued once its gradients are final (a parameter's
   gradient is final after the backward of its first use in node order: ``AccumulateGrad`` runs
   first among ready nodes) and every bucket before it was issued, but not one over a group holding an
   earlier stage of the rank's pipeline (a tied weight's) nor any after it; ``flush`` issues the rest.
4. The loss's all-reduce over the world (3 float64 values with MoE router losses: theirs ride on
   it), the push's point-to-point rounds (``push.push_message_rounds``), under ``--shard-group`` the all-reduces of the shards among the rank's replicas, and with
   global-norm clipping the norm's all-reduce inside the shard group. Under the overlapped update
   (plain data parallelism) instead: no loss reduction at the end (it rides in the first bucket, or
   past ``CARRY_MAX_BYTES`` takes an all-reduce of its own just before it), and with a
   prefetch the next step's all-gathers, each posted once a bucket taken one behind the newest
   completes its parameters (``OverlappedUpdate``), and none at the next step's pull.

The sequences equal what every rank records at run time (``CollectiveIssuer``) in every step of the
equivalence suites (``tests/runtime/engine/test_executor_equivalence``: kind, group, dtype, peers).

Ranks of one role and micro-batch count issue the same activation collectives up to their groups:
a role's sequence is derived once (``_RoleSteps``) and each rank maps its binding keys to its groups.
Collectives of a group of one rank are the identity and do not appear. The rank's part of the
Program (``Program.rank``: its bindings and its own LNK ops) is all a rank's sequence reads.

The plan (``StepPlan``) says what the Program alone does not: the micro-batches of each pipeline,
their tokens, whether blocks recompute, the backend (gloo runs gathers and reduce-scatters as
all-to-alls), whether the push runs in the backward, clipping. ``representative_plan`` gives each
pipeline ``k`` micro-batches and, with several pipelines, the last one none.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch.fx as fx

from hgraph import ops
from hgraph.moe_dispatch import MOE_OUTPUTS
from hgraph.dims import BindingKey
from hgraph.meta import CommPoint, TPRole, get_meta
from hgraph.program import Program, RankProgram
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES, GradBuckets
from hgraph.runtime.comm.order.collective import Collective
from hgraph.runtime.comm.order.pipeline import one_f_one_b
from hgraph.runtime.comm.overlapped_update import CARRY_MAX_BYTES, is_plain_data_parallel
from hgraph.runtime.comm.pull import (DEFAULT_PULL_BUCKET_BYTES, GLOO_PULL_BUCKET_BYTES, gather_buckets,
                                      pull_message_rounds)
from hgraph.runtime.comm.push import push_message_rounds, spans_earlier_stages
from hgraph.runtime.comm.moe_counts import token_holder_keys
from hgraph.runtime.kernels.head_cross_entropy import chunk_tokens
from hgraph.shard_rule import group_shard_bounds, replica_ranks, shard_group_ranks
from hgraph.strategy import Strategy

BACKENDS = ("nccl", "gloo")
#: the MoE load-balancing forms (``[model] moe-aux-loss``, ``engine/router_losses.AUX_LOSS_FORMS``)
MOE_AUX_LOSSES = ("none", "per-document", "hf", "global-batch")

def _expert_parallel_ops() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The MoE op's exchanges under EP (``hgraph.moe_dispatch``, ``passes/moe_ep``), over the ``"ep"``
    binding: the count all-to-all (forward only: counts have no gradient; int64, ``_OP_DTYPES``), the
    dispatch and the combine all-to-alls, each with the reversed all-to-all in backward (the combine's
    first: reverse node order). A recomputed block replays all three forwards with its other collectives."""
    return {"moe_split_exchange": (("all_to_all",), ()),
            "moe_dispatch_issue": (("all_to_all",), ("all_to_all",)),
            "moe_combine_issue": (("all_to_all",), ("all_to_all",))}


#: the ops whose collectives move something other than activations of the working dtype
_OP_DTYPES = {"moe_split_exchange": "int64"}

#: per op of the rank graphs that talks to peers: the collectives its forward issues and those its
#: backward issues (``runtime/comm/collectives``: Megatron f / g, all-gathers whose gradient is
#: reduce-scattered, the sequence-parallel linear's weight gradient, Ulysses all-to-alls, PP messages,
#: the MoE exchanges under EP)
_OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tp_copy": ((), ("all_reduce",)),
    "tp_reduce_issue": (("all_reduce",), ()),
    "tp_gather_issue": (("all_gather",), ()),
    "sp_gather_issue": (("all_gather",), ("reduce_scatter",)),
    "cp_kv_gather_issue": (("all_gather",), ("reduce_scatter",)),
    "sp_scatter_issue": (("reduce_scatter",), ("all_gather",)),
    "sp_linear": ((), ("all_gather",)),
    "ulysses_heads_issue": (("all_to_all",), ("all_to_all",)),
    "ulysses_tokens_issue": (("all_to_all",), ("all_to_all",)),
    "pp_recv": (("recv",), ("send",)),
    "pp_send": (("send",), ("recv",)),
    **_expert_parallel_ops(),
}
_PASS_THROUGH = {"push_gradient", "pull_wait", "to_working_dtype"}     # a parameter's slot nodes
#: nodes whose backward reads no saved tensor: a recomputed block's backward runs them before the
#: first node that does, whose unpack replays the block (views, adds, the collectives but the
#: sequence-parallel linear, which keeps its input slice)
_SAVES_NOTHING = (_PASS_THROUGH | set(_OPS) - {"sp_linear"}) | {
    "add", "sub", "neg", "getitem", "getattr", "view", "reshape", "transpose", "permute", "contiguous",
    "comm_wait", "to", "unsqueeze", "squeeze", "flatten", "expand", "cat", "chunk", "split", "whole_shape",
    "pull_issue", "iadd"}


@dataclass(frozen=True)
class StepPlan:
    """What one step does besides its Program: ``microbatches[i]`` micro-batches of ``tokens`` tokens
    on pipeline ``i`` (0: it runs none and pushes zeros); ``recompute``: a memory budget is set and
    every block recomputes (what a first step does: the agreement all-reduce per forward and each
    block's replay in backward); ``backend``; ``push_in_backward`` (None: as the runtime does on every backend;
    False: ``overlap_push`` off); ``grad_clip``: global-norm clipping; ``vocab_parallel_loss`` (None: the trainer's ``auto``, on below
    fp32); ``overlap_update``: the optimizer update overlapped with the backward (None: where the
    executor runs it, ``ParamSync.can_overlap_update``: plain data parallelism, the push in the
    backward, no clipping; any backend), then ``prefetched``: the last step pulled this one's all-gathers, and
    ``prefetch``: this step pulls the next one's (``derive_steps`` sets both from the schedule);
    ``moe_aux_loss``: the MoE load-balancing form a run adds (``[model] moe-aux-loss``, "none" when off
    or its coefficient is 0) and ``moe_z_loss``: the router z-loss (``engine/router_losses``)."""

    microbatches: tuple[int, ...]
    tokens: int = 32
    recompute: bool = False
    backend: str = "nccl"
    push_in_backward: Optional[bool] = None
    grad_clip: bool = False
    vocab_parallel_loss: Optional[bool] = None
    working_dtype: str = "float32"
    pull_bucket_bytes: Optional[int] = None
    push_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap_update: Optional[bool] = None
    prefetched: bool = False
    prefetch: bool = False
    moe_aux_loss: str = "none"
    moe_z_loss: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: expected one of {list(BACKENDS)}")
        if any(m < 0 for m in self.microbatches) or self.tokens < 1:
            raise ValueError(f"plan: micro-batch counts {list(self.microbatches)} must be >= 0 and tokens >= 1")
        if self.moe_aux_loss not in MOE_AUX_LOSSES:
            raise ValueError(f"moe_aux_loss {self.moe_aux_loss!r}: expected one of {list(MOE_AUX_LOSSES)}")

    @property
    def gloo(self) -> bool:
        return self.backend == "gloo"

    @property
    def parallel_loss(self) -> bool:
        return self.working_dtype != "float32" if self.vocab_parallel_loss is None else self.vocab_parallel_loss

    @property
    def in_backward(self) -> bool:
        return True if self.push_in_backward is None else self.push_in_backward

    @property
    def loss_values(self) -> int:
        """The values of the loss's all-reduce: the loss, and the two router losses when a run adds any."""
        return 3 if self.moe_aux_loss != "none" or self.moe_z_loss else 1

    def describe(self) -> str:
        counts = sorted(set(self.microbatches), reverse=True)
        per = ", ".join(f"{k} on {self.microbatches.count(k)}" for k in counts)
        return (f"micro-batches per pipeline: {per} pipeline(s), {self.tokens} tokens each"
                + (", every block recomputed" if self.recompute else "")
                + f", {self.backend}, push {'in' if self.in_backward else 'after'} the backward"
                + (", clipping" if self.grad_clip else "")
                + (f", MoE load balancing {self.moe_aux_loss}" if self.moe_aux_loss != "none" else "")
                + (", MoE z-loss" if self.moe_z_loss else ""))


def representative_plan(strategy: Strategy, k: Optional[int] = None, idle: bool = True, **options: Any) -> StepPlan:
    """Every pipeline gets ``k`` micro-batches (default: the deepest pipeline's stages, so every stage
    reaches 1F1B's steady state), and with several pipelines the last one none (a pipeline without a
    micro-batch still pulls and pushes)."""
    n = len(strategy.pipelines)
    k = max(p.pp for p in strategy.pipelines) if k is None else k
    counts = [k] * n
    if idle and n > 1:
        counts[-1] = 0
    return StepPlan(tuple(counts), **options)


# ---- a role's activation collectives -----------------------------------------------------------------
@dataclass(frozen=True)
class _Event:
    """One collective of a role's step, by binding key (``key`` "world" / "stage" for the loss's and
    the agreement's groups); ``final``: parameters whose gradients are final at this point of the last
    backward (no collective)."""

    kind: str = ""
    key: str = ""
    label: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    final: tuple[str, ...] = ()
    carries: tuple[str, ...] = ()      # a gradient receive: the keys of the deferred sends it carries


def _target(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else ""


def _arg(node: fx.Node, name: str) -> Any:
    """Argument ``name`` of a call of an ``hgraph.ops`` function (bound by its signature)."""
    fn = getattr(ops, _target(node))
    bound = inspect.signature(fn).bind_partial(*node.args, **node.kwargs)
    return bound.arguments.get(name)


@dataclass
class _RoleGraph:
    """What a role's graph does with peers, read once: the forward's collectives per node (with the
    node's layer when it lies in a block that may recompute), the backward's, the parameters whose
    gradient is final after each node's backward, and the loss's collectives."""

    forward: list = field(default_factory=list)     # [(node index, layer or None, [_Event])]
    backward: dict = field(default_factory=dict)    # node index -> [_Event]
    finals: dict = field(default_factory=dict)      # node index -> [parameter]
    head: Optional[tuple[str, int, bool]] = None    # (key, vocabulary rows of this rank, split)


def _read_graph(rp: RankProgram, plan: StepPlan) -> _RoleGraph:
    graph = rp.graph_module.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = _RoleGraph()
    dtype = plan.working_dtype
    for i, n in enumerate(nodes):
        t = _target(n)
        if t in _OPS:
            fwd, bwd = _OPS[t]
            key = _arg(n, "key")
            meta = get_meta(n)
            layer = None if meta.comm_point == CommPoint.PP_BOUNDARY else meta.layer
            label, moved = f"{t} {n.name}", _OP_DTYPES.get(t, dtype)
            if fwd:
                out.forward.append((i, layer, [_Event(k, key, label, moved) for k in fwd]))
            if bwd:
                out.backward[i] = [_Event(k, key, f"{label} backward", moved) for k in bwd]
        elif n.target in MOE_OUTPUTS and plan.moe_aux_loss == "per-document":   # under EP: its weighted sum
            # the document counts summed over the ranks holding the micro-batch's other tokens, forward only
            # (``router_losses._sum_over_token_holders``): replayed with the block when it recomputes
            out.forward.append((i, get_meta(n).layer, [_Event("all_reduce", key, f"moe counts {key}", "int64")
                                                       for key in _token_holders(rp, n)]))
        elif t == "output_head":
            sizes = _arg(n, "sizes")
            w = _arg(n, "w")
            rows = _param_rows(rp, w)
            out.head = (_arg(n, "key") or BindingKey.TP, rows, sizes is not None and len(sizes) > 1)
        if n.op == "get_attr" and n.target in rp.params:
            first = _first_use(n, index)
            if first is not None:
                out.finals.setdefault(first, []).append(n.target)
    return out


def _token_holders(rp: RankProgram, node: fx.Node) -> list[str]:
    """The groups an MoE op's per-document counts are summed over: the dimensions that split tokens
    (CP, Ulysses) and the TP group when the op runs on a TP rank's token slice (experts whole under
    sequence parallelism: ``passes/sequence_parallel``)."""
    graph_sp = any(_target(m) in ("sp_gather_issue", "sp_scatter_issue") for m in rp.graph_module.graph.nodes)
    sliced = rp.scheme.tp > 1 and graph_sp and get_meta(node).tp_role != TPRole.EXPERTS
    return [k for k in token_holder_keys(sliced) if k in rp.bindings]


def _param_rows(rp: RankProgram, node: fx.Node) -> int:
    """The rows of the parameter reaching ``node`` through its slot nodes."""
    while node is not None and node.op != "get_attr":       # past the casts and slot nodes, not ``comm``
        node = next((a for a in node.args if hasattr(a, "op") and a.op != "placeholder"), None)
    shard = rp.params.get(node.target) if node is not None else None
    return int(shard.shard_shape[0]) if shard is not None and shard.shard_shape else 1


def _first_use(node: fx.Node, index: Mapping[Any, int]) -> Optional[int]:
    """The first node (graph order) that computes with the parameter of ``get_attr`` ``node`` (past its
    slot nodes, which pass it through): its gradient is final after that node's backward."""
    users, frontier = [], [node]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if _target(u) in _PASS_THROUGH:
                frontier.append(u)
            else:
                users.append(index[u])
    return min(users) if users else None


class _RoleSteps:
    """The events of one role's step for a number of micro-batches, derived once and shared by the
    role's ranks."""

    def __init__(self, rp: RankProgram, plan: StepPlan) -> None:
        self.rp, self.plan = rp, plan
        self.graph = _read_graph(rp, plan)
        self._cache: dict[int, list[_Event]] = {}

    def events(self, count: int) -> list[_Event]:
        if count not in self._cache:
            self._cache[count] = self._derive(count)
        return self._cache[count]

    def _loss(self, backward: bool) -> list[_Event]:
        head = self.graph.head
        rp, plan = self.rp, self.plan
        if head is None or rp.stage != rp.scheme.pp - 1 or not head[2]:
            return []
        key, rows, _ = head
        local = -(-plan.tokens // rp.scheme.seq)
        chunks = math.ceil(local / chunk_tokens(rows))
        if plan.parallel_loss:     # max, sum of exp, target log-probability: per chunk; none backward
            return [] if backward else [_Event("all_reduce", key, f"loss chunk {c}", "float32")
                                        for c in range(chunks) for _ in range(3)]
        return [_Event("all_gather", key, f"loss chunk {c}" + (" backward" if backward else ""), "float32")
                for c in range(chunks)]

    def _forward(self) -> list[_Event]:
        out = []
        if self.plan.recompute:
            out.append(_Event("all_reduce", "stage", "recompute agreement", "int64", (2,)))
        for _, _, events in self.graph.forward:
            out += events
        return out + self._loss(False)

    def _backward(self, last: bool) -> list[_Event]:
        g = self.graph
        out = self._loss(True)
        replay: dict[Any, list[_Event]] = {}
        if self.plan.recompute:
            for _, layer, events in g.forward:
                if layer is not None:
                    replay.setdefault(layer, []).extend(_Event(e.kind, e.key, e.label + " replay", e.dtype)
                                                        for e in events)
        started = set()
        triggers = _replay_points(self.rp) if replay else {}
        points = sorted(set(g.backward) | set(g.finals) | set(triggers), reverse=True)
        for i in points:
            layer = triggers.get(i)
            if layer is not None and layer in replay and layer not in started:
                started.add(layer)
                out += replay[layer]
            out += g.backward.get(i, [])
            if last and i in g.finals:
                out.append(_Event(final=tuple(g.finals[i])))
        return out

    def _counting(self, count: int) -> list[_Event]:
        """The global-batch load balancing's counting pass (``Executor._count_routing``): every
        micro-batch forward without the loss or the recomputation agreement, its sends not deferred, then
        the counts' all-reduce over the world."""
        out = [e for _ in range(count) for _, _, events in self.graph.forward for e in events]
        return out + [_Event("all_reduce", "world", "moe counts global", "int64")]

    def _derive(self, count: int) -> list[_Event]:
        rp = self.rp
        out: list[_Event] = self._counting(count) if self.plan.moe_aux_loss == "global-batch" else []
        order = one_f_one_b(count, rp.scheme.pp, rp.stage)
        last_stage = rp.stage == rp.scheme.pp - 1
        deferred: list[_Event] = []
        for n, (kind, _) in enumerate(order):
            if kind == "F":
                events = self._forward()
                # 1F1B's steady state: a forward followed by a backward sends its activations with that
                # backward's first gradient receive, one batch (``collectives.flush_deferred``)
                if not last_stage and n + 1 < len(order) and order[n + 1][0] == "B":
                    deferred += [e for e in events if _is_activation_send(e)]
                    events = [e for e in events if not _is_activation_send(e)]
                out += events
                continue
            for e in self._backward(last=n == len(order) - 1):
                if deferred and e.kind == "recv" and e.label.startswith("pp_send"):
                    e = replace(e, label="pp_send + " + e.label, carries=tuple(d.key for d in deferred))
                    deferred = []
                out.append(e)
        return out


def _is_activation_send(e: _Event) -> bool:
    return e.kind == "send" and e.label.startswith("pp_send") and not e.label.endswith("backward")


def _replay_points(rp: RankProgram) -> dict[int, int]:
    """Node index -> layer, at every node of a block (from a layer's first to its last node, as
    ``engine/recompute.block_ranges`` outlines it: the stage's send and receive stay outside) whose
    backward reads a saved tensor: the first of them in backward order replays the block."""
    nodes = list(rp.graph_module.graph.nodes)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, n in enumerate(nodes):
        meta = get_meta(n)
        if meta.comm_point == CommPoint.PP_BOUNDARY or meta.layer is None or n.op in ("placeholder", "output"):
            continue
        first.setdefault(meta.layer, i)
        last[meta.layer] = i
    out = {}
    for layer in first:
        for i in range(first[layer], last[layer] + 1):
            n = nodes[i]
            name = _target(n) if n.op == "call_function" else str(n.target)
            if n.op in ("call_function", "call_method", "call_module") and name not in _SAVES_NOTHING:
                out[i] = layer
    return out


# ---- a rank's sequence -----------------------------------------------------------------------------
def _p2p_rounds(rank: int, rounds: Iterable[Sequence[tuple[int, bool]]], label: str) -> list[Collective]:
    out = []
    for k, round_ in enumerate(rounds):
        sends = [peer for peer, send in round_ if send]
        recvs = [peer for peer, send in round_ if not send]
        out.append(Collective.p2p(rank, sends, recvs, label=f"{label} round {k}"))
    return out


def _stage_ranks(program: Program, rp: RankProgram) -> tuple[int, ...]:
    """The ranks of ``rp``'s stage (TP x CP ...: the recomputation agreement's group)."""
    return tuple(program.strategy.stage_ranks(rp.pipeline, rp.stage))


def _group_of(rank: int, event: _Event, rp: RankProgram, program: Program) -> Optional[tuple[int, ...]]:
    if event.key == "world":
        return tuple(range(program.cluster.world_size))
    if event.key == "stage":
        return _stage_ranks(program, rp)
    return tuple(sorted(rp.bindings[event.key]))


class StepDeriver:
    """Derives the ranks' sequences of one Program under one plan; roles are read once."""

    def __init__(self, program: Program, plan: StepPlan) -> None:
        if len(plan.microbatches) != len(program.strategy.pipelines):
            raise ValueError(f"plan has {len(plan.microbatches)} micro-batch counts for the "
                             f"{len(program.strategy.pipelines)} pipelines of {program.strategy}")
        self.program, self.plan = program, plan
        self._roles: dict[int, _RoleSteps] = {}
        self._names = program.param_names
        self._gathered = [n for n in self._names if program.exchange(n).is_all_gather]
        cap = plan.pull_bucket_bytes or (GLOO_PULL_BUCKET_BYTES if plan.gloo else DEFAULT_PULL_BUCKET_BYTES)
        self._pull_cap = cap
        self._gathers = gather_buckets(program, self._gathered, cap)
        world = program.cluster.world_size
        self.overlap = (plan.overlap_update if plan.overlap_update is not None else
                        world > 1 and plan.in_backward and not plan.grad_clip
                        and is_plain_data_parallel(program))
        self._dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[plan.working_dtype]

    def role(self, rp: RankProgram) -> _RoleSteps:
        steps = self._roles.get(id(rp.role))
        if steps is None:
            steps = self._roles[id(rp.role)] = _RoleSteps(rp, self.plan)
        return steps

    def rank(self, r: int) -> list[Collective]:
        program, plan = self.program, self.plan
        world = program.cluster.world_size
        if world == 1:
            return []
        rp = program.rank(r)
        G = program.cluster.group_size
        shard_group = shard_group_ranks(r, G)
        out: list[Collective] = []
        # 1. the pull
        gather_kind = "all_to_all" if plan.gloo else "all_gather"

        def gather(k: int) -> Collective:
            return Collective(gather_kind, shard_group, dtype=plan.working_dtype, label=f"pull gather {k}")

        if G > 1 and not (self.overlap and plan.prefetched):
            out += [gather(k) for k in range(len(self._gathers))]
        out += _p2p_rounds(r, pull_message_rounds(program, r, self._dtype_bytes, self._pull_cap), "pull")
        # 2. the micro-batches, with 3. the push buckets issued in the last backward
        ops_by_param = rp.push_by_param
        layouts = {n: program.param_layout(n) for n in self._names}
        buckets = GradBuckets(r, self._names, {n: ops_by_param.get(n, ()) for n in self._names}, layouts,
                              None, None, None, plan.push_bucket_bytes).buckets
        missing = [{name for name, _ in b.ops} for b in buckets]
        # a bucket over a group holding an earlier stage of this pipeline (a tied weight's) waits for the
        # backward's end, and every bucket after it (``PushGradient``: that stage waits for our gradient)
        after_backward = spans_earlier_stages(program.strategy, r)
        where: dict[str, list[int]] = {}
        for j, b in enumerate(buckets):
            for name, _ in b.ops:
                where.setdefault(name, []).append(j)
        issued = 0
        reduce_kind = "all_to_all" if plan.gloo else "reduce_scatter"

        # past ``CARRY_MAX_BYTES`` the overlapped update's loss takes an all-reduce of its own, issued
        # before the step's first reduction (``OverlappedUpdate.set_loss``)
        loss_shape = (plan.loss_values,)        # the loss, and the MoE router losses summed with it
        own_loss = (self.overlap and bool(buckets)
                    and 8 * plan.loss_values * len(buckets[0].group) * world > CARRY_MAX_BYTES)

        def bucket(j: int) -> Collective:
            if j == 0 and own_loss:
                out.append(Collective("all_reduce", tuple(range(world)), loss_shape, "float64", "loss"))
            return Collective(reduce_kind, buckets[j].group, dtype="float32", label=f"push bucket {j}")

        # the overlapped update (``OverlappedUpdate``): a reduction is taken one behind the newest
        # during backward and the rest at the end; with ``prefetch``, taking one posts (reverse model
        # order) every next-step all-gather whose parameters are all updated
        taken, updated, posted = 0, set(), set()

        def take_until(n: int) -> None:
            nonlocal taken
            while taken < n:
                updated.update(name for name, _ in buckets[taken].ops)
                taken += 1
                if plan.prefetch:
                    for k in reversed(range(len(self._gathers))):
                        if k not in posted and updated.issuperset(self._gathers[k]):
                            posted.add(k)
                            out.append(gather(k))

        count = plan.microbatches[rp.pipeline]
        for e in self.role(rp).events(count):
            if e.final:
                if not plan.in_backward:
                    continue
                for name in e.final:
                    for j in where.get(name, ()):
                        missing[j].discard(name)
                while issued < len(buckets) and not missing[issued] and not after_backward(buckets[issued].group):
                    out.append(bucket(issued))
                    issued += 1
                    if self.overlap:          # ``GradBuckets.after_issue``: one behind the newest
                        take_until(issued - 1)
            elif e.kind in ("send", "recv"):
                peer = rp.bindings[e.key][0]
                sends = [rp.bindings[k][0] for k in e.carries] + ([peer] if e.kind == "send" else [])
                out.append(Collective.p2p(r, sends=sends, recvs=[peer] if e.kind == "recv" else [], label=e.label))
            else:
                group = _group_of(r, e, rp, program)
                if len(group) > 1:
                    out.append(Collective(e.kind, group, e.shape, e.dtype, e.label))
        for j in range(issued, len(buckets)):        # flush, taking one behind after each as in backward
            out.append(bucket(j))
            if self.overlap:
                take_until(j)
        if self.overlap:          # the loss rode in the first reduction; no push to owners
            take_until(len(buckets))
            return out
        # 4. the step's end
        out.append(Collective("all_reduce", tuple(range(world)), loss_shape, "float64", "loss"))
        out += _p2p_rounds(r, push_message_rounds(program, r), "push")
        if G < world:
            out += self._across_groups(r)
        if plan.grad_clip and G > 1:
            out.append(Collective("all_reduce", shard_group, (), "float64", "gradient norm"))
        return out

    def _across_groups(self, r: int) -> list[Collective]:
        """The shards' sums among the replicas (``PushGradient._sum_across_groups``): all-reduces of up
        to ``push_bucket_bytes`` of shards side by side, model order."""
        program, G = self.program, self.program.cluster.group_size
        replicas = replica_ranks(r, G, program.cluster.world_size)
        if len(replicas) < 2:
            return []
        sizes = []
        for n in self._names:
            layout = program.param_layout(n)
            lo, hi = group_shard_bounds(layout.size, r, G)
            if hi > lo:
                sizes.append((hi - lo) * layout.row_elements)
        cap = max(self.plan.push_bucket_bytes // 4, 1)
        out, start = [], 0
        while start < len(sizes):
            end, size = start, 0
            while end < len(sizes) and (end == start or size + sizes[end] <= cap):
                size += sizes[end]
                end += 1
            out.append(Collective("all_reduce", replicas, (size,), "float32", f"replica sum {len(out)}"))
            start = end
        return out


def derive_step(program: Program, plan: StepPlan, ranks: Optional[Iterable[int]] = None) -> dict[int, list[Collective]]:
    """``{rank: its collectives of one step of program under plan}`` (every rank, or ``ranks``)."""
    deriver = StepDeriver(program, plan)
    ranks = range(program.cluster.world_size) if ranks is None else ranks
    return {r: deriver.rank(r) for r in ranks}


def derive_steps(steps: Sequence[tuple[Any, StepPlan]]) -> dict[int, list[Collective]]:
    """The sequences of several steps in a row (a schedule that switches Programs): each rank's steps
    concatenated. Every Program must have the same world size."""
    out: dict[int, list[Collective]] = {}
    for k, (program, plan) in enumerate(steps):
        # an overlapped update prefetches the next step's all-gathers when it runs the same Program
        plan = replace(plan, prefetched=k > 0 and steps[k - 1][0] is program,
                       prefetch=k + 1 < len(steps) and steps[k + 1][0] is program)
        for r, seq in derive_step(program, plan).items():
            out.setdefault(r, []).extend(seq)
    return out

