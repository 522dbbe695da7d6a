"""A step's results leave through one immutable record (``runtime.train.step_record``)."""
import dataclasses
import json

import pytest

from hgraph.runtime.data.documents import Document, MiniBatch
from hgraph.runtime.engine.executor import StepResult
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.metrics import MetricsWriter
from hgraph.runtime.train.step_record import CacheCounts, StepExtras, StepRecord
from hgraph.runtime.train.trainer import Trainer
from tests.runtime.train.test_throughput import synthetic_documents


def _record(outlier_delay: bool = False, **figures) -> StepRecord:
    result = StepResult(4, "2xTP1PP1", 2.5, 30, 0.25, compiles=3, bytes={"pull_send_bytes": 8})
    batch = MiniBatch(4, (Document(7, (1, 2, 3)), Document(9, (4, 5))), next_position=10, delayed=1, pending=2,
                      delay_iters=(0, 1))
    extras = StepExtras(1e-3, eval_loss=2.0, throughput={"tokens_per_s": 120.0, "mfu": None},
                        memory={"rank_peak_bytes": [5, 6]}, outlier_delay=outlier_delay)
    return StepRecord(batch, result, CacheCounts(3, 1), extras, **figures)


def test_a_record_cannot_be_changed_nor_changed_through_what_built_it():
    plan = {"est_latency_ms": 1.0}
    record = _record(plan=plan)
    plan["est_latency_ms"] = 2.0                       # the mode's dict after the record was built
    assert record.plan["est_latency_ms"] == 1.0
    with pytest.raises(TypeError):
        record.plan["est_latency_ms"] = 3.0
    with pytest.raises(TypeError):
        record.extras.throughput["mfu"] = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.result.loss = 0.0                       # the executor's result is built once too
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.extras = StepExtras(0.1)
    assert record.step == 4 and record.extra_row() == {"step": 4, "lr": 1e-3, "eval_loss": 2.0}
    assert StepExtras(0.1).fields() == {"lr": 0.1}     # not evaluated: no eval_loss key


def test_the_metrics_line_comes_from_the_record_in_its_order(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path))
    writer.write(_record(plan={"est_latency_ms": 1.5}, balance={"sp_size": 2}))
    writer.write(_record(outlier_delay=True))
    writer.close()
    planned, delayed = (json.loads(x) for x in path.read_text().splitlines())
    own = ["step", "strategy", "loss", "tokens", "time_s", "pull_s", "compute_s", "push_s", "optimizer_s",
           "push_ms", "push_exposed_ms", "skipped", "grad_norm", "overlapped_update", "pull_prefetched",
           "cache_hit", "switch_s", "built_ahead", "build_s", "build_lead_s", "cache_hits", "cache_misses",
           "region_compiles", "pull_send_bytes", "tokens_per_s", "mfu", "lr", "eval_loss"]
    assert list(planned) == own + ["est_latency_ms", "documents", "next_document", "rank_peak_bytes", "sp_size"]
    assert list(delayed) == own + ["documents", "next_document", "delayed", "pending_delay", "delay_iters",
                                   "rank_peak_bytes"]
    assert (planned["cache_hits"], planned["cache_misses"], planned["region_compiles"]) == (3, 1, 3)
    assert (planned["documents"], planned["next_document"], planned["sp_size"]) == ([7, 9], 10, 2)
    assert (delayed["delayed"], delayed["pending_delay"], delayed["delay_iters"]) == (1, 2, [0, 1])


def test_a_run_reports_each_step_through_its_record_alone(tmp_path):
    docs = synthetic_documents(40, 256, 64, seed=1)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(d)}) + "\n" for d in docs))
    config = TrainConfig.from_values(model="llama:tiny", world_size=1, strategy_schedule="1xTP1PP1", steps=3,
                                     tokens_per_iter=128, data=str(data), eval_data=str(data), eval_every=2,
                                     metrics=str(tmp_path / "m.jsonl"), peak_tflops=0.5, plots=False)
    trainer = Trainer(config, 0, 1)
    summary = trainer.run()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r.step for r in summary.records] == [line["step"] for line in lines] == [0, 1, 2]
    for record, line in zip(summary.records, lines):
        row = record.row()
        assert row["loss"] == line["loss"] and row["mfu"] == line["mfu"] and row["mfu"] is not None
        assert row["tflops_per_device"] == line["tflops_per_device"]
        assert (record.cache.hits, record.cache.misses) == (line["cache_hits"], line["cache_misses"])
        assert record.extras.lr == line["lr"] and record.extras.memory["rank_peak_bytes"] == line["rank_peak_bytes"]
        assert (record.extras.eval_loss is not None) == ("eval_loss" in line) == (record.step == 1)
    assert summary.step_extra == [r.extra_row() for r in summary.records]
    assert summary.steps == [r.result for r in summary.records] and summary.planned == []
    # the channels the record replaced are gone: nothing else carries a step's figures
    assert not any(hasattr(trainer.mode, name) for name in ("planned", "balance"))
    assert not hasattr(trainer, "step_extra")
