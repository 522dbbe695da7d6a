"""A shortened default-style run under a device memory limit: the planner switches strategies between
mini-batches with a long document (it needs TP2) and mini-batches of short ones, and every step trains
exactly its mini-batch's documents. The analytic profile keeps it short (no calibration)."""
import json

import pytest
import torch

from hgraph.errors import HGraphError, RunFailed
from hgraph.frontends.zoo import llama
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.planner.service.iteration import bounded_cost_model, model_cost_model
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.rank_run import run_training
from hgraph.runtime.train.run import prepare
from hgraph.runtime.train.run_config import config_from_options
from hgraph.strategy import Strategy

# llama:tiny under the auto limit: TP1PP1 holds 618 tokens, TP2PP1 the context (1024), CP more
LONG = [800] + [30] * 6          # 980 tokens: the 800-token document needs a TP2 pipeline
SHORT = [40] * 24                # 960 tokens: every document fits TP1PP1
LENGTHS = LONG + SHORT + LONG + SHORT
TOKENS_PER_ITER = 1000


def _docs():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]


def test_default_style_run_uses_several_strategies_under_the_limit(tmp_path):
    metrics = tmp_path / "m.jsonl"
    docs = _docs()
    config = TrainConfig.from_values(model="llama:tiny", world_size=4, steps=4, tokens_per_iter=TOKENS_PER_ITER,
                                     docs=docs, strategies="auto", profile="analytic", device_memory="auto",
                                     metrics=str(metrics), plan_ahead=2)
    run_training(config, timeout_s=120)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    batches = list(mini_batches([Document(i, tuple(d)) for i, d in enumerate(docs)], TOKENS_PER_ITER, 4))
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    for m, batch in zip(lines, batches):
        assert m["plan_documents"] == sorted(d.index for d in batch.docs)     # each document once
    long_steps = [m for m, b in zip(lines, batches) if max(len(d) for d in b.docs) == 800]
    short_steps = [m for m, b in zip(lines, batches) if max(len(d) for d in b.docs) < 618]
    assert len(long_steps) == len(short_steps) == 2
    cost, _ = bounded_cost_model(model_cost_model("analytic", llama.build("tiny"), 4), llama.build("tiny"), "auto", 4)
    for m in long_steps:        # the long document forces a pipeline that holds it (TP2 or CP here)
        assert any(cost.max_len(p) >= 800 for p in Strategy.parse(m["strategy"]).pipelines), m["strategy"]
    for m in lines:             # no pipeline gets a micro-batch it cannot hold: TP1PP1 never holds 800
        assert all(cost.has(p) for p in Strategy.parse(m["strategy"]).pipelines)
    assert {m["strategy"] for m in long_steps}.isdisjoint({m["strategy"] for m in short_steps})
    assert len({m["strategy"] for m in lines}) >= 2


def test_a_document_longer_than_every_max_len_is_one_line_exit_2(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in _docs()))
    config, _ = config_from_options({"data": str(data), "steps": 1, "tokens_per_iter": TOKENS_PER_ITER,
                                     "profile": "analytic", "device_memory": "3M", "run_dir": str(tmp_path / "run")})
    with pytest.raises(HGraphError) as refused, prepare(config) as run:
        run.execute()
    assert not isinstance(refused.value, RunFailed)          # bad input: the command's exit 2
    line = str(refused.value)
    assert line.startswith("document 0 has 800 tokens") and "\n" not in line, line
    assert "--device-memory 3M " in line          # in the unit given
