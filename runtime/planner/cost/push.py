"""The price of a step's Push Gradient: only what the last backward does not hide.

A rank reduces its fp32 working gradients among their replicas and sends them to the optimizer
owners (``runtime/comm/push``): about the gradient bytes of its shard of the model,
``4 * parameters / (TP * PP)``, in buckets of up to ``bucket_bytes``, each a ``latency_ms`` plus its
bytes over ``bandwidth`` (bytes/s per rank), ``push_ms``. The buckets are issued inside the step's
last backward as their gradients become final (reverse model order), so the push runs under that
backward: ``backward_share`` of the last micro-batch's time (a backward costs about twice a forward,
hence 2/3). What is left over is exposed, and at least the last bucket is, since its gradients (the
first layers' and the embedding's) are final only when the backward ends:

    exposed_ms = max(push_ms - backward_share * last_microbatch_ms, last_bucket_ms)

That is what the planner adds to a pipeline's 1F1B time (``CostModel.pipeline_time``). A profile
gives the model as ``"push": {"bandwidth_gb_per_s": B, "latency_ms": L}`` (optional ``bucket_bytes``,
``backward_share``); without one the push is not priced (the papers' model, every estimate as before).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hgraph.errors import HGraphError

#: the runtime's reduction buckets (``runtime/comm/grad_buckets.DEFAULT_BUCKET_BYTES``, DDP's 25 MB)
DEFAULT_PUSH_BUCKET_BYTES = 25 * 1024 * 1024
#: a micro-batch's backward over its forward + backward (backward ~ 2 x forward)
DEFAULT_BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class PushModel:
    """Time of a rank's push: ``latency_ms`` per bucket plus its bytes over ``bandwidth`` (bytes/s)."""

    bandwidth: float
    latency_ms: float = 0.0
    bucket_bytes: int = DEFAULT_PUSH_BUCKET_BYTES
    backward_share: float = DEFAULT_BACKWARD_SHARE

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency_ms >= 0 and self.bucket_bytes > 0
                and 0 <= self.backward_share <= 1):
            raise HGraphError(f"push model needs a positive bandwidth and bucket size, latency >= 0 and "
                              f"0 <= backward_share <= 1, got {self}")

    def push_ms(self, grad_bytes: float) -> float:
        """The whole push of ``grad_bytes`` (ms), were nothing hidden."""
        if grad_bytes <= 0:
            return 0.0
        return math.ceil(grad_bytes / self.bucket_bytes) * self.latency_ms + grad_bytes / self.bandwidth * 1e3

    def exposed_ms(self, grad_bytes: float, last_microbatch_ms: float) -> float:
        """What the last backward (``backward_share`` of ``last_microbatch_ms``) leaves of the push."""
        if grad_bytes <= 0:
            return 0.0
        last_bucket = self.latency_ms + min(grad_bytes, self.bucket_bytes) / self.bandwidth * 1e3
        return max(self.push_ms(grad_bytes) - self.backward_share * last_microbatch_ms, last_bucket)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bandwidth_gb_per_s": self.bandwidth / 1e9, "latency_ms": self.latency_ms}
        if self.bucket_bytes != DEFAULT_PUSH_BUCKET_BYTES:
            out["bucket_bytes"] = self.bucket_bytes
        if self.backward_share != DEFAULT_BACKWARD_SHARE:
            out["backward_share"] = self.backward_share
        return out

    @classmethod
    def from_dict(cls, entry: Any, where: str) -> "PushModel":
        if not isinstance(entry, dict) or "bandwidth_gb_per_s" not in entry:
            raise HGraphError(f"{where}: push must be an object with bandwidth_gb_per_s (and latency_ms, "
                              "bucket_bytes, backward_share)")
        try:
            return cls(float(entry["bandwidth_gb_per_s"]) * 1e9, float(entry.get("latency_ms", 0.0)),
                       int(entry.get("bucket_bytes", DEFAULT_PUSH_BUCKET_BYTES)),
                       float(entry.get("backward_share", DEFAULT_BACKWARD_SHARE)))
        except (TypeError, ValueError) as exc:
            raise HGraphError(f"{where}: push: malformed value ({exc})") from None


def gradient_bytes(hidden: int, layers: int, vocab: int, tp: int, pp: int) -> float:
    """fp32 gradient bytes one rank of a ``<TP, PP>`` pipeline pushes: a stage's share of the layers
    (12 H^2 parameters each: attention 4 H^2, MLP 8 H^2) and the vocabulary matrix of an end stage,
    over TP."""
    stage_layers = math.ceil(layers / pp)
    return 4.0 * (stage_layers * 12 * hidden * hidden + vocab * hidden) / tp


def optional_push(entry: Optional[dict], where: str) -> Optional[PushModel]:
    """A profile's ``push`` section, or None."""
    return None if entry is None else PushModel.from_dict(entry, where)
