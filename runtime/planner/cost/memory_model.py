"""The model's sizes (``ModelShape``) and the App. B.1 memory model of one rank (``MemoryModel``):
activations per token, model states (counted by the runtime where listed; an EP rank's experts
divided, ``moe_cost``), the loss's transient and MaxLen. ``cost_model`` builds on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hgraph.runtime.planner.cost.moe_cost import ExpertShape, ep_states_saved
from hgraph.runtime.planner.cost.ulysses import repeated_kv_bytes_per_token
from hgraph.strategy import Scheme

EMBEDDING_BYTES_PER_PARAM = 16  # App. B.1: the embedding term uses 16 bytes per parameter


@dataclass(frozen=True)
class ModelShape:
    """The sizes the memory model needs; the attention heads (None: unknown) decide the Ulysses degrees,
    the experts (None: a dense model) the EP degrees and their terms (``cost.moe_cost``)."""

    hidden: int
    layers: int
    vocab: int
    heads: Optional[int] = None
    kv_heads: Optional[int] = None      # None: as many as ``heads`` (multi-head attention)
    experts: Optional[ExpertShape] = None


@dataclass(frozen=True)
class MemoryModel:
    """Constants of the App. B.1 memory model (bytes)."""

    activation_coeff: tuple[tuple[int, float], ...]  # (tp, A): bytes per token per layer per hidden/TP
    state_coeff: float  # B
    alpha: float  # fraction of model-state bytes that are fully sharded over all N ranks
    framework_gap_bytes: int
    safety_margin_bytes: int
    gpu_memory_bytes: int
    # Optional terms of a memory model measured on this runtime (``runtime_memory``); the defaults
    # keep App. B.1 exactly: per TP degree, activation bytes per token outside the layers (embedding,
    # head, loss; split over TP x CP), and bytes per embedding parameter (B.1 uses 16).
    other_coeff: tuple[tuple[int, float], ...] = ()
    embedding_bytes_per_param: float = EMBEDDING_BYTES_PER_PARAM
    # Model states counted from the runtime's own layouts (``engine.model_states.scheme_states``):
    # ``((tp, pp, world size), (resident, step transient))`` bytes of the fullest rank of such a
    # pipeline (any CP), used instead of B.1's terms for the schemes listed: optimizer segments
    # (1/N) plus one working layout with its gradients; the optimizer step's transient must fit too.
    scheme_states: tuple[tuple[tuple[int, int, int], tuple[int, int]], ...] = ()
    # The chunked loss's transient logits (``runtime_memory.loss_transient_bytes``), allocated on top of
    # the saved activations while the loss runs: ``(tp, bytes per loss token, chunk tokens)``; it grows
    # with the tokens up to one chunk, then stays. Empty: not counted (App. B.1's models).
    loss_transient: tuple[tuple[int, float, int], ...] = ()

    def activation_A(self, tp: int) -> float | None:
        return dict(self.activation_coeff).get(tp)

    def counted_states(self, scheme: Scheme, world_size: int) -> tuple[int, int] | None:
        """``(resident, step transient)`` of ``scheme_states`` for this scheme and world size, if listed (a
        pipeline without EP: the runtime counted those)."""
        return dict(self.scheme_states).get((scheme.tp, scheme.pp, world_size)) if scheme.ep == 1 else None

    def state_bytes(self, model: ModelShape, scheme: Scheme, world_size: int) -> float:
        """Model states and embedding bytes on one rank of ``scheme`` (counted ones when listed)."""
        counted = self.counted_states(scheme, world_size)
        if counted is not None:
            return float(counted[0])
        if model.experts is not None and scheme.ep > 1:     # an EP rank's replicated states: its E/n experts
            return self.state_bytes(model, Scheme(scheme.tp, scheme.pp, scheme.cp, scheme.ul), world_size) \
                - ep_states_saved(model.hidden, model.layers, model.experts, pp=scheme.pp, tp=scheme.tp, ep=scheme.ep,
                                  bytes_per_param=self.embedding_bytes_per_param * (1 - self.alpha))
        h2 = model.hidden ** 2
        states = (model.layers * h2 / world_size) * self.state_coeff * self.alpha \
            + (model.layers / scheme.pp) * (h2 / scheme.tp) * self.state_coeff * (1 - self.alpha)
        emb = model.hidden * model.vocab
        embedding = emb / world_size * self.embedding_bytes_per_param * self.alpha \
            + emb / scheme.tp * self.embedding_bytes_per_param * (1 - self.alpha)
        return states + embedding

    def activation_bytes_per_token(self, model: ModelShape, scheme: Scheme) -> float | None:
        A = self.activation_A(scheme.tp)
        if A is None:
            return None
        other = dict(self.other_coeff).get(scheme.tp, 0.0) / scheme.seq     # CP or Ulysses: tokens / degree
        return model.layers * model.hidden / (scheme.tp * scheme.seq) * A + other \
            + repeated_kv_bytes_per_token(model.hidden, model.layers, model.heads, model.kv_heads, scheme)

    def activation_room(self, model: ModelShape, scheme: Scheme, world_size: int) -> float:
        """Device bytes a rank of ``scheme`` has for activations: memory minus the margin, the gap and
        the model states; 0 when even the model states (or the optimizer step) do not fit."""
        free = self.gpu_memory_bytes - self.safety_margin_bytes - self.framework_gap_bytes \
            - self.state_bytes(model, scheme, world_size)
        counted = self.counted_states(scheme, world_size)
        if counted is not None and free < counted[1]:      # the optimizer step itself does not fit
            return 0.0
        return max(float(free), 0.0)

    def transient_bytes(self, scheme: Scheme, tokens: int) -> float:
        """The loss's transient bytes on a rank of ``scheme`` for a micro-batch of ``tokens`` (a CP or
        Ulysses rank computes the loss of its ``tokens / degree``)."""
        per, chunk = self._transient(scheme)
        return per * min(tokens / scheme.seq, chunk)

    def _transient(self, scheme: Scheme) -> tuple[float, int]:
        for tp, per, chunk in self.loss_transient:
            if tp == scheme.tp:
                return per, chunk
        return 0.0, 0

    def max_len(self, model: ModelShape, scheme: Scheme, world_size: int) -> int:
        """Longest packed micro-batch (tokens) that fits with every activation on the device and the
        loss's transient logits beside them; 0 when even the model states do not fit."""
        per_token = self.activation_bytes_per_token(model, scheme)
        if per_token is None:
            return 0
        room = self.activation_room(model, scheme, world_size)
        per, chunk = self._transient(scheme)
        full = chunk * scheme.seq                 # the micro-batch length from which the transient stays
        if per and (per_token + per / scheme.seq) * full >= room:
            return max(int(room // (per_token + per / scheme.seq)), 0)
        return max(int((room - per * chunk) // per_token), 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "activation_bytes_per_token_per_layer_coeff_A": {f"tp{tp}": a for tp, a in self.activation_coeff},
            "model_state_coeff_B": self.state_coeff,
            "alpha_sharded_fraction": self.alpha,
            "framework_gap_bytes": self.framework_gap_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            **({"other_activation_bytes_per_token": {f"tp{tp}": v for tp, v in self.other_coeff}}
               if self.other_coeff else {}),
            **({"embedding_bytes_per_param": self.embedding_bytes_per_param}
               if self.embedding_bytes_per_param != EMBEDDING_BYTES_PER_PARAM else {}),
            **({"loss_transient": [{"tp": tp, "bytes_per_token": per, "chunk_tokens": chunk}
                                   for tp, per, chunk in self.loss_transient]}
               if self.loss_transient else {}),
            **({"model_state_bytes": [{"tp": tp, "pp": pp, "world_size": n, "resident": res, "step_transient": tr}
                                      for (tp, pp, n), (res, tr) in self.scheme_states]}
               if self.scheme_states else {}),
        }
