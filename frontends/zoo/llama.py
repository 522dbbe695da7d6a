"""A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP).

Submodules are named like Hugging Face's ``LlamaForCausalLM`` (``embed_tokens``, ``layers.i.self_attn.
q_proj``, ``mlp.gate_proj``, ``norm``, ``lm_head``) so checkpoints and FQNs line up. The model is
written to trace with ``torch.fx``:

* rotary cos/sin are computed from ``position_ids`` (never sliced from a table by a traced length),
  so a packed micro-batch with per-document positions is exactly the same computation as running
  each document alone;
* heads are reshaped with ``-1`` for the head count, so a tensor-parallel shard (fewer heads per
  rank) runs the same graph without any shape rewrite;
* attention is ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=...)``, with
  ``dropout_p = attention_dropout`` in training (0 by default, as Hugging Face's Llama).

Named configs: ``tiny`` and ``tiny-tied`` for CPU tests, and the shapes of ``7b``, ``13b``
(Llama-2), ``32b`` (LLaMA-33B shape, the "32B" of the Hydraulis paper: hidden 6656, 60 layers) and
``70b`` (Llama-2, GQA). The large ones are only ever used arithmetically on CPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from hgraph.errors import HGraphError


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-style decoder. ``head_dim`` defaults to hidden / heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    init_std: float = 0.02
    pad_token_id: Optional[int] = None    # the embedding's padding_idx (Hugging Face's pad_token_id)
    attention_dropout: float = 0.0        # dropout of the attention probabilities in training (Hugging Face's)

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise HGraphError(f"LlamaConfig: hidden_size {self.hidden_size} is not divisible by "
                                  f"num_heads {self.num_heads}; give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_seq_len")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise HGraphError(f"LlamaConfig: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise HGraphError(f"LlamaConfig: num_heads {self.num_heads} must be a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise HGraphError(f"LlamaConfig: head_dim {self.head_dim} must be even for rotary embeddings")
        if not isinstance(self.attention_dropout, (int, float)) or not 0.0 <= self.attention_dropout < 1.0:
            raise HGraphError(f"LlamaConfig: attention_dropout must be in [0, 1), got {self.attention_dropout!r}")
        pad = self.pad_token_id
        if pad is not None and (not isinstance(pad, int) or not 0 <= pad < self.vocab_size):
            raise HGraphError(f"LlamaConfig: pad_token_id must be a token id in [0, {self.vocab_size}), "
                              f"got {pad!r}")

    def num_parameters(self) -> int:
        """Number of parameter elements, from the shapes alone (a tied head counts once)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h  # two RMSNorm weights
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h  # + final norm


CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=4,
                        num_heads=4, num_kv_heads=2, max_seq_len=1024),
    "tiny-tied": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=3,
                             num_heads=4, num_kv_heads=1, tie_embeddings=True, max_seq_len=1024),
    "7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, max_seq_len=4096),
    "13b": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
                       num_heads=40, num_kv_heads=40, max_seq_len=4096),
    "32b": LlamaConfig(vocab_size=32000, hidden_size=6656, intermediate_size=17920, num_layers=60,
                       num_heads=52, num_kv_heads=52, rms_norm_eps=1e-6, max_seq_len=2048),
    "70b": LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, max_seq_len=4096),
}


@torch.fx.wrap
def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-1 for every row of ``input_ids`` [B, T] (one document per row)."""
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float):
    """fp32 cos and sin [B, T, head_dim] of the angles position * inv_freq (HF half-split layout).

    They depend on the positions only (not on any activation, parameter or buffer), so every
    pipeline stage can recompute them instead of receiving them.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = position_ids.unsqueeze(-1).to(torch.float32) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by the angles whose cos/sin are [B, T, head_dim]."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Llama does) and scale in the input's dtype.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = config
        self.head_dim = c.head_dim
        self.gqa = c.num_kv_heads != c.num_heads
        self.dropout_p = float(c.attention_dropout)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 for the head count: a TP shard holding fewer heads runs the same code.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                                             is_causal=True, enable_gqa=self.gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """A Llama-style decoder: embedding, ``config.num_layers`` layers made by ``make_layer``, a final norm
    and the output head: ``forward(input_ids, position_ids=None) -> logits [B, T, V]``. A family differs in
    its layers only (``Llama``'s dense MLP, ``llama_moe``'s experts)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.layers = nn.ModuleList(self.make_layer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, config: LlamaConfig, index: int) -> nn.Module:
        """Layer ``index`` of the stack, ``forward(x, cos, sin) -> x``."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its layers are made")

    def reset_parameters(self) -> None:
        """Llama initialisation: N(0, init_std) for linear and embedding weights (a router's too), ones
        for norms, a zero padding row (as ``nn.Embedding`` and Hugging Face initialise it; it never trains)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.config.pad_token_id is not None:
            with torch.no_grad():
                self.embed_tokens.weight[self.config.pad_token_id].zero_()

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = default_position_ids(input_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class Llama(DecoderStack):
    """Decoder-only language model with dense SwiGLU MLPs."""

    def make_layer(self, config: LlamaConfig, index: int) -> nn.Module:
        return DecoderLayer(config)


def build(name_or_config: Union[str, LlamaConfig], **overrides: Any) -> Llama:
    """A freshly initialised Llama from a named config (see ``CONFIGS``) or a LlamaConfig.

    ``overrides`` replace config fields, e.g. ``build("tiny", num_layers=32)``.
    """
    return Llama(make_config(name_or_config, **overrides))


def make_config(name_or_config: Union[str, LlamaConfig], **overrides: Any) -> LlamaConfig:
    """The LlamaConfig named (or given), with ``overrides`` applied; bad names or fields -> HGraphError."""
    return configure("llama", CONFIGS, LlamaConfig, name_or_config, overrides)


def configure(family: str, configs: Mapping[str, LlamaConfig], kind: type, name_or_config: Union[str, LlamaConfig],
              overrides: Mapping[str, Any]) -> Any:
    """The config of ``kind`` named in ``configs`` (or given), with ``overrides`` applied; bad names or
    fields -> one HGraphError line naming the ``family``."""
    if isinstance(name_or_config, kind):
        config = name_or_config
    elif name_or_config in configs:
        config = configs[name_or_config]
    else:
        raise HGraphError(f"unknown {family} config {name_or_config!r}; known configs: {', '.join(configs)}")
    fields = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise HGraphError(f"unknown {family} config field(s) {', '.join(unknown)}; "
                          f"allowed: {', '.join(sorted(fields))}")
    if overrides:
        changes: Mapping[str, Any] = dict(overrides)
        # A new head count must not keep the old derived head_dim.
        if "head_dim" not in changes and ({"hidden_size", "num_heads"} & set(changes)):
            changes = {**changes, "head_dim": None}
        if "num_kv_heads" not in changes and "num_heads" in changes and config.num_kv_heads == config.num_heads:
            changes = {**changes, "num_kv_heads": None}
        config = dataclasses.replace(config, **changes)
    return config


def tp_shard_config(cfg: LlamaConfig, layers: int, tp: int) -> LlamaConfig:
    """The LlamaConfig of one TP rank's shard with ``layers`` layers: heads, KV heads, MLP width and
    vocabulary divided by ``tp`` (the head size and the hidden size stay). The runtime builds such
    shards to measure one rank's time and activation bytes."""
    return dataclasses.replace(cfg, num_layers=layers, num_heads=cfg.num_heads // tp,
                               num_kv_heads=max(cfg.num_kv_heads // tp, 1), head_dim=cfg.head_dim,
                               intermediate_size=-(-cfg.intermediate_size // tp),
                               vocab_size=-(-cfg.vocab_size // tp))
