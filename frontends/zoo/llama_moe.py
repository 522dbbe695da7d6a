"""A Llama-style mixture-of-experts decoder: ``llama-moe:tiny`` and a 16B-class config.

Each MoE layer has a top-k softmax router (``mlp.gate``, a Linear to the experts), SwiGLU experts
(``mlp.experts.i.gate_proj / up_proj / down_proj``), optional shared experts (``mlp.shared_experts``,
a dense SwiGLU MLP every token runs) and the first ``first_dense_layers`` layers may be dense (a
plain Llama MLP), as DeepSeek-MoE and Qwen-MoE lay them out. The rest (attention, norms, rotary
positions, the head) is the zoo's Llama (``hgraph.frontends.zoo.llama``).

The MoE block is written the way people write it: a Python loop over the experts that skips an
expert no token chose (``if token.numel() == 0: continue``). Neither frontend traces that
data-dependent control flow; the frontends recognise the block by its structure and swap in
hgraph's MoE op (``hgraph.frontends.moe_blocks``, ``hgraph.moe``), which computes the same numbers.

Named configs: ``tiny`` (CPU tests) and ``16b``, the shape of DeepSeek-MoE 16B (Dai et al., 2024,
"DeepSeekMoE", and its published ``config.json``: hidden 2048, 28 layers, 16 heads, vocabulary
102400, 64 routed experts of width 1408 with top-6 routing, 2 shared experts, the first layer dense
with width 10944; 16.4B parameters). Large configs are only ever used arithmetically on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from hgraph.errors import HGraphError
from hgraph.frontends.zoo.llama import Attention, DecoderStack, LlamaConfig, RMSNorm, configure


@dataclass(frozen=True)
class LlamaMoeConfig(LlamaConfig):
    """A LlamaConfig plus the experts: ``num_experts`` routed experts of width ``moe_intermediate_size``,
    ``top_k`` of them per token (their weights renormalised to sum to one when ``normalize_top_k``),
    ``num_shared_experts`` shared experts (one MLP of width ``num_shared_experts * moe_intermediate_size``)
    and ``first_dense_layers`` leading dense layers of width ``intermediate_size``."""

    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 32
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    normalize_top_k: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "top_k", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise HGraphError(f"LlamaMoeConfig: {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise HGraphError(f"LlamaMoeConfig: top_k {self.top_k} exceeds num_experts {self.num_experts}")
        for name in ("num_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise HGraphError(f"LlamaMoeConfig: {name} must be a non-negative integer, got {value!r}")
        if self.first_dense_layers > self.num_layers:
            raise HGraphError(f"LlamaMoeConfig: first_dense_layers {self.first_dense_layers} exceeds num_layers "
                              f"{self.num_layers}")

    def num_parameters(self) -> int:
        """Number of parameter elements, from the shapes alone (a tied head counts once)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention_and_norms = h * q + 2 * h * kv + q * h + 2 * h
        dense_mlp = 3 * h * self.intermediate_size
        moe = h * self.num_experts + 3 * h * self.moe_intermediate_size * (self.num_experts + self.num_shared_experts)
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return (embeddings + h + self.num_layers * attention_and_norms + self.first_dense_layers * dense_mlp
                + (self.num_layers - self.first_dense_layers) * moe)

    def activated_parameters(self) -> int:
        """Parameters a token uses: the routed experts counted ``top_k`` times instead of ``num_experts``."""
        unused = 3 * self.hidden_size * self.moe_intermediate_size * (self.num_experts - self.top_k)
        return self.num_parameters() - (self.num_layers - self.first_dense_layers) * unused


CONFIGS: dict[str, LlamaMoeConfig] = {
    "tiny": LlamaMoeConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=3, num_heads=4,
                           num_kv_heads=2, max_seq_len=1024, num_experts=8, top_k=2, moe_intermediate_size=32,
                           num_shared_experts=1, first_dense_layers=1),
    "16b": LlamaMoeConfig(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=28,
                          num_heads=16, num_kv_heads=16, rms_norm_eps=1e-6, max_seq_len=4096, num_experts=64,
                          top_k=6, moe_intermediate_size=1408, num_shared_experts=2, first_dense_layers=1),
}


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: an expert, the shared experts, a dense MLP."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeBlock(nn.Module):
    """Top-k routing to SwiGLU experts written as a loop over the experts (plus shared experts)."""

    def __init__(self, config: LlamaMoeConfig):
        super().__init__()
        c = config
        self.top_k, self.normalize_top_k = c.top_k, c.normalize_top_k
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))
        self.shared_experts = (SwiGLU(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts)
                               if c.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(selected == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(b, t, h)


class MoeDecoderLayer(nn.Module):
    def __init__(self, config: LlamaMoeConfig, dense: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size) if dense else MoeBlock(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaMoe(DecoderStack):
    """Decoder-only MoE language model: ``forward(input_ids, position_ids=None) -> logits [B, T, V]``; the
    first ``first_dense_layers`` layers have a dense MLP, the others experts."""

    def make_layer(self, config: LlamaMoeConfig, index: int) -> nn.Module:
        return MoeDecoderLayer(config, index < config.first_dense_layers)


def build(name_or_config: Union[str, LlamaMoeConfig], **overrides: Any) -> LlamaMoe:
    """A freshly initialised LlamaMoe from a named config (``CONFIGS``) or a LlamaMoeConfig; ``overrides``
    replace config fields (``build("tiny", num_experts=4)``); bad names or fields -> HGraphError."""
    return LlamaMoe(configure("llama-moe", CONFIGS, LlamaMoeConfig, name_or_config, overrides))
