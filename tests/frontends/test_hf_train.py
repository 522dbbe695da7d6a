"""``hgraph train`` on Hugging Face models equals single-device PyTorch training of the HF model.

Four gloo ranks, fp32, three Adam steps with the strategy switching every step (TP2 and PP2
pipelines side by side, pure data parallelism, one TP2 x PP2 pipeline). The reference runs the
unmodified HF model on each document alone with ``torch.optim.Adam``; the comparison is the noise-aware
one of ``tests/runtime/reference_training.py``.
"""
import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.runtime.reference_training import assert_trained_like, reference_run, write_random_documents  # noqa: E402

import hgraph  # noqa: E402
from hgraph.frontends.zoo import resolve_model_spec  # noqa: E402
from hgraph.runtime.data.documents import mini_batches, read_jsonl  # noqa: E402
from hgraph.tools.cli import main  # noqa: E402

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
SCHEDULE = "1xTP2PP1+1xTP1PP2;4xTP1PP1;1xTP2PP2"
MODELS = [
    ("hf:llama", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2}),
    ("hf:gpt2", {"vocab_size": 64, "n_embd": 32, "n_head": 4}),
    ("hf:qwen2", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2}),   # tied embeddings
    # a sliding window shorter than most documents (SDPA with a banded mask)
    ("hf:mistral", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "sliding_window": 4}),
    # q/k RMSNorm over all heads: partial sums of the TP-sharded width all-reduced
    ("hf:olmo2", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2}),
    # eager attention: logit softcapping, a sliding-window layer and a global one; final logit softcap, tied
    ("hf:gemma2", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4}),
    # fused projections: qkv_proj cut by slices, gate_up_proj by chunk; a padding row
    ("hf:phi3", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 2}),
    # per-head q/k RMSNorm over the head dim of sharded heads
    ("hf:qwen3", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 8}),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_random_documents(tmp_path_factory.mktemp("hf_train") / "docs.jsonl", LENGTHS, seed=3, vocab=64)


def _hf_logits(model, ids):
    return model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits


def _reference(spec, args, path, steps, tokens_per_iter, lr=1e-3):
    torch.manual_seed(0)
    return reference_run(resolve_model_spec(spec, args), mini_batches(read_jsonl(path), tokens_per_iter, steps), lr,
                         logits=_hf_logits)


@pytest.mark.parametrize("spec,args", MODELS, ids=[m[0] for m in MODELS])
def test_tp2_shards_at_least_95_percent_of_the_block_matrices(spec, args):
    """Fused q/k/v (GPT-2's c_attn split, Phi-3's sliced qkv_proj), fused gate/up (chunk), per-head
    norms: TP2 shards them part by part (``hgraph dump --format report`` shows each placement)."""
    with torch.device("meta"):
        model = resolve_model_spec(spec, args)
    (tp2,) = hgraph.compile(model).sharding_report("2xTP2PP1").summaries
    assert tp2.fraction_sharded(matrices_only=True) >= 0.95


# Qwen2 trains the same way in tests/runtime/weights/test_pretrained_round_trip.py (from its weights);
# Mistral's window takes the kernels Gemma-2's does (tests/frontends/test_hf_models.py packs it)
TRAINED = [m for m in MODELS if m[0] not in ("hf:qwen2", "hf:mistral")]


@pytest.mark.parametrize("spec,args", TRAINED, ids=[m[0] for m in TRAINED])
def test_training_with_switching_strategies_equals_pytorch(data, tmp_path, capsys, spec, args):
    final = tmp_path / "final.pt"
    rc = main(["train", "--model", spec, "--model-args", json.dumps(args), "--data", str(data),
               "--world-size", "4", "--strategy-schedule", SCHEDULE, "--steps", "3", "--tokens-per-iter", "30",
               "--save-final", str(final), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    steps = doc["steps"]
    assert [s["strategy"] for s in steps] == SCHEDULE.split(";")
    assert doc["sequence_parallel"] == "on"          # the TP2 pipelines ran Megatron SP
    state = torch.load(final)
    params = [n for n, _ in resolve_model_spec(spec, args).named_parameters()]
    assert_trained_like([s["loss"] for s in steps], state, _reference(spec, args, data, 3, 30), names=params)


def test_a_full_width_norm_over_repeated_key_value_heads_is_refused_in_one_line():
    # TP4 over 2 key/value heads gives two ranks the same head: OLMo-2's k norm over the whole width
    # would sum it twice
    from hgraph.errors import StrategyError
    with torch.device("meta"):
        model = resolve_model_spec("hf:olmo2", dict(TRAINED[[m[0] for m in TRAINED].index("hf:olmo2")][1]))
    with pytest.raises(StrategyError, match="split evenly over the TP ranks, each rank its own slice") as info:
        hgraph.compile(model).instantiate("1xTP4PP1")
    assert "\n" not in str(info.value)
