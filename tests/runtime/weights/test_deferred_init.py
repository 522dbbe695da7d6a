"""A model built on the meta device and initialised one tensor at a time equals the eager build.

``record_init`` + ``InitRecord.replay`` must give, bitwise, the parameters and buffers of the model
built after ``torch.manual_seed(seed)`` (the equivalence tests compare against that build), leave
the generator as it found it, allocate nothing while recording, and hold about one tensor at a
time while replaying.
"""
import pytest
import torch
import torch.nn as nn

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.weights.deferred_init import NotRecordable, record_init
from hgraph.runtime.weights.sources import SeededInit, install_buffers


class Mixed(nn.Module):
    """Init styles a user model has: a factory with arithmetic, in-place edits of a view, buffers from
    torch ops and from Python data, a tied weight, and a re-init that overwrites the default one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 16, padding_idx=3)
        self.scale = nn.Parameter(torch.randn(16) * 0.5 + 1.0)
        self.proj = nn.Linear(16, 24)
        with torch.no_grad():
            nn.init.normal_(self.proj.weight, std=0.02).clamp_(-0.03, 0.03)
        with torch.no_grad():
            self.proj.bias[:4].fill_(0.25)
        self.head = nn.Linear(16, 37, bias=False)
        self.head.weight = self.emb.weight
        inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("table", torch.outer(torch.arange(8).float(), inv))
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 0.0]) * 2)
        self.out = nn.Linear(24, 16)
        nn.init.xavier_normal_(self.out.weight)     # overwrites kaiming_uniform_: the RNG still advances
        self.last = nn.Parameter(torch.empty(5, 3).uniform_(-1, 1))


def _eager(factory, seed):
    torch.manual_seed(seed)
    model = factory()
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _replayed(factory, seed):
    record = record_init(factory, seed)
    assert all(p.is_meta for p in record.model.parameters())
    return {name: t.clone() for name, t in record.replay()}, record


FACTORIES = {
    "user module": Mixed,
    "zoo llama with padding row": lambda: resolve_model_spec("llama:tiny", {"pad_token_id": 0, "num_layers": 2}),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_replay_is_bitwise_the_eager_build(name):
    factory = FACTORIES[name]
    want = _eager(factory, 7)
    got, _ = _replayed(factory, 7)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_hugging_face_models_init_as_eagerly_built(family):
    """Hugging Face skips its weight init under ``torch.device("meta")``; the recorder must not."""
    pytest.importorskip("transformers")
    factory = lambda: resolve_model_spec(f"hf:{family}", {})      # noqa: E731
    want = _eager(factory, 11)
    got, _ = _replayed(factory, 11)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_generator_is_left_as_found_and_recording_allocates_nothing():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    record = record_init(lambda: resolve_model_spec("llama:tiny", {"vocab_size": 50000, "hidden_size": 2048,
                                                                  "intermediate_size": 5632, "num_layers": 16,
                                                                  "num_heads": 16}), seed=0)
    assert sum(p.numel() for p in record.model.parameters()) > 900e6     # recorded, never allocated
    # a replay draws every value up to the last parameter it makes (14 s for this model): a small one
    small = record_init(lambda: resolve_model_spec("llama:tiny", {"num_layers": 2}), seed=0)
    list(small.replay({"norm.weight"}))
    assert torch.equal(torch.rand(3), expected)


def test_replay_holds_about_one_parameter_at_a_time():
    """A model of 16 blocks whose Linear init is overwritten later (as Hugging Face's post_init does):
    the replay's peak is the biggest tensor plus little, not the model."""
    class ReInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(16))
            for b in self.blocks:
                nn.init.normal_(b.weight, std=0.02)
    got, record = _replayed(ReInit, 0)
    one = 256 * 256 * 4
    assert record.peak_bytes <= 2 * one
    want = _eager(ReInit, 0)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_init_that_reads_values_is_refused_in_one_line():
    """trunc_normal_ samples until no value is out of bounds: it needs data. (On the meta device torch
    skips it without a word, which would change the initial values silently.)"""
    class Truncated(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)
            nn.init.trunc_normal_(self.w.weight, std=0.02)
    with pytest.raises(NotRecordable, match=r"reads tensor values .*trunc_normal_"):
        record_init(Truncated, 0)


def test_optimizer_shards_fill_from_the_seeded_init_on_any_rank():
    """Each rank's segments (the optimizer layout of 3 ranks) are slices of the eager parameters;
    buffers become real tensors in the meta model."""
    want = _eager(Mixed, 5)
    record = record_init(Mixed, 5)
    source = SeededInit(record)
    install_buffers(record.model, source, torch.device("cpu"))
    assert torch.equal(record.model.table, want["table"])
    named = list(record.model.named_parameters())
    for rank in range(3):
        opt = ShardedAdam(named, {"proj.weight": 1}, rank, 3)
        opt.load_shards(source.shards(opt.layouts), source.description)
        for name, layout in opt.layouts.items():
            assert torch.equal(opt.params[name], layout.slice_of(want[name])), (rank, name)


def test_a_source_that_misses_a_parameter_is_refused():
    record = record_init(Mixed, 0)
    opt = ShardedAdam(list(record.model.named_parameters()), {}, 0, 1)
    partial = ((n, t) for n, t in SeededInit(record).shards(opt.layouts) if n != "out.bias")
    with pytest.raises(HGraphError, match=r"no value for 1 parameter.*out\.bias"):
        opt.load_shards(partial, "the test")


TRUNCATED_MODEL = '''
import torch.nn as nn
from hgraph.frontends.zoo.llama import Llama, LlamaConfig


class TruncLlama(Llama):
    """The zoo Llama with a trunc_normal_ init of its embedding (as torchtitan initialises)."""

    def __init__(self, **overrides):
        super().__init__(LlamaConfig(**{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                        "num_layers": 1, "num_heads": 2, **overrides}))
        nn.init.trunc_normal_(self.embed_tokens.weight, std=0.02)
'''


def test_a_model_that_cannot_be_recorded_trains_from_its_eager_init(tmp_path, capsys):
    """The trainer falls back to building the model whole (saying so) and gets the same masters
    as the eager build; afterwards its parameters are freed (meta)."""
    from hgraph.runtime.train.config import TrainConfig
    from hgraph.runtime.train.trainer import Trainer
    from hgraph.runtime.train.model_setup import build_model
    path = tmp_path / "trunc_model.py"
    path.write_text(TRUNCATED_MODEL)
    config = TrainConfig.from_values(model=f"{path}:TruncLlama", world_size=1, strategy_schedule="1xTP1PP1",
                                     steps=1, tokens_per_iter=16, docs=[[1, 2, 3, 4, 5]] * 3, seed=4)
    trainer = Trainer(config, 0, 1)
    assert "builds the whole model" in capsys.readouterr().out
    want = dict(build_model(config).named_parameters())
    assert set(trainer.optimizer.params) == set(want)
    for name, master in trainer.optimizer.params.items():
        assert torch.equal(master.view(want[name].shape), want[name]), name
    assert all(p.is_meta for p in trainer.model.parameters())
