"""Ulysses (DeepSpeed-Ulysses) sequence parallelism in the cost model: the degrees a model's heads
allow, the bytes its all-to-alls move, and the latency of a ``<TP, PP, CP, UL>`` scheme derived from
the ``<TP, PP, CP>`` one.

**Degrees.** A UL group splits a TP rank's query heads over its ranks, so ``UL`` must divide
``heads / TP`` (``heads % TP == 0`` first). Key/value heads need not divide: the runtime repeats a TP
rank's ``kv = max(kv_heads // TP, 1)`` key/value heads ``UL / gcd(kv, UL)`` times, so ``lcm(kv, UL)``
of them travel (``kv_heads_sent``; ``runtime/comm/context.py``'s ``ulysses_heads_issue``).

**Communication** (``ulysses_bytes_per_token``). Per layer and forward, 4 all-to-alls: q, k, v from
token slices to head slices, the attention output back; backward the same again for the gradients. A
rank holds ``l / (CP UL)`` of a micro-batch's ``l`` tokens and sends ``(UL - 1) / UL`` of each tensor:
``2 (2 hq + 2 kvs) d (UL - 1) / UL * l / (CP UL)`` elements per layer, ``hq = heads / TP`` query heads
of ``d = hidden / heads`` features, ``kvs`` the key/value heads sent. For multi-head attention at TP 1
that is ``4 l H / UL`` per forward, ~``4 s h / N`` of the issue, against ring CP's ``2 l H`` of K/V
passed around the ring.

**Latency** (``ulysses_coeffs``): from ``T(l) = a l^2 + b l + c`` of ``<TP, PP, CP>``: every UL rank
runs attention on whole documents with ``1/UL`` of the heads (no causal imbalance to balance, unlike
CP's token split: ``a / UL`` exactly) and the projections, MLP and head on ``1/UL`` of the tokens
(``b / UL``); the all-to-alls are not overlapped: ``b += layers * bytes_per_token / bandwidth`` and
``c += layers * 8 * latency`` for the ``ceil(layers / PP)`` layers of the slowest stage. The bandwidth
is the intra-node one when the ``TP x UL`` ranks of a UL group fit in a node, the inter-node one
otherwise.

**Bandwidth.** ``AllToAll``: measured on the run's ranks (``calibration.measure_ul_comm``), or the
analytic prior ``A800_ALL_TO_ALL`` for the built-in A800 profiles: NVLink on an A800 carries 400 GB/s
both ways, 200 GB/s per direction, of which an all-to-all among the 8 GPUs of a node sustains ~75%
(150 GB/s per rank, the ``tp_bandwidth`` of the analytic prior); across nodes a rank's share of four
200 Gb/s HDR links per 8 GPUs is 12.5 GB/s, ~10 GB/s sustained; 30 us per collective's latency.

**Memory.** A UL rank keeps ``l / UL`` tokens' activations like a CP rank (attention keeps all ``l``
tokens of ``1 / UL`` of the heads: the same bytes), plus the repeated key/value heads
(``repeated_kv_bytes_per_token``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hgraph.errors import HGraphError
from hgraph.strategy import Scheme

ALL_TO_ALLS_PER_LAYER = 8      # q, k, v and the output, forward and backward


@dataclass(frozen=True)
class AllToAll:
    """Time of one all-to-all: ``latency_ms + bytes sent per rank / bandwidth``."""

    latency_ms: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    bytes_per_element: int = 2     # the working dtype of the activations exchanged (bf16)
    source: str = ""

    def __post_init__(self) -> None:
        if self.latency_ms < 0 or self.intra_node_bytes_per_s <= 0 or self.inter_node_bytes_per_s <= 0 \
                or self.bytes_per_element < 1:
            raise HGraphError(f"all-to-all model needs latency >= 0 and positive bandwidths and element size, got {self}")

    def bytes_per_s(self, intra_node: bool) -> float:
        return self.intra_node_bytes_per_s if intra_node else self.inter_node_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"latency_ms": self.latency_ms, "intra_node_bytes_per_s": self.intra_node_bytes_per_s,
                "inter_node_bytes_per_s": self.inter_node_bytes_per_s, "bytes_per_element": self.bytes_per_element,
                **({"source": self.source} if self.source else {})}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "AllToAll":
        keys = ("latency_ms", "intra_node_bytes_per_s", "inter_node_bytes_per_s")
        if not isinstance(d, dict) or any(k not in d for k in keys):
            raise HGraphError(f"{where}: ulysses.all_to_all needs the keys {', '.join(keys)}")
        try:
            return cls(float(d["latency_ms"]), float(d["intra_node_bytes_per_s"]), float(d["inter_node_bytes_per_s"]),
                       int(d.get("bytes_per_element", 2)), str(d.get("source", "")))
        except (TypeError, ValueError) as exc:
            raise HGraphError(f"{where}: malformed ulysses.all_to_all value ({exc})") from None


A800_ALL_TO_ALL = AllToAll(0.03, 150e9, 10e9, 2, "analytic prior: A800 NVLink (module docstring of "
                                                    "hgraph.runtime.planner.cost.ulysses)")


def ulysses_degrees(heads: Optional[int], tp: int, limit: int) -> list[int]:
    """UL degrees ``2..limit`` that divide a TP rank's query heads (none when heads are unknown or TP
    does not divide them)."""
    if not heads or heads % tp:
        return []
    per_rank = heads // tp
    return [u for u in range(2, min(limit, per_rank) + 1) if per_rank % u == 0]


def kv_heads_sent(kv_heads: int, tp: int, ul: int) -> int:
    """Key/value heads of one TP rank after the runtime's repetition: ``lcm(max(kv_heads // TP, 1), UL)``."""
    kv = max(kv_heads // tp, 1)
    return kv * ul // math.gcd(kv, ul)


def ulysses_bytes_per_token(hidden: int, heads: int, kv_heads: int, scheme: Scheme, bytes_per_element: int) -> float:
    """Bytes one rank of ``scheme`` sends in its all-to-alls per layer (forward and backward) per token
    of the micro-batch (module docstring); 0 without Ulysses."""
    ul = scheme.ul
    if ul == 1:
        return 0.0
    d = hidden / heads
    hq = heads // scheme.tp
    per_local_token = 2 * (2 * hq + 2 * kv_heads_sent(kv_heads, scheme.tp, ul)) * d * (ul - 1) / ul
    return per_local_token / (scheme.cp * ul) * bytes_per_element


def intra_node(scheme: Scheme, gpus_per_node: int) -> bool:
    """Whether a UL group's ranks (``TP x UL`` consecutive ranks) fit in one node."""
    return scheme.tp * scheme.ul <= gpus_per_node


def ulysses_coeffs(base: tuple[float, float, float], scheme: Scheme, *, hidden: int, heads: int, kv_heads: int,
                   stage_layers: int, comm: AllToAll, gpus_per_node: int) -> tuple[float, float, float]:
    """``(a, b, c)`` of ``scheme`` from ``base``, the coefficients of the same scheme without UL."""
    a, b, c = base
    ul = scheme.ul
    per_token = ulysses_bytes_per_token(hidden, heads, kv_heads, scheme, comm.bytes_per_element)
    bw = comm.bytes_per_s(intra_node(scheme, gpus_per_node))
    return (a / ul, b / ul + stage_layers * per_token / bw * 1e3,
            c + stage_layers * ALL_TO_ALLS_PER_LAYER * comm.latency_ms)


def ulysses_schemes(bases: dict[Scheme, tuple[float, float, float]], *, hidden: int, layers: int,
                    heads: Optional[int], kv_heads: Optional[int], max_ul: int, comm: Optional[AllToAll],
                    gpus_per_node: int, world_size: int) -> dict[Scheme, tuple[float, float, float]]:
    """The UL schemes derived from every ``<TP, PP, CP>`` base that fits ``world_size`` GPUs: degrees
    of ``ulysses_degrees`` up to ``max_ul``, with CP where the base has it (CP x UL, USP's 2-D)."""
    if comm is None or not heads or max_ul < 2:
        return {}
    kv = kv_heads or heads
    out: dict[Scheme, tuple[float, float, float]] = {}
    for base, abc in bases.items():
        if base.ul != 1:
            continue
        for ul in ulysses_degrees(heads, base.tp, max_ul):
            if base.num_ranks * ul > world_size:
                break
            s = Scheme(base.tp, base.pp, base.cp, ul)
            out[s] = ulysses_coeffs(abc, s, hidden=hidden, heads=heads, kv_heads=kv,
                                    stage_layers=math.ceil(layers / base.pp), comm=comm, gpus_per_node=gpus_per_node)
    return out


def repeated_kv_bytes_per_token(hidden: int, layers: int, heads: Optional[int], kv_heads: Optional[int],
                                scheme: Scheme, bytes_per_element: int = 2) -> float:
    """Activation bytes per token of a micro-batch that the repeated key/value heads add to a rank of
    ``scheme`` (attention saves ``kvs / UL`` heads of K and V for all tokens where ``kv / UL`` would do)."""
    if scheme.ul == 1 or not heads:
        return 0.0
    kv = kv_heads or heads
    extra = kv_heads_sent(kv, scheme.tp, scheme.ul) - max(kv // scheme.tp, 1)
    return layers * 2 * extra * (hidden / heads) / (scheme.cp * scheme.ul) * bytes_per_element

