"""How a model's weights look to Hugging Face: the config ``from_pretrained`` reads and every tensor's key.

``hf_form(model)`` for the two kinds of models ``hgraph export --format hf`` writes:

* a transformers model (``hf:llama``, ``hf:DIR``, ...): its own config, and its own names; tied
  weights once, under the canonical name (``named_parameters()``: ``model.embed_tokens.weight``, not
  ``lm_head.weight``), as ``save_pretrained`` writes them; persistent buffers as its state_dict has them;
* the zoo Llama (``hgraph.frontends.zoo.llama``): a ``LlamaConfig`` of the same math, and its names
  under ``model.`` (``lm_head.weight`` stays). The zoo model is written to match ``LlamaForCausalLM``:
  RMSNorm in fp32 with ``rms_norm_eps``, rotary embedding in the half-split layout with
  ``inv_freq = 1 / theta^(2i/d)`` on ``position_ids`` (``rope_theta``, default rope type), grouped-query
  attention of ``num_kv_heads``, SiLU-gated MLP (``gate_proj``, ``up_proj``, ``down_proj``), no biases,
  and ``lm_head`` tied to ``embed_tokens`` when ``tie_embeddings``; the round trip test checks logits.

Any other model has no Hugging Face form: a one-line error says to export it with ``--format torch``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import hf
from hgraph.frontends.zoo.llama import Llama


@dataclass
class HFForm:
    """A model in Hugging Face form: ``config`` (a transformers config), parameter and persistent-buffer
    names -> their keys in the safetensors files, in the order they are written."""

    config: Any
    params: dict[str, str]
    buffers: dict[str, str]


def hf_form(model: nn.Module) -> HFForm:
    """The Hugging Face form of ``model``; HGraphError when it has none."""
    if isinstance(model, Llama):
        return _zoo_llama(model)
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_json_string", None)) and callable(getattr(model, "save_pretrained", None)):
        config.architectures = [type(model).__name__]
        config.dtype = torch.float32            # the masters are written as they are
        params = {name: name for name, _ in model.named_parameters()}
        buffers = {name: name for name in _persistent_buffers(model)}
        return HFForm(config, params, buffers)
    raise HGraphError(f"{type(model).__name__} has no Hugging Face form: --format hf writes Hugging Face "
                      "models (hf:...) and the zoo Llama (llama:...); export it with --format torch")


def _persistent_buffers(model: nn.Module) -> list[str]:
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict(keep_vars=True) if name not in params]


def _zoo_llama(model: Llama) -> HFForm:
    c = model.config
    tf = hf.transformers_module()
    config = tf.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, hidden_act="silu", max_position_embeddings=c.max_seq_len,
        initializer_range=c.init_std, rms_norm_eps=c.rms_norm_eps, pad_token_id=c.pad_token_id,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=c.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)},
        attention_bias=False, mlp_bias=False, attention_dropout=float(c.attention_dropout),
        architectures=["LlamaForCausalLM"], dtype=torch.float32)
    params = {name: name if name == "lm_head.weight" else f"model.{name}" for name, _ in model.named_parameters()}
    return HFForm(config, params, {})
