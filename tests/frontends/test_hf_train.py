"""Training Hugging Face models equals single-device PyTorch training of the HF model.

Four gloo ranks, fp32, three Adam steps with the strategy switching every step (TP2 and PP2
pipelines side by side, pure data parallelism, one TP2 x PP2 pipeline). The reference runs the
unmodified HF model on each document alone with ``torch.optim.Adam``; the comparison is the noise-aware
one of ``tests/runtime/reference_training.py``.

One spawn of 4 ranks trains every model but one, a ``Trainer`` per model on the same process groups;
GPT-2 goes through ``hgraph train --model hf:gpt2 --model-args ...`` end to end. Both sides read the
mini-batches of the same data file. A trace (torch.export) costs 1.5-2.5 s of CPU per model and
process, most of this module's time: the TP2 sharding report and OLMo-2's TP4 refusal are read from
the compiles rank 0 trained with, and the models no rank trains are traced by the other ranks after
training, so no model is traced twice in one process.
"""

import pytest
import torch

pytest.importorskip("transformers")

from tests.runtime.reference_training import assert_trained_like, reference_run, write_random_documents  # noqa: E402

import hgraph  # noqa: E402
from hgraph.errors import StrategyError  # noqa: E402
from hgraph.frontends.zoo import resolve_model_spec  # noqa: E402
from hgraph.runtime.comm.process_groups import GroupCache  # noqa: E402
from hgraph.runtime.data.documents import mini_batches, read_jsonl  # noqa: E402
from hgraph.runtime.train.config import TrainConfig  # noqa: E402
from hgraph.runtime.train.launch import spawn  # noqa: E402
from hgraph.runtime.train.trainer import Trainer  # noqa: E402
from hgraph.runtime.train.run import prepare  # noqa: E402
from hgraph.runtime.train.run_config import config_from_options  # noqa: E402

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
SCHEDULE = "1xTP2PP1+1xTP1PP2;4xTP1PP1;1xTP2PP2"
STEPS, TOKENS_PER_ITER = 3, 30
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
ARGS = dict(MODELS)

# Qwen2 trains the same way in tests/runtime/weights/test_pretrained_round_trip.py (from its weights);
# Mistral's window takes the kernels Gemma-2's does (tests/frontends/test_hf_models.py packs it)
TRAINED = [m for m in MODELS if m[0] not in ("hf:qwen2", "hf:mistral")]
CLI_MODEL = "hf:gpt2"                 # the cheapest to trace: the command line's path, end to end
SPAWNED = [m for m in TRAINED if m[0] != CLI_MODEL]
# the TP2 report of these is traced on the meta device by the spawn's ranks 1..3 after training (rank 0
# reports on the compiles it trained with)
META_ONLY = [m[0] for m in MODELS if m[0] not in dict(SPAWNED)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_random_documents(tmp_path_factory.mktemp("hf_train") / "docs.jsonl", LENGTHS, seed=3, vocab=64)


def _batches(path):
    return list(mini_batches(read_jsonl(path), TOKENS_PER_ITER, STEPS))


def _worker(rank, world, path):
    groups = GroupCache(rank, world)
    docs = [list(d.input_ids) for d in read_jsonl(path)]
    out, tp2 = {}, {}
    for spec, args in SPAWNED:
        config = TrainConfig.from_values(model=spec, model_args=args, world_size=world, strategy_schedule=SCHEDULE,
                                         steps=STEPS, tokens_per_iter=TOKENS_PER_ITER, docs=docs)
        trainer = Trainer(config, rank, world, groups)
        steps = [trainer.step(b) for b in _batches(path)]
        final = trainer.final_state_dict()            # collective: every rank gathers
        out[spec] = {"losses": [s.loss for s in steps], "strategies": [s.strategy for s in steps],
                     "sequence_parallel": trainer.sequence_parallel, "final": final if rank == 0 else None}
        if rank == 0:         # the checks of the compile on the trace the training used (no second trace)
            tp2[spec] = _tp2_sharded(trainer.compiled)
            out[spec]["tp4_refusal"] = _tp4_refusal(trainer.compiled)
    for spec in META_ONLY[rank - 1::world - 1] if rank > 0 else ():
        tp2[spec] = _tp2_sharded(_meta_compiled(spec))
    return out, tp2


@pytest.fixture(scope="module")
def spawned(data):
    """Rank 0's training results per model, and the TP2 fraction of every model (from all ranks)."""
    ranks = spawn(_worker, 4, args=(str(data),), timeout_s=300)
    return ranks[0][0], {spec: f for _, tp2 in ranks for spec, f in tp2.items()}


def _tp2_sharded(compiled):
    (tp2,) = compiled.sharding_report("2xTP2PP1").summaries
    return tp2.fraction_sharded(matrices_only=True)


def _tp4_refusal(compiled):
    """The one-line refusal of ``1xTP4PP1`` (None: instantiated)."""
    try:
        compiled.instantiate("1xTP4PP1")
    except StrategyError as exc:
        return str(exc)
    return None


def _meta_compiled(spec):
    with torch.device("meta"):
        model = resolve_model_spec(spec, ARGS[spec])
    return hgraph.compile(model)


def _hf_logits(model, ids):
    return model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits


def _reference(spec, path, lr=1e-3):
    torch.manual_seed(0)
    return reference_run(resolve_model_spec(spec, ARGS[spec]), _batches(path), lr, logits=_hf_logits)


def _assert_equals_reference(spec, strategies, sequence_parallel, losses, state, path):
    assert strategies == SCHEDULE.split(";")
    assert sequence_parallel == "on"          # the TP2 pipelines ran Megatron SP
    params = [n for n, _ in resolve_model_spec(spec, ARGS[spec]).named_parameters()]
    assert_trained_like(losses, state, _reference(spec, path), names=params)


@pytest.mark.parametrize("spec", [m[0] for m in MODELS])
def test_tp2_shards_at_least_95_percent_of_the_block_matrices(spawned, spec):
    """Fused q/k/v (GPT-2's c_attn split, Phi-3's sliced qkv_proj), fused gate/up (chunk), per-head
    norms: TP2 shards them part by part (``hgraph dump --format report`` shows each placement). A
    trained model's fraction is read from the compile rank 0 trained it with; the others are traced
    on the meta device by the other ranks."""
    _, tp2 = spawned
    assert tp2[spec] >= 0.95


@pytest.mark.parametrize("spec", [m[0] for m in SPAWNED])
def test_training_with_switching_strategies_equals_pytorch(spawned, data, spec):
    got = spawned[0][spec]
    _assert_equals_reference(spec, got["strategies"], got["sequence_parallel"], got["losses"], got["final"], data)


def test_hgraph_train_on_a_hugging_face_model_equals_pytorch(data, tmp_path):
    """The run of ``hgraph train`` (its run object: runtime/train/run.py), the trained weights in memory."""
    config, _ = config_from_options({"model": CLI_MODEL, "model_args": ARGS[CLI_MODEL], "data": str(data),
                                     "world_size": 4, "strategy_schedule": SCHEDULE, "steps": STEPS,
                                     "tokens_per_iter": TOKENS_PER_ITER, "json": True})
    with prepare(config.with_values(return_final=True)) as run:
        summary = run.execute()
    steps = summary.steps
    _assert_equals_reference(CLI_MODEL, [s["strategy"] for s in steps], summary.sequence_parallel,
                             [s["loss"] for s in steps], summary.final_state, data)


def test_a_full_width_norm_over_repeated_key_value_heads_is_refused_in_one_line(spawned):
    # TP4 over 2 key/value heads gives two ranks the same head: OLMo-2's k norm over the whole width
    # would sum it twice (instantiated on the compile the spawn's rank 0 trained OLMo-2 with)
    refusal = spawned[0]["hf:olmo2"]["tp4_refusal"]
    assert refusal is not None and "split evenly over the TP ranks, each rank its own slice" in refusal
    assert "\n" not in refusal
