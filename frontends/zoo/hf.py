"""Hugging Face transformers models for the zoo: ``hf:llama``, ``hf:qwen2``, ``hf:mistral``, ``hf:phi3``,
``hf:qwen3``, ``hf:olmo2``, ``hf:gemma2``, ``hf:gpt2``, the mixtures of experts ``hf:qwen3_moe``,
``hf:qwen2_moe`` and ``hf:mixtral`` (``hgraph.frontends.moe_blocks``), and ``hf:DIR``, a local Hugging
Face model directory.

Each zoo name is built from a config (random initialisation, never downloading weights): a tiny
default config, overridden field by field by ``model_args`` (``--model-args '{"num_hidden_layers": 4}'``).
Dropout defaults to 0 (give e.g. ``{"attention_dropout": 0.1}`` to train with it: hgraph applies it with
strategy-invariant masks). Sliding windows are kept per document (Mistral's is off by default, as in
its recent releases; ``{"sliding_window": 4096}`` turns it on; the tiny Gemma-2 has a 64-token one).

``hf:DIR`` takes the architecture from ``DIR/config.json`` (``AutoConfig``, local files only, the
``model_args`` overriding its fields) and builds it with ``AutoModelForCausalLM.from_config`` in fp32
with SDPA attention; the weights in DIR's safetensors are the run's to read
(``hgraph.runtime.weights``), never this module's. A name that is neither a zoo name nor a local
directory is an error: nothing is ever downloaded. ``from_config_dict`` rebuilds a model from the
config a checkpoint recorded (``hgraph export``).

transformers is an optional dependency: ``pip install -e '.[hf]'`` in the hgraph checkout.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch
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
    # RMSNorm of q and k over all heads (the full width of a TP-sharded projection), norms after the blocks
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_LLAMA_LIKE, eos_token_id=None)),
    # eager attention with logit softcapping, sliding-window layers between global ones, a padding row
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_LLAMA_LIKE, head_dim=16, pad_token_id=0,
                                                         sliding_window=64)),
    # mixtures of experts (fused expert weights, a router module): recognised and run as hgraph's MoE op
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_LLAMA_LIKE, head_dim=16, moe_intermediate_size=32,
                                                                num_experts=8, num_experts_per_tok=2,
                                                                norm_topk_prob=True)),
    # a shared expert gated by sigmoid(Linear(hidden, 1)) beside the routed ones
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_LLAMA_LIKE, moe_intermediate_size=32, num_experts=8,
                                                                num_experts_per_tok=2,
                                                                shared_expert_intermediate_size=64)),
    # the experts are intermediate_size wide; routing renormalises the top-k
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_LLAMA_LIKE, intermediate_size=32, num_local_experts=4,
                                                            num_experts_per_tok=2, sliding_window=None)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                               "n_positions": 512, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                               "attn_pdrop": 0.0}),
}
CONFIGS = {name: defaults for name, (_, _, defaults) in FAMILIES.items()}


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise HGraphError("Hugging Face models need the transformers package: pip install -e '.[hf]' in the "
                          "hgraph checkout (or pip install transformers)") from None
    return transformers


def local_dir(name: str) -> Optional[Path]:
    """The local model directory ``hf:NAME`` names, or None for a zoo name."""
    return None if name in FAMILIES else Path(name)


def build(name: str, **overrides: Any) -> nn.Module:
    """A randomly initialised ``hf:NAME`` model (a zoo name or a local directory);
    ``overrides`` are config fields."""
    if name not in FAMILIES:
        return _from_config(directory_config(name, overrides), f"hf:{name}")
    tf = transformers_module()
    config_cls, model_cls, defaults = FAMILIES[name]
    fields = dict(defaults, **overrides)
    fields.setdefault("attn_implementation", "sdpa" if getattr(getattr(tf, model_cls), "_supports_sdpa", True)
                      else "eager")
    try:
        config = getattr(tf, config_cls)(**fields)
    except Exception as exc:  # transformers validates fields with its own error types
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HGraphError(f"hf:{name}: config {fields} is not valid for {config_cls}: {reason}") from None
    return getattr(tf, model_cls)(config)


def directory_config(name: str, overrides: Optional[Mapping[str, Any]] = None) -> Any:
    """The ``PretrainedConfig`` of the local model directory ``name`` (its ``config.json``), with
    ``overrides`` applied; one-line HGraphError when there is no such directory or config."""
    directory = Path(name)
    if not directory.is_dir():
        raise HGraphError(f"unknown Hugging Face model {name!r}; allowed: {', '.join('hf:' + n for n in FAMILIES)}, "
                          f"or hf:DIR, a local model directory (config.json + *.safetensors); {name!r} is not a "
                          "local directory and hgraph never downloads models")
    if not (directory / "config.json").is_file():
        raise HGraphError(f"hf:{name}: {str(directory / 'config.json')!r} does not exist; a Hugging Face model "
                          "directory holds config.json and its *.safetensors")
    tf = transformers_module()
    try:
        return tf.AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False,
                                             **dict(overrides or {}))
    except Exception as exc:  # transformers raises ValueError, OSError, JSON errors, ...
        raise HGraphError(f"hf:{name}: {str(directory / 'config.json')!r} cannot be read as a transformers "
                          f"config: {_first_line(exc)}") from None


def from_config_dict(values: Mapping[str, Any]) -> nn.Module:
    """A model of the config recorded as ``json.loads(config.to_json_string())`` (a checkpoint's run)."""
    tf = transformers_module()
    values = dict(values)
    model_type = values.pop("model_type", None)
    try:
        config = tf.AutoConfig.for_model(model_type, **values)
    except Exception as exc:
        raise HGraphError(f"a recorded Hugging Face config of model type {model_type!r} cannot be rebuilt: "
                          f"{_first_line(exc)}") from None
    return _from_config(config, f"the recorded {model_type} config")


def _from_config(config: Any, what: str) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` in fp32 with SDPA attention (eager where the architecture
    has no SDPA path); one line when it cannot."""
    tf = transformers_module()
    try:
        try:
            return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32,
                                                       trust_remote_code=False)
        except ValueError as exc:
            if "scaled_dot_product_attention" not in str(exc):
                raise
            return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32,
                                                       trust_remote_code=False)
    except Exception as exc:  # an architecture transformers has no causal LM for, or bad fields
        raise HGraphError(f"{what}: transformers cannot build a causal language model of model type "
                          f"{getattr(config, 'model_type', '?')!r}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
