"""Hugging Face transformers models for the zoo: ``hf:llama``, ``hf:qwen2``, ``hf:mistral``, ``hf:phi3``,
``hf:qwen3``, ``hf:gpt2``.

Each is built from a config (random initialisation, never downloading weights): a tiny default
config, overridden field by field by ``model_args`` (``--model-args '{"num_hidden_layers": 4}'``).
Dropout defaults to 0 (give e.g. ``{"attention_dropout": 0.1}`` to train with it: hgraph applies it with
strategy-invariant masks) and sliding-window attention is off, as packed documents need. transformers
is an optional dependency: ``pip install -e '.[hf]'`` in the hgraph checkout.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from hgraph.errors import HGraphError

_LLAMA_LIKE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
               "attention_dropout": 0.0}
# family -> (config class, model class, tiny default config)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_LIKE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA_LIKE, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_LLAMA_LIKE, sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_LLAMA_LIKE, pad_token_id=0)),     # fused qkv and gate_up
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_LLAMA_LIKE, head_dim=16)),     # per-head q/k RMSNorm
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                               "n_positions": 512, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                               "attn_pdrop": 0.0}),
}
CONFIGS = {name: defaults for name, (_, _, defaults) in FAMILIES.items()}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise HGraphError("Hugging Face models need the transformers package: pip install -e '.[hf]' in the "
                          "hgraph checkout (or pip install transformers)") from None
    return transformers


def build(name: str, **overrides: Any) -> nn.Module:
    """A randomly initialised ``hf:NAME`` model; ``overrides`` are config fields."""
    if name not in FAMILIES:
        raise HGraphError(f"unknown Hugging Face model {name!r}; allowed: "
                          f"{', '.join('hf:' + n for n in FAMILIES)}")
    tf = _transformers()
    config_cls, model_cls, defaults = FAMILIES[name]
    fields = dict(defaults, **overrides)
    fields.setdefault("attn_implementation", "sdpa")
    try:
        config = getattr(tf, config_cls)(**fields)
    except Exception as exc:  # transformers validates fields with its own error types
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HGraphError(f"hf:{name}: config {fields} is not valid for {config_cls}: {reason}") from None
    return getattr(tf, model_cls)(config)
