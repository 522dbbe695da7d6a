"""Test helpers: tiny Hugging Face model folders and checkpoints assembled without processes."""
from pathlib import Path

import torch

from hgraph.runtime.checkpoint import manifest as ckpt_manifest

from hgraph.runtime.checkpoint import rng_state

from hgraph.runtime.checkpoint import shards as ckpt
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.resume import run_state
from hgraph.runtime.train.model_setup import build_model

# small enough that the weights of both tiny models below are cut into several shards with an index
MAX_SHARD_SIZE = "20KB"
HF_CONFIGS = {
    "llama": ("LlamaConfig", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "attention_dropout": 0.0,
                              "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
    "qwen2": ("Qwen2Config", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "attention_dropout": 0.0,
                              "tie_word_embeddings": True}),
}


def save_tiny_hf(folder: Path, family: str, seed: int = 7) -> Path:
    """A tiny random ``family`` model (``from_config`` after ``manual_seed(seed)``) saved with
    ``save_pretrained`` in shards with an index; returns the folder."""
    import transformers
    config_cls, fields = HF_CONFIGS[family]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**fields))
    model.save_pretrained(folder, max_shard_size=MAX_SHARD_SIZE)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def assemble_checkpoint(folder: Path, model: str, world_size: int, model_args=None, step: int = 1) -> dict:
    """A checkpoint of ``model`` (seeded init, then moved a little so it differs from it) as ``world_size``
    ranks of ``hgraph train`` would save it, written without processes; returns the full parameters."""
    config = TrainConfig.from_values(model=model, model_args=dict(model_args or {}), seed=0)
    module = build_model(config)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    opts = [ShardedAdam(module.named_parameters(), None, r, world_size) for r in range(world_size)]
    entries = [ckpt.write_shard(folder, r, world_size, step, o, rng_state.capture_rng()) for r, o in enumerate(opts)]
    ckpt_manifest.write_manifest(folder, step, world_size, entries, run=run_state(config, world_size, module))
    return {n: p.detach().clone() for n, p in module.named_parameters()}
