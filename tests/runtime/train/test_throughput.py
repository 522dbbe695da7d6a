"""Every step's throughput figures: model FLOPs (matmuls + each packed document's quadratic attention
term) against a formula written out by hand, TFLOP/s per device and MFU from the known-GPU table or
--peak-tflops; a real one-rank run writes them, the loss and the per-rank peaks as TensorBoard
scalars, read back with TensorBoard's EventAccumulator; --wandb without wandb is one note."""
import json
import math

import pytest
import torch

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.metrics import format_step_line
from hgraph.runtime.train.step_loggers import StepLoggers
from hgraph.runtime.train.throughput import ModelFlops, device_peak_tflops, known_peak_tflops, step_throughput
from hgraph.runtime.train.trainer import Trainer


def _hand_flops(cfg, lengths):
    """6 x (matmul weights) per token + 12 x (heads x head size) x l^2 per layer and document."""
    h, i, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    per_layer = h * cfg.num_heads * hd + 2 * h * cfg.num_kv_heads * hd + cfg.num_heads * hd * h + 3 * h * i
    weights = cfg.num_layers * per_layer + v * h                     # + the LM head; embeddings are lookups
    tokens, squares = sum(lengths), sum(n * n for n in lengths)
    return 6 * weights * tokens + 12 * cfg.num_layers * cfg.num_heads * hd * squares


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_model_flops_follow_the_hand_formula(name):
    model = llama.build(name)
    flops = ModelFlops.of(hgraph.compile(model))
    lengths = [5, 9, 30]
    assert flops.step_flops(lengths) == _hand_flops(model.config, lengths)
    # the same tokens in one document do more attention work than in three
    assert flops.step_flops([44]) - flops.step_flops(lengths) == 12 * flops.attention_width * (44 ** 2 - 1006)


def test_tflops_and_mfu_of_a_step():
    got = step_throughput(flops=3.2e15, tokens=8192, time_s=2.0, world_size=4, peak_tflops=989.0)
    assert got["tokens_per_s"] == 4096.0 and got["model_tflop"] == 3200.0
    assert got["tflops_per_device"] == pytest.approx(400.0) and got["mfu"] == pytest.approx(400.0 / 989.0)
    assert step_throughput(1e12, 10, 1.0, 1, None)["mfu"] is None
    assert known_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert known_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert known_peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0 and known_peak_tflops("NVIDIA L40S") == 362.0
    assert known_peak_tflops("NVIDIA GH200 480GB") == 989.0 and known_peak_tflops("Some Future GPU") is None
    assert device_peak_tflops(torch.device("cpu")) is None
    assert device_peak_tflops(torch.device("cpu"), 100.0) == 100.0


def test_a_run_writes_throughput_and_memory_as_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    docs = synthetic_documents(40, 256, 64, seed=1)
    config = TrainConfig.from_values(model="llama:tiny", world_size=1, strategy_schedule="1xTP1PP1", steps=3,
                                     tokens_per_iter=128, docs=docs, tensorboard=str(tmp_path / "tb"),
                                     metrics=str(tmp_path / "m.jsonl"), peak_tflops=0.5, plots=False,
                                     vocab_parallel_loss="on")
    trainer = Trainer(config, 0, 1)
    assert trainer.executor.vocab_parallel_loss     # the flag reaches the executor (fp32 alone: off)
    summary = trainer.run()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert set(scalars) == {"train/loss", "train/lr", "time/step_s", "throughput/tokens_per_s",
                            "throughput/tflops_per_device", "throughput/mfu", "memory/peak_bytes/rank_0"}
    flops = ModelFlops.of(trainer.compiled)
    for k, (step, line) in enumerate(zip(summary.steps, lines)):
        batch_lengths = [len(docs[i]) for i in line["documents"]]
        tflops = flops.step_flops(batch_lengths) / step.time_s / 1e12
        assert scalars["train/loss"][k] == (k, pytest.approx(step.loss, rel=1e-6))
        assert scalars["train/lr"][k] == (k, pytest.approx(line["lr"], rel=1e-6))
        tokens_per_s = step.tokens / step.time_s
        assert scalars["throughput/tokens_per_s"][k] == (k, pytest.approx(tokens_per_s, rel=1e-6))
        assert scalars["throughput/tflops_per_device"][k] == (k, pytest.approx(tflops, rel=1e-6))
        assert scalars["throughput/mfu"][k] == (k, pytest.approx(tflops / 0.5, rel=1e-6))
        peak = line["rank_peak_bytes"][0]
        assert scalars["memory/peak_bytes/rank_0"][k] == (k, pytest.approx(peak, rel=1e-6))
        assert line["tflops_per_device"] == pytest.approx(tflops)
        assert line["mfu"] == pytest.approx(tflops / 0.5)
        assert math.isclose(line["model_tflop"], flops.step_flops(batch_lengths) / 1e12)
    assert "MFU  40.0%" in format_step_line(summary.steps[0], None, None, 0.4)   # the step line, with a peak
    assert "MFU" not in format_step_line(summary.steps[0], None, None, None)


def test_wandb_missing_is_one_note(capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    loggers = StepLoggers(wandb_project="proj")
    assert not loggers
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hgraph: --wandb proj: wandb is not installed (pip install wandb); not logging to it"]
