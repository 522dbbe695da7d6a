"""Latency and memory model of one pipeline scheme (Hydraulis §6.1, App. B).

Latency: ``T(l, P) = a*l^2 + b*l + c`` ms is the forward+backward time of one micro-batch holding one
sequence of ``l`` tokens on one pipeline stage of ``P``. A packed micro-batch costs
``sum(a*l_i^2 + b*l_i) + c`` (varlen attention keeps documents apart, so the per-sequence parts add;
the constant overhead is paid once per micro-batch) and a 1F1B pipeline with ``V`` micro-batches
costs ``(PP - 1 + V) * max micro-batch time``.

Memory (App. B.1): activations ``layers * l * H / (TP * CP) * A[TP]`` bytes (the first stage holds PP
micro-batches of layers/PP layers each); model states ``layers*H^2/N * B * alpha +
layers/PP * H^2/TP * B * (1 - alpha)`` plus the embedding ``H*V/N*16*alpha + H*V/TP*16*(1-alpha)``,
or, where this runtime counted them (``MemoryModel.scheme_states``), the bytes its ranks hold;
``MaxLen(P)`` is the ``l`` where the total plus the framework gap reaches memory minus the margin.

Context-parallel schemes (``CP > 1``) are not in the A800 profiles. Unless a profile lists them
explicitly they are derived from the profiled ``<TP, PP>``: every CP rank computes ``1/CP`` of the
tokens and of the (load-balanced) causal attention, so ``a/CP``; the linear part is divided by
``CP * cp_efficiency`` (the ring exchange of K/V is overlapped with attention but not perfectly,
``cp_efficiency`` defaults to 0.9, an assumption stored in the profile); ``c`` is unchanged (the same
kernels are launched); ``UtilLen`` is multiplied by CP (each rank sees ``l/CP`` tokens). CP degrees
are powers of two and three times them up to ``max_cp`` (``cp_degrees``).

Push Gradient (``CostModel.push``, a profile's ``push`` section; ``hgraph.runtime.planner.cost.push``):
a pipeline's time adds the part of its ranks' push that its last backward does not hide; without a
push model the push is not priced.

Ulysses schemes (``UL > 1``) are derived from the ``<TP, PP, CP>`` ones where the model's heads allow
(``ModelShape.heads``) and an all-to-all model is known (``CostModel.all_to_all``: measured, or the A800
prior for the built-in profiles): ``hgraph.runtime.planner.cost.ulysses``. ``max_ul`` bounds the degree
(default: ``max_cp``, so a model without derived CP, the papers' ``<TP, PP>`` setting, has no UL either).

EP schemes (``EP > 1``) of a model with experts (``ModelShape.experts``) are derived from all the others:
``hgraph.runtime.planner.cost.moe_cost``. ``coeffs`` is their even split (a lower bound), ``dispatch_coeffs``
what the dispatch balances, ``microbatch_time`` the slowest replica plus the busiest expert rank.
The memory model (App. B.1, ``ModelShape``, ``MemoryModel``) is ``hgraph.runtime.planner.cost.memory_model``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from hgraph import dims
from hgraph.dims import Dim
from hgraph.errors import HGraphError
from hgraph.runtime.engine.offload import OFFLOAD_MODES
from hgraph.runtime.planner.cost.memory_model import EMBEDDING_BYTES_PER_PARAM, MemoryModel, ModelShape
from hgraph.runtime.data.document_split import split_documents
from hgraph.runtime.planner.cost.moe_cost import EpTerms, ExpertShape, ep_microbatch_ms, ep_schemes
from hgraph.runtime.planner.cost.profiles import resolve_profile
from hgraph.runtime.planner.cost.push import PushModel, gradient_bytes, optional_push
from hgraph.runtime.planner.cost.ulysses import A800_ALL_TO_ALL, AllToAll, ulysses_schemes
from hgraph.runtime.planner.schedule.offload import relief_extra_ms
from hgraph.runtime.planner.schedule.recompute import recompute_extra_ms
from hgraph.runtime.planner.schedule.relief import relieved_max_len
from hgraph.strategy import Scheme

DEFAULT_CP_EFFICIENCY = 0.9
DEFAULT_MAX_CP = 8


def _tp_key(text: str, where: str) -> int:
    if not (isinstance(text, str) and text.startswith("tp") and text[2:].isdigit()):
        raise HGraphError(f"{where}: key {text!r} must be tp<n>")
    return int(text[2:])


@dataclass
class CostModel:
    """Latency and memory model of every scheme that fits a cluster of ``world_size`` GPUs.

    ``profiled`` maps ``(tp, pp, cp)`` to measured ``(a, b, c)``; CP schemes not profiled are
    derived, and so are Ulysses schemes (``all_to_all``, ``max_ul``; module docstring). ``schemes``
    lists the schemes that fit: ``tp*pp*cp*ul <= world_size``, TP inside one node, and a positive MaxLen.
    """

    name: str
    model: ModelShape
    profiled: dict[tuple[int, int, int], tuple[float, float, float]]
    util_len_tokens: dict[int, int]
    memory: MemoryModel
    world_size: int
    gpus_per_node: int = 8
    cp_efficiency: float = DEFAULT_CP_EFFICIENCY
    max_cp: int = DEFAULT_MAX_CP
    extra: dict[str, Any] = field(default_factory=dict)  # other profile keys, kept for to_profile_dict
    # DCP-intra: activation bytes per rank; a micro-batch over it recomputes layers and pays their forward
    activation_budget_bytes: float | None = None
    # Ulysses: the all-to-all's time (None: no UL scheme) and the largest degree (None: ``max_cp``)
    all_to_all: Optional[AllToAll] = None
    max_ul: Optional[int] = None
    # the schemes kept (None: all that fit): a baseline's space in the simulator (``restricted``)
    only: Optional[frozenset[Scheme]] = None
    # activation offload (schedule.offload): off | on | auto, and the host bytes per rank it may hold
    offload: str = "off"
    host_budget_bytes: float = math.inf
    # Push Gradient: only its part the last backward does not hide is priced (None: not priced)
    push: Optional[PushModel] = None
    # expert parallelism (a model with ``experts``): the all-to-all's time (None: ``all_to_all``'s; neither:
    # no EP scheme) and the largest degree (None: ``gpus_per_node``); ``cost.moe_cost``
    ep_all_to_all: Optional[AllToAll] = None
    max_ep: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise HGraphError(f"world size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise HGraphError(f"GPUs per node must be a positive integer, got {self.gpus_per_node!r}")
        if not 0 < self.cp_efficiency <= 1:
            raise HGraphError(f"cp_efficiency must be in (0, 1], got {self.cp_efficiency!r}")
        self._coeffs: dict[Scheme, tuple[float, float, float]] = {}
        self._ep_terms: dict[Scheme, EpTerms] = {}          # filled by ``_derived_ep``
        self._max_len: dict[Scheme, int] = {}
        self._relieved_max_len: dict[Scheme, int] = {}     # filled as asked (``max_len``)
        for scheme, abc in sorted(self._all_coeffs().items()):
            tp = scheme.tp
            if self.only is not None and scheme not in self.only:
                continue
            if scheme.num_ranks > self.world_size or tp > self.gpus_per_node or self.gpus_per_node % tp:
                continue
            if tp not in self.util_len_tokens:
                continue
            ml = self.memory.max_len(self.model, scheme, self.world_size)
            if ml <= 0:
                continue
            self._coeffs[scheme] = abc
            self._max_len[scheme] = ml
        self.schemes: list[Scheme] = sorted(self._coeffs, key=lambda s: (s.num_ranks, s.tp, s.pp, s.cp, s.ul, s.ep))

    def _all_coeffs(self) -> dict[Scheme, tuple[float, float, float]]:
        """The profiled schemes, then the schemes each derived dimension adds to those before it
        (``DERIVED``, in order: CP from the profiled ones, Ulysses from both)."""
        out = {Scheme(tp, pp, cp): abc for (tp, pp, cp), abc in self.profiled.items()}
        for derive in DERIVED.values():
            out.update(derive(self, out))
        return out

    @property
    def ulysses_limit(self) -> int:
        """The largest Ulysses degree derived (``max_ul``, else ``max_cp``)."""
        return self.max_ul if self.max_ul is not None else self.max_cp

    def restricted(self, keep) -> "CostModel":
        """This model with only the schemes for which ``keep(scheme)`` holds (a baseline's space)."""
        return replace(self, only=frozenset(s for s in self.schemes if keep(s)))

    # ---- queries ---------------------------------------------------------------------------
    def _check(self, scheme: Scheme) -> Scheme:
        if scheme not in self._coeffs:
            raise HGraphError(
                f"scheme {scheme} is not available in cost profile {self.name!r} for {self.world_size} GPUs "
                f"({self.gpus_per_node} per node); available: {', '.join(map(str, self.schemes)) or 'none'}")
        return scheme

    def has(self, scheme: Scheme) -> bool:
        return scheme in self._coeffs

    def coeffs(self, scheme: Scheme) -> tuple[float, float, float]:
        """``(a, b, c)`` in ms of ``T(l) = a l^2 + b l + c``."""
        try:
            return self._coeffs[scheme]
        except KeyError:
            self._check(scheme)
            raise

    def dispatch_coeffs(self, scheme: Scheme) -> tuple[float, float, float]:
        """``(a, b, c)`` the dispatch, packing and proposal balance documents by: ``coeffs``, except for
        EP (``moe_cost.EpTerms.balancing``: a document's attention whole on its replica)."""
        terms = self._ep_terms.get(scheme)
        return self.coeffs(scheme) if terms is None else terms.balancing

    def seq_time(self, l, scheme: Scheme):
        """Per-sequence part ``a l^2 + b l`` (ms); ``l`` may be a number or a numpy array."""
        a, b, _ = self.coeffs(scheme)
        if isinstance(l, (list, tuple)):
            l = np.asarray(l, dtype=np.float64)
        elif isinstance(l, np.ndarray):
            l = l.astype(np.float64, copy=False)
        return a * l * l + b * l

    def microbatch_time(self, lengths: Iterable[int], scheme: Scheme) -> float:
        """One packed micro-batch: ``sum(a l^2 + b l) + c`` (ms), plus what its relief adds
        (``relief_ms``); an EP micro-batch its slowest replica and busiest expert rank
        (``moe_cost.ep_microbatch_ms``), of which ``coeffs`` is the even split's lower bound."""
        arr = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths, dtype=np.float64)
        if scheme in self._ep_terms:
            return self.split_microbatch_time(arr, scheme) + self.relief_ms(arr, scheme)
        return float(np.sum(self.seq_time(arr, scheme))) + self.coeffs(scheme)[2] + self.relief_ms(arr, scheme)

    def split_microbatch_time(self, lengths: np.ndarray, scheme: Scheme) -> float:
        """An EP micro-batch of documents ``lengths`` without relief: its slowest replica under
        ``split_documents`` (what the runtime runs) plus the busiest expert rank
        (``moe_cost.ep_microbatch_ms``); what the packer prices an EP candidate micro-batch by."""
        return ep_microbatch_ms(lengths, self._ep_terms[scheme], self.model.experts, split_documents)

    def replicas_microbatch_time(self, parts: Sequence[Sequence[int]], scheme: Scheme) -> float:
        """An EP micro-batch whose replicas run the documents ``parts`` (their lengths, one list per EP
        rank, as a baseline deals them) rather than ``split_documents``' split."""
        lengths = [l for part in parts for l in part]
        starts = np.cumsum([0] + [len(p) for p in parts])
        given = tuple(tuple(range(starts[r], starts[r + 1])) for r in range(len(parts)))
        return ep_microbatch_ms(np.asarray(lengths), self._ep_terms[scheme], self.model.experts, lambda _l, _n: given)

    def prices_replicas(self, scheme: Scheme) -> bool:
        """Whether ``scheme``'s micro-batches are priced per EP replica (not by ``seq_time`` sums)."""
        return scheme in self._ep_terms

    @property
    def relieves(self) -> bool:
        """Whether the engine relieves micro-batches: a memory budget (recomputation, and offload
        with ``offload``) or an offload."""
        return self.activation_budget_bytes is not None or self.offload != "off"

    def relief_budget(self, scheme: Scheme) -> float | None:
        """The activation bytes per rank of ``scheme`` under which the engine relieves a micro-batch:
        the memory budget, else under ``--offload auto`` the device's room for activations
        (``MemoryModel.activation_room``: relief only where a micro-batch would not fit without it);
        None where none bounds it (no relief, or ``--offload on`` offloading every layer)."""
        if self.activation_budget_bytes is not None:
            return float(self.activation_budget_bytes)
        if self.offload == "auto":
            return self.memory.activation_room(self.model, scheme, self.world_size)
        return None

    def relief_ms(self, lengths: Iterable[int], scheme: Scheme) -> float:
        """What relief adds to one packed micro-batch (ms): the forward of the layers it recomputes
        (``schedule.recompute``) or, with an ``offload``, its recomputed layers and the copies of its
        offloaded ones that compute does not hide (``schedule.offload``); 0 without relief."""
        if not self.relieves:
            return 0.0
        arr = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths, dtype=np.float64)
        budget = self.relief_budget(scheme)
        if self.offload == "off":
            return recompute_extra_ms(self, arr, scheme, budget)[0]
        if budget is None and self.offload != "on":
            return 0.0
        return relief_extra_ms(self, arr, scheme, budget, self.offload, self.host_budget_bytes)[0]

    def pipeline_time(self, mb_times: Sequence[float], scheme: Scheme) -> float:
        """1F1B latency ``(PP - 1 + V) * max(mb_times)`` and the exposed push (``exposed_push_ms``); 0
        for a pipeline with no micro-batch."""
        if len(mb_times) == 0:
            return 0.0
        return (scheme.pp - 1 + len(mb_times)) * float(max(mb_times)) + self.exposed_push_ms(scheme, mb_times)

    def exposed_push_ms(self, scheme: Scheme, mb_times: Sequence[float]) -> float:
        """The part of a ``scheme`` rank's push that its last backward (of ``mb_times[-1]``, the last
        micro-batch in 1F1B order) does not hide (``cost.push``); 0 without a push model."""
        if self.push is None or len(mb_times) == 0:
            return 0.0
        m = self.model
        return self.push.exposed_ms(gradient_bytes(m.hidden, m.layers, m.vocab, scheme.tp, scheme.pp),
                                    float(mb_times[-1]))

    def max_len(self, scheme: Scheme) -> int:
        """MaxLen(P): the longest packed micro-batch (tokens) that fits in memory, with its layers
        relieved where the engine relieves them (``relieves``: ``schedule.relief``), else with every
        activation on the device (``plain_max_len``)."""
        plain = self.plain_max_len(scheme)
        if not self.relieves:
            return plain
        relieved = self._relieved_max_len.get(scheme)
        if relieved is None:
            relieved = self._relieved_max_len[scheme] = relieved_max_len(self, scheme, plain)
        return relieved

    def microbatch_capacity(self, scheme: Scheme, longest: int = 0) -> int:
        """Tokens the packer may put in one micro-batch of documents up to ``longest`` tokens: MaxLen; for
        EP the ``n`` replicas' MaxLen ``M`` less what an uneven split may leave, ``n M - (n - 1) longest``
        (``split_documents`` deals the documents dearest first onto the least loaded replica: what is left
        beside the longest then fits the others)."""
        m = self.max_len(scheme)
        return m if scheme.ep == 1 else max(scheme.ep * m - (scheme.ep - 1) * int(longest), m)

    def plain_max_len(self, scheme: Scheme) -> int:
        """The longest packed micro-batch (tokens) that fits with every activation on the device."""
        try:
            return self._max_len[scheme]
        except KeyError:
            self._check(scheme)
            raise

    def util_len(self, scheme: Scheme) -> int:
        """UtilLen(P): packed length (tokens) at which the scheme runs near full efficiency (App. C)."""
        self._check(scheme)
        return self.util_len_tokens[scheme.tp] * scheme.seq

    def largest_max_len(self) -> int:
        return max((self.max_len(s) for s in self.schemes), default=0)

    # ---- serialisation ---------------------------------------------------------------------
    def to_profile_dict(self) -> dict[str, Any]:
        """This model as a profile file ``{name: entry}`` (the format ``load_cost_model`` reads).

        Only measured schemes are written; derived CP schemes are derived again on load.
        """
        schemes = []
        for (tp, pp, cp), (a, b, c) in sorted(self.profiled.items()):
            entry: dict[str, Any] = {"tp": tp, "pp": pp}
            if cp != 1:
                entry["cp"] = cp
            entry.update({"a": a, "b": b, "c": c})
            schemes.append(entry)
        body: dict[str, Any] = dict(self.extra)
        m = self.model
        body.update({
            "model": {"hidden": m.hidden, "layers": m.layers, "vocab": m.vocab,
                      **({"heads": m.heads} if m.heads else {}), **({"kv_heads": m.kv_heads} if m.kv_heads else {}),
                      **({"experts": m.experts.to_dict()} if m.experts else {})},
            "schemes": schemes,
            "util_len_tokens": {f"tp{tp}": v for tp, v in sorted(self.util_len_tokens.items())},
            "memory": self.memory.to_dict(),
            "context_parallel": {"efficiency": self.cp_efficiency, "max_cp": self.max_cp},
        })
        if self.push is not None:
            body["push"] = self.push.to_dict()
        if self.ep_all_to_all is not None or self.max_ep is not None:
            body["moe"] = {**({"all_to_all": self.ep_all_to_all.to_dict()} if self.ep_all_to_all else {}),
                           **({"max_ep": self.max_ep} if self.max_ep is not None else {})}
        if self.all_to_all is not None:
            body["ulysses"] = {"all_to_all": self.all_to_all.to_dict(),
                               **({"max_ul": self.max_ul} if self.max_ul is not None else {})}
        return {self.name: body}


def cp_degrees(limit: int) -> list[int]:
    """CP degrees ``2..limit`` the cost model derives: powers of two and three times them (3, 6, 12,
    ...: FCP's and Hydraulis' degrees that are not powers of two, which give a long document the GPUs
    it needs while a few pipelines still tile nodes of 8)."""
    out: set[int] = set()
    p = 1
    while p <= limit:
        out.update(d for d in (p, 3 * p) if 2 <= d <= limit)
        p *= 2
    return sorted(out)


def _counted_states(entries: Any, where: str) -> tuple[tuple[tuple[int, int, int], tuple[int, int]], ...]:
    """``memory.model_state_bytes`` of a profile: ``[{tp, pp, world_size, resident, step_transient}]``."""
    keys = ("tp", "pp", "world_size", "resident", "step_transient")
    out = []
    for e in entries:
        if not isinstance(e, dict) or any(k not in e for k in keys):
            raise HGraphError(f"{where}: memory.model_state_bytes entries need the keys {', '.join(keys)}")
        out.append(((int(e["tp"]), int(e["pp"]), int(e["world_size"])), (int(e["resident"]), int(e["step_transient"]))))
    return tuple(sorted(out))


def with_activation_budget(cost: CostModel, budget_bytes: float | None) -> CostModel:
    """``cost`` whose micro-batch times include the recomputation ``budget_bytes`` of activations per
    rank forces (DCP-intra; None: no budget), as a new model: a loaded one may be shared."""
    if cost.activation_budget_bytes == budget_bytes:
        return cost
    return replace(cost, activation_budget_bytes=budget_bytes)


def without_relief(cost: CostModel) -> CostModel:
    """``cost`` with neither a memory budget nor offload: every activation on the device."""
    if not cost.relieves:
        return cost
    return replace(cost, activation_budget_bytes=None, offload="off")


def with_offload(cost: CostModel, offload: str, host_budget_bytes: float | None) -> CostModel:
    """``cost`` whose micro-batch times price ``--offload`` ``offload`` within ``host_budget_bytes``
    of host memory per rank (None: unbounded), as a new model."""
    if offload not in OFFLOAD_MODES:
        raise HGraphError(f"offload {offload!r}: expected one of {', '.join(OFFLOAD_MODES)}")
    host = math.inf if host_budget_bytes is None else float(host_budget_bytes)
    if (cost.offload, cost.host_budget_bytes) == (offload, host):
        return cost
    return replace(cost, offload=offload, host_budget_bytes=host)


def with_push(cost: CostModel, bucket_bytes: int, overlapped: bool = True) -> CostModel:
    """``cost`` whose push is priced as the run issues it: in buckets of ``bucket_bytes`` and, unless
    ``overlapped`` (``--no-overlap-push``), none of it hidden by the last backward, as a new model
    (the same one without a push model)."""
    if cost.push is None:
        return cost
    push = replace(cost.push, bucket_bytes=bucket_bytes,
                   backward_share=cost.push.backward_share if overlapped else 0.0)
    return cost if push == cost.push else replace(cost, push=push)


def cost_model_from_entry(name: str, entry: dict[str, Any], *, world_size: int, gpus_per_node: int = 8,
                          cp_efficiency: float | None = None, max_cp: int | None = None,
                          gpu_memory_bytes: int | None = None, max_ul: int | None = None) -> CostModel:
    """Build a CostModel from one (validated) profile entry; ``gpu_memory_bytes`` replaces the
    profile's device memory. An entry whose model lists its ``heads`` but no ``ulysses`` section gets
    the A800 all-to-all prior (``ulysses.A800_ALL_TO_ALL``: the built-in profiles' cluster)."""
    where = f"profile {name!r}"
    try:
        mod = entry["model"]
        model = ModelShape(int(mod["hidden"]), int(mod["layers"]), int(mod["vocab"]),
                           int(mod["heads"]) if mod.get("heads") else None,
                           int(mod["kv_heads"]) if mod.get("kv_heads") else None,
                           ExpertShape.from_dict(mod["experts"], where) if mod.get("experts") else None)
        profiled: dict[tuple[int, int, int], tuple[float, float, float]] = {}
        for s in entry["schemes"]:
            key = (int(s["tp"]), int(s["pp"]), int(s.get("cp", 1)))
            profiled[key] = (float(s["a"]), float(s["b"]), float(s["c"]))
        util = {_tp_key(k, where): int(v) for k, v in entry["util_len_tokens"].items()}
        mem = entry["memory"]
        memory = MemoryModel(
            activation_coeff=tuple(sorted(
                (_tp_key(k, where), float(v)) for k, v in mem["activation_bytes_per_token_per_layer_coeff_A"].items())),
            state_coeff=float(mem["model_state_coeff_B"]),
            alpha=float(mem["alpha_sharded_fraction"]),
            framework_gap_bytes=int(mem["framework_gap_bytes"]),
            safety_margin_bytes=int(mem["safety_margin_bytes"]),
            gpu_memory_bytes=int(gpu_memory_bytes if gpu_memory_bytes is not None else mem["gpu_memory_bytes"]),
            other_coeff=tuple(sorted(
                (_tp_key(k, where), float(v)) for k, v in mem.get("other_activation_bytes_per_token", {}).items())),
            embedding_bytes_per_param=float(mem.get("embedding_bytes_per_param", EMBEDDING_BYTES_PER_PARAM)),
            scheme_states=_counted_states(mem.get("model_state_bytes", []), where),
            loss_transient=tuple(sorted((int(t["tp"]), float(t["bytes_per_token"]), int(t["chunk_tokens"]))
                                        for t in mem.get("loss_transient", []))),
        )
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise HGraphError(f"{where}: malformed value ({exc})") from None
    cp_conf = entry.get("context_parallel", {})
    ul_conf = entry.get("ulysses", {})
    if not isinstance(ul_conf, dict):
        raise HGraphError(f"{where}: ulysses must be an object with all_to_all and max_ul")
    all_to_all = AllToAll.from_dict(ul_conf["all_to_all"], where) if "all_to_all" in ul_conf else \
        (A800_ALL_TO_ALL if model.heads else None)
    if max_ul is None and ul_conf.get("max_ul") is not None:
        max_ul = int(ul_conf["max_ul"])
    extra = {k: v for k, v in entry.items()
             if k not in ("model", "schemes", "util_len_tokens", "memory", "context_parallel", "ulysses", "push", "moe")}
    moe = entry.get("moe", {})
    if not isinstance(moe, dict):
        raise HGraphError(f"{where}: moe must be an object with all_to_all and max_ep")
    return CostModel(
        name=name, model=model, profiled=profiled, util_len_tokens=util, memory=memory,
        world_size=world_size, gpus_per_node=gpus_per_node,
        cp_efficiency=float(cp_efficiency if cp_efficiency is not None else cp_conf.get("efficiency", DEFAULT_CP_EFFICIENCY)),
        max_cp=int(max_cp if max_cp is not None else cp_conf.get("max_cp", DEFAULT_MAX_CP)),
        extra=extra, all_to_all=all_to_all, max_ul=max_ul, push=optional_push(entry.get("push"), where),
        ep_all_to_all=AllToAll.from_dict(moe["all_to_all"], where) if "all_to_all" in moe else None,
        max_ep=int(moe["max_ep"]) if moe.get("max_ep") is not None else None)


def load_cost_model(ref: str, world_size: int, gpus_per_node: int = 8, *, cp_efficiency: float | None = None,
                    max_cp: int | None = None, gpu_memory_bytes: int | None = None,
                    max_ul: int | None = None) -> CostModel:
    """Cost model for a built-in profile name, a profile file PATH, or ``PATH:NAME`` (``gpu_memory_bytes``:
    another device memory than the profile's; ``max_ul``: the largest Ulysses degree, default ``max_cp``)."""
    name, entry = resolve_profile(ref)
    return cost_model_from_entry(name, entry, world_size=world_size, gpus_per_node=gpus_per_node,
                                 cp_efficiency=cp_efficiency, max_cp=max_cp, gpu_memory_bytes=gpu_memory_bytes,
                                 max_ul=max_ul)


Coeffs = dict[Scheme, tuple[float, float, float]]


def _derived_cp(cost: CostModel, bases: Coeffs) -> Coeffs:
    """CP schemes of every profiled ``<TP, PP>`` not profiled with that CP degree: ``a / cp`` and
    ``b / (cp x efficiency)`` (``cp_degrees`` up to ``max_cp``, within the world)."""
    out: Coeffs = {}
    for cp in cp_degrees(cost.max_cp):
        for (tp, pp, base_cp), (a, b, c) in cost.profiled.items():
            s = Scheme(tp, pp, cp)
            if base_cp == 1 and s not in bases and s.num_ranks <= cost.world_size:
                out[s] = (a / cp, b / (cp * cost.cp_efficiency), c)
    return out


def _derived_ul(cost: CostModel, bases: Coeffs) -> Coeffs:
    """Ulysses schemes of every ``<TP, PP, CP>`` base (``cost.ulysses``)."""
    m = cost.model
    return ulysses_schemes(bases, hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                           max_ul=cost.ulysses_limit, comm=cost.all_to_all, gpus_per_node=cost.gpus_per_node,
                           world_size=cost.world_size)


def _derived_ep(cost: CostModel, bases: Coeffs) -> Coeffs:
    """EP schemes of every base of a MoE model (``moe_cost.ep_schemes``; the per-replica terms kept for
    ``microbatch_time``), over the EP all-to-all (the Ulysses one without a measured one)."""
    m = cost.model
    coeffs, terms = ep_schemes(bases, hidden=m.hidden, layers=m.layers, shape=m.experts,
                               comm=cost.ep_all_to_all or cost.all_to_all, gpus_per_node=cost.gpus_per_node,
                               world_size=cost.world_size, max_ep=cost.max_ep)
    cost._ep_terms.update(terms)
    return coeffs


#: how the schemes of each dimension the cost model derives rather than profiles are priced, keyed by
#: the registry's members (``hgraph.dims``) and applied in this order; a new dimension is one entry
#: (the memory terms follow ``Scheme.seq`` for the sequence dimensions)
DERIVED: dict[Dim, Callable[[CostModel, Coeffs], Coeffs]] = {dims.CP: _derived_cp, dims.UL: _derived_ul,
                                                            dims.EP: _derived_ep}

