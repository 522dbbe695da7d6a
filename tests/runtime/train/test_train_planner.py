"""Planner-driven training: every iteration's strategy and dispatch come from ``plan_iteration``;
the loss never depends on the plan, so a 4-rank fp32 run equals single-process PyTorch."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.runtime.reference_training import reference_steps, write_random_documents

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama
from hgraph.runtime.data.documents import Document, mini_batches, read_jsonl
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.runtime.planner.service.iteration import (IterationPlanner, microbatches_of_plan,
                                                      model_cost_model, parse_candidates)
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.rank_run import run_training
from hgraph.strategy import Strategy
from hgraph.tools.cli import main
from hgraph.runtime.train.run import builtin_documents
from hgraph.tools.report.plots import PLOT_NAMES
from hgraph.tools.report.readme_sample import readme_sample, shapes

# a long tail: many short documents and a few long ones, so the candidates' plans differ
LENGTHS = [90, 5, 9, 7, 11, 3, 6, 60, 10, 4, 12, 2, 40, 8, 3, 17, 5, 70, 6, 9]
TOKENS_PER_ITER = 130
CANDIDATES = "1xTP2PP1+2xTP1PP1;1xTP1PP2+1xTP1PP1CP2"   # heterogeneous only: DP, TP, PP, CP all run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_random_documents(tmp_path_factory.mktemp("planned") / "docs.jsonl", LENGTHS, seed=5)


def _reference(path, steps):
    torch.manual_seed(0)
    steps = list(reference_steps(llama.build("tiny"), mini_batches(read_jsonl(path), TOKENS_PER_ITER, steps)))
    return [loss for _, loss in steps], [sorted(d.index for d in batch.docs) for batch, _ in steps]



def test_planned_run_on_4_ranks_equals_pytorch_and_trains_each_document_once(data, tmp_path):
    metrics = tmp_path / "m.jsonl"
    config = TrainConfig.from_values(model="tiny", world_size=4, steps=4, tokens_per_iter=TOKENS_PER_ITER,
                                     data=str(data), strategies=CANDIDATES, profile="analytic", device_memory=None,
                                     metrics=str(metrics))
    result = run_training(config, timeout_s=60)
    ref_losses, ref_batches = _reference(data, 4)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    allowed = {str(s) for s in parse_candidates(CANDIDATES, 4)}
    for m, want, docs in zip(lines, ref_losses, ref_batches):
        assert abs(m["loss"] - want) <= 1e-6 * want
        assert m["strategy"] in allowed
        assert m["plan_documents"] == docs                     # each document of the step exactly once
        pipes = m["pipelines"]
        assert [p["scheme"] for p in pipes] == [str(p) for p in Strategy.parse(m["strategy"]).pipelines]
        assert m["est_latency_ms"] == max(p["est_latency_ms"] for p in pipes) > 0
        assert all(p["measured_latency_ms"] > 0 for p in pipes)
        assert len(m["rank_busy_s"]) == 4 and m["planner_wait_s"] >= 0 and m["switch_s"] >= 0
        assert isinstance(m["cache_hit"], bool)
    assert lines[0]["cache_hit"] is False                      # the first strategy is always compiled
    assert lines[0]["build_s"] > 0 and not lines[0]["built_ahead"]
    seen = set()
    for m in lines:            # a strategy a delivered plan named was built before its step, which only looked it up
        first = m["strategy"] not in seen
        seen.add(m["strategy"])
        assert (m["build_s"] is not None) == first
        if m["built_ahead"]:
            assert first and m["cache_hit"] and m["build_lead_s"] > 0 and m["switch_s"] < m["build_s"]
    assert [p["est_latency_ms"] for p in result["planned"]] == [m["est_latency_ms"] for m in lines]


def test_max_candidates_caps_the_auto_candidates_of_a_run(tmp_path):
    # the built-in long-tail documents: the proposal offers more than one candidate for them
    ids = builtin_documents("tiny", {}, 1, 2048)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in ids))
    config = TrainConfig.from_values(model="tiny", world_size=4, steps=1, tokens_per_iter=2048, data=str(data),
                                     strategies="auto", profile="analytic", device_memory=None, max_candidates=1,
                                     metrics=str(tmp_path / "m.jsonl"))
    result = run_training(config, timeout_s=60)
    assert len(result["candidates"]) == 1
    assert [json.loads(line)["strategy"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == \
        result["candidates"]
    docs = [Document(i, tuple(d)) for i, d in enumerate(ids)]
    uncapped = IterationPlanner.create("auto", "analytic", llama.build("tiny"), docs, 2048, 0, 4)
    assert len(uncapped.candidates) > 1        # so the cap is what made it one


def test_plan_to_microbatches_keeps_documents_and_rejects_a_partial_plan():
    docs = [Document(10 + i, tuple(range(1, n + 1))) for i, n in enumerate([30, 5, 7, 12, 3])]
    cost = model_cost_model("analytic", llama.build("tiny"), 4)
    plan = plan_iteration([len(d) for d in docs], parse_candidates(CANDIDATES, 4), cost)
    mbs = microbatches_of_plan(plan, docs)
    assert len(mbs) == len(plan.strategy.pipelines)
    packed = sorted(i for pipe in mbs for mb in pipe for i in mb.doc_indices)
    assert packed == [10, 11, 12, 13, 14]
    assert sum(mb.tokens for pipe in mbs for mb in pipe) == 57
    with pytest.raises(HGraphError, match="exactly once"):
        microbatches_of_plan(plan, docs + [Document(99, (1, 2))])


@pytest.mark.parametrize("extra, match", [
    (("--strategies", "2xTP1PP1"), "uses 2 ranks but --world-size is 4"),
    (("--strategies", "auto", "--strategy-schedule", "4xTP1PP1"), "exclude each other"),
    (("--plan-ahead", "-1"), "argument --plan-ahead: -1: must be >= 0"),
    (("--strategies", "4xTP1PP1", "--profile", "no-such-profile"), "no-such-profile"),
    # raised by the planner on rank 0 in the spawned run: every rank stops with it, none hangs
    (("--strategies", "4xTP1PP1", "--profile", "llama-7b"), "scheme TP1PP1 is not available in cost profile"),
])
def test_bad_planner_options_are_one_line_and_exit_code_2(data, tmp_path, capsys, extra, match):
    argv = ["train", "--data", str(data), "--steps", "1", "--tokens-per-iter", str(TOKENS_PER_ITER),
            "--run-dir", str(tmp_path / "run"), *extra]
    try:
        rc = main(argv)
    except SystemExit as exc:          # a flag's value is rejected by the parser itself
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hgraph train: error: ") and match in err[-1], err[-1]


def test_default_run_shortened_writes_metrics_and_plots(tmp_path):
    """The default run, shortened, run as a user runs it (a process of its own: its ranks print their
    step lines to its stdout, where a test's capture of this process may not reach them); its printed
    lines have the shape of the README's sample (``tools/report/readme_sample.py``): a format change
    that the sample does not follow fails here."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "hgraph.tools.cli", "train", "--steps", "3", "--tokens-per-iter",
                           "2048", "--run-dir", str(run_dir), "--max-candidates", "2", "--progress", "off",
                           "--device", "cpu"],       # as the README's sample (a GPU's step lines add MFU)
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "summary: 3 steps" in out and "loss " in out and str(run_dir) in out
    sample = shapes(readme_sample((Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")))
    printed = shapes(out.splitlines(), str(run_dir))
    assert set(printed) == set(sample)
    for kind, words in printed.items():
        assert words == sample[kind], (kind, sorted(words ^ sample[kind]))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert all(m["tokens"] <= 2048 and m["pipelines"] and "est_latency_ms" in m for m in lines)
    # the built-in recipe: warmup (10% of the steps: one) then cosine to lr/10; the documents a token store
    assert [m["lr"] for m in lines] == pytest.approx([1e-3, 1e-3, 1e-4 + 9e-4 * 0.5], rel=1e-12)
    assert len(list((run_dir / "data").glob("builtin-*.idx"))) == 1
    written = {p.name for p in run_dir.iterdir()}
    for name in PLOT_NAMES:
        assert {f"{name}.png", f"{name}.svg"} <= written
