"""A training run with ``outlier_queues`` K (``hgraph train --outlier-queues K``; its run object,
runtime/train/run.py) end to end on CPU: the delayed stream trained on 2 ranks equals
single-process PyTorch on the mini-batches it formed, every document read is trained once (the run's
end flushes the queues), and a resume from a checkpoint whose queues hold documents trains the same
documents per step with bitwise losses and parameters.

Process launches are the cost (seconds each): one uninterrupted run and one resume serve every test.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from tests.runtime.reference_training import reference_steps

from hgraph.errors import HGraphError, RunFailed
from hgraph.frontends.zoo import llama
from hgraph.runtime.data.builtin import synthetic_documents, write_jsonl
from hgraph.runtime.data.documents import read_jsonl
from hgraph.runtime.data.outlier_delay import run_mini_batches
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.run import RunSummary, prepare
from hgraph.runtime.train.run_config import config_from_options

STEPS, EVERY, TOKENS, QUEUES = 8, 3, 512, 2
CANDIDATES = "2xTP1PP1;1xTP2PP1"


def _run(data, ck, run, **extra) -> RunSummary:
    """The run (rank 0's trained weights kept in memory); the analytic cost model: the same plans in the
    reference and the resumed run."""
    config, _ = config_from_options({
        "model": "llama:tiny", "data": str(data), "world_size": 2, "steps": STEPS, "tokens_per_iter": TOKENS,
        "checkpoint_dir": str(ck), "checkpoint_every": EVERY, "run_dir": str(run), "plots": False, "json": True,
        "profile": "analytic", "strategies": CANDIDATES, "outlier_queues": QUEUES, **extra})
    with prepare(config.with_values(return_final=True)) as prepared:
        return prepared.execute()


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    base = tmp_path_factory.mktemp("delay")
    data = base / "docs.jsonl"
    write_jsonl(data, synthetic_documents(200, 256, 128, seed=0))
    ck, run = base / "ref-ck", base / "ref-run"
    final = _run(data, ck, run).final_state
    return {"base": base, "data": data, "ck": ck, "metrics": _metrics(run / "metrics.jsonl"), "final": final}


def test_every_document_read_is_trained_once_and_the_end_flushes(ref):
    m = ref["metrics"]
    trained = sorted(i for r in m for i in r["documents"])
    assert trained == list(range(m[-1]["next_document"]))   # one epoch here: each read document once
    assert sum(r["delayed"] for r in m) > 0                  # outliers were delayed ...
    assert any(r["documents"] != sorted(r["documents"]) for r in m)   # ... so file order changed
    assert m[-1]["pending_delay"] == 0                       # ... and all trained by the last step
    assert all(len(r["delay_iters"]) == len(r["documents"]) for r in m)
    assert all(r["tokens"] <= TOKENS for r in m[:-1])


def test_checkpoint_holds_the_real_queues(ref):
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    for step in (3, 6):
        q = ckpt_manifest.read_manifest(ref["ck"] / f"step-{step:08d}")["delay_queues"]
        assert q["outlier_delay"] is True and q["next_step"] == step
        assert q["next_document"] == ref["metrics"][step - 1]["next_document"]
        waiting = [p for level in q["queues"] for p, _ in level] + [p for p, _ in q["held"]]
        assert q["pending"] == len(waiting) == ref["metrics"][step - 1]["pending_delay"]
        # a waiting document was read (before the data position) and not trained yet
        done = {i for r in ref["metrics"][:step] for i in r["documents"]}
        assert all(p < q["next_document"] and p not in done for p in waiting)
    assert ckpt_manifest.read_manifest(ref["ck"] / "step-00000003")["delay_queues"]["pending"] > 0


def test_delayed_run_equals_pytorch_on_the_mini_batches_it_formed(ref):
    docs = read_jsonl(ref["data"])
    config = TrainConfig.from_values(model="llama:tiny", world_size=2, steps=STEPS, tokens_per_iter=TOKENS,
                                     outlier_queues=QUEUES)
    batches = [b for b, _ in run_mini_batches(docs, 2, tokens_per_iter=config.data.tokens_per_iter,
                                                       steps=config.data.steps,
                                                       outlier_queues=config.planner.outlier_queues)]
    assert [[d.index for d in b.docs] for b in batches] == [r["documents"] for r in ref["metrics"]]
    torch.manual_seed(0)
    for (_, loss), r in zip(reference_steps(llama.build("tiny"), batches), ref["metrics"], strict=True):
        assert abs(r["loss"] - loss) <= 1e-6 * loss


def test_resume_with_waiting_documents_trains_the_same_documents_bitwise(ref):
    base = ref["base"]
    ck, run = base / "resume-ck", base / "resume-run"
    shutil.copytree(ref["ck"], ck)
    for s in (6, 8):
        shutil.rmtree(ck / f"step-{s:08d}")
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ref["metrics"][:3]))
    summary = _run(ref["data"], ck, run, resume=True)
    assert summary.resumed_from["step"] == 3
    got = _metrics(run / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(STEPS))
    for key in ("documents", "delayed", "pending_delay", "delay_iters", "next_document", "loss"):
        assert [r[key] for r in got] == [r[key] for r in ref["metrics"]], key
    final = summary.final_state
    for k, v in ref["final"].items():
        assert torch.equal(final[k], v), k


@pytest.mark.parametrize("queues,match", [
    (0, "holds 2 delayed documents in 2 outlier queues; resume with --outlier-queues 2"),
    (3, "resume with --outlier-queues 2 \\(got 3\\)"),
])
def test_resume_that_would_lose_waiting_documents_is_one_line_exit_2(ref, capsys, queues, match):
    shutil.copytree(ref["ck"], ref["base"] / "bad-ck", dirs_exist_ok=True)
    for s in (6, 8):
        shutil.rmtree(ref["base"] / "bad-ck" / f"step-{s:08d}", ignore_errors=True)
    with pytest.raises(HGraphError, match=match) as refused:       # bad input: the command's exit 2
        _run(ref["data"], ref["base"] / "bad-ck", ref["base"] / "bad-run", resume=True, resume_fallback=True,
             outlier_queues=queues)
    assert not isinstance(refused.value, RunFailed) and "\n" not in str(refused.value)
    assert not capsys.readouterr().err
