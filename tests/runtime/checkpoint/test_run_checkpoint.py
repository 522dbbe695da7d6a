"""Choosing the checkpoint a resume uses (no processes): newest verified, incomplete ones skipped,
a broken one named, the previous one only when asked."""
from __future__ import annotations

import pytest
import torch

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import manifest as ckpt_manifest
from hgraph.runtime.checkpoint import shards as checkpoint
from hgraph.runtime.checkpoint.run import RunCheckpoints, find_resume_point
from hgraph.runtime.engine.optimizer import ShardedAdam


def _root(tmp_path, steps=(2, 4)):
    opt = ShardedAdam([("w", torch.nn.Parameter(torch.randn(4, 3)))], {"w": 0}, 0, 1, lr=0.1)
    for s in steps:
        checkpoint.save(tmp_path, s, opt, data_position={"next_document": 10 * s})
    return tmp_path


def test_newest_verified_checkpoint_and_an_unfinished_save_is_skipped_with_a_note(tmp_path):
    root = _root(tmp_path)
    (root / "step-00000006").mkdir()                     # a save that died before its manifest
    (root / "step-00000006" / "rank-00000-of-00001.pt").write_bytes(b"partial")
    point = find_resume_point(root)
    assert point.step == 4 and point.data_position["next_document"] == 40
    assert len(point.warnings) == 1 and "step-00000006" in point.warnings[0] and "no manifest" in point.warnings[0]


@pytest.mark.parametrize("damage, match", [
    (lambda f: (f / "__0_0.distcp").write_bytes(b"x"), "is truncated or corrupt"),
    (lambda f: (f / "__0_0.distcp").unlink(), "is missing"),
    (lambda f: (f / "manifest.json").write_text("{not json"), "manifest .* cannot be read"),
])
def test_broken_newest_is_named_and_the_previous_is_used_only_when_asked(tmp_path, damage, match):
    root = _root(tmp_path)
    damage(root / "step-00000004")
    with pytest.raises(HGraphError, match=match) as info:
        find_resume_point(root)
    assert "step-00000004" in str(info.value) and "--resume-fallback" in str(info.value)
    assert "step-00000002" in str(info.value) and "\n" not in str(info.value)
    point = find_resume_point(root, fallback=True)
    assert point.step == 2 and "falling back to step-00000002" in point.warnings[-1]


def test_nothing_to_resume_is_one_line(tmp_path):
    with pytest.raises(HGraphError, match="does not exist"):
        find_resume_point(tmp_path / "nope")
    with pytest.raises(HGraphError, match="no complete checkpoint"):
        find_resume_point(tmp_path)
    root = _root(tmp_path, steps=(2,))
    (root / "step-00000002" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(HGraphError, match="no older checkpoint to fall back to"):
        find_resume_point(root, fallback=True)


def test_saves_every_k_steps_and_after_the_last():
    ck = RunCheckpoints(root=__import__("pathlib").Path("c"), every=3, total_steps=7)
    assert [s for s in range(1, 8) if ck.due(s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if RunCheckpoints(None, 3, 7).due(s)] == []
    assert [s for s in range(1, 8) if RunCheckpoints(ck.root, None, 7).due(s)] == [7]


def test_resumed_trainer_takes_masters_from_the_checkpoint_and_settings_from_its_flags(tmp_path):
    """In-process, one rank: the state after the resume is the checkpoint's, a new --lr applies."""
    from hgraph.runtime.data.builtin import synthetic_documents
    from hgraph.runtime.train.config import TrainConfig
    from hgraph.runtime.train.trainer import Trainer
    docs = synthetic_documents(40, 256, 64, seed=1)

    def config(**kw):
        return TrainConfig.from_values(model="llama:tiny", world_size=1, strategy_schedule="1xTP1PP1", steps=3,
                                       tokens_per_iter=128, docs=docs, checkpoint_dir=str(tmp_path), **kw)
    first = Trainer(config(), 0, 1)
    first.run()
    assert ckpt_manifest.complete_steps(tmp_path) == [3]
    saved = first.optimizer.state_dict()
    with pytest.raises(HGraphError, match="nothing left to train"):
        Trainer(config(resume=True), 0, 1)
    again = Trainer(config(resume=True, lr=0.01).with_values(steps=4), 0, 1)
    assert again.optimizer.lr == 0.01
    state = again.optimizer.state_dict()
    assert state["steps"] == saved["steps"]
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, t in saved[key].items():
            assert torch.equal(state[key][name], t), (key, name)
    summary = again.run()
    assert [r.step for r in summary.steps] == [3] and summary.resumed_from["next_document"] > 0
    # the same run saving asynchronously (--async-checkpoint): every 2 steps and at the end, each save
    # completed by the next one or by the run's end; the last holds the same state
    async_root = tmp_path / "async"
    third = Trainer(config().with_values(checkpoint_dir=str(async_root), checkpoint_every=2, async_checkpoint=True),
                    0, 1)
    records = third.run().checkpoints
    assert ckpt_manifest.complete_steps(async_root) == [2, 3] and all(r["bytes"] > 0 for r in records)
    loaded = checkpoint.load(async_root, 0, 1).optimizer
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, t in saved[key].items():
            assert torch.equal(loaded[key][name], t), (key, name)


def test_resumed_planner_keeps_the_runs_candidates_and_cost_model():
    """A resume plans with the interrupted run's cost model (a measured one is not measured again)."""
    import dataclasses
    import json
    from types import SimpleNamespace

    from hgraph.frontends.zoo import llama
    from hgraph.runtime.planner.service.iteration import IterationPlanner, model_cost_model, parse_candidates
    from hgraph.runtime.planner.service.setup import PlannerSetup, planner_state, resumed_planner
    from hgraph.strategy import Scheme

    cost = model_cost_model("analytic", llama.build("tiny"), 4)
    # stands for a measured model: coefficients no prior would give
    cost = dataclasses.replace(cost, name="measured",
                               profiled={k: (a * 3.0, b + 0.5, c * 7.0) for k, (a, b, c) in cost.profiled.items()})
    planner = IterationPlanner(cost, parse_candidates("4xTP1PP1;1xTP2PP2", 4), 0, source="proposed")
    config = PlannerSetup(strategies="auto", profile="measure", gpus_per_node=8, method="fast",
                          max_candidates=None)
    state = json.loads(json.dumps(planner_state(config, planner, [], 4)))     # as the manifest keeps it
    loaded = SimpleNamespace(planner_state=state)
    again = resumed_planner(loaded, config, 0, 4)
    assert [str(c) for c in again.candidates] == ["4xTP1PP1", "1xTP2PP2"] and again.source == "proposed"
    for scheme in ("TP1PP1", "TP2PP2"):
        s = Scheme.parse(scheme)
        assert again.cost.coeffs(s) == cost.coeffs(s)
    # made for another world size, profile or candidate cap: a fresh planner
    assert resumed_planner(loaded, config, 0, 2) is None
    assert resumed_planner(loaded, dataclasses.replace(config, profile="analytic"), 0, 4) is None
    assert resumed_planner(loaded, dataclasses.replace(config, max_candidates=1), 0, 4) is None
