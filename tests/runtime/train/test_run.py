"""The run object under every front door (runtime/train/run.py): ``prepare`` readies a run before any
rank starts (its folders held, the run folder with run.json and the built-in documents as a token
store, the ``auto`` recipe resolved), ``execute`` runs it and returns a typed summary, and the folders
are released when it ends."""
import dataclasses
import json

import pytest
import torch

from hgraph.runtime.process.run_lock import FolderInUse
from hgraph.runtime.train.run import PreparedRun, RunSummary, prepare
from hgraph.runtime.train.run_config import config_from_options


def test_prepare_then_execute_a_run_and_its_folders_are_released(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config, _ = config_from_options({"model": "tiny", "world_size": 1, "steps": 2, "tokens_per_iter": 64,
                                     "strategy_schedule": "1xTP1PP1", "run_dir": str(run_dir), "plots": False})
    prepared = prepare(config.with_values(return_final=True))
    assert isinstance(prepared, PreparedRun) and dataclasses.is_dataclass(prepared)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.run_dir = None
    # ready before any rank starts: the run folder, its record, the built-in documents as a store
    assert prepared.run_dir == str(run_dir) and prepared.metrics == str(run_dir / "metrics.jsonl")
    assert json.loads((run_dir / "run.json").read_text())["model"] == "tiny"
    assert prepared.config.data_sources.startswith(str(run_dir / "data" / "builtin-"))
    assert prepared.config.optimizer.lr_schedule == "cosine"       # the built-in run's ``auto`` recipe
    with pytest.raises(FolderInUse, match="run folder"):            # one run per folder, from prepare on
        prepare(config)
    summary = prepared.execute()
    assert isinstance(summary, RunSummary) and summary.rank == 0 and len(summary.steps) == 2
    assert summary.run_dir == str(run_dir) and summary.cache["misses"] == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert set(summary.final_state) == set(torch.nn.Module.state_dict(_tiny()))
    prepare(config).close()                  # released by execute: the folder is free again
    assert capsys.readouterr().err == ""


def test_a_prepared_run_that_is_not_executed_releases_its_folders(tmp_path):
    config, _ = config_from_options({"model": "tiny", "world_size": 1, "steps": 1, "tokens_per_iter": 64,
                                     "strategy_schedule": "1xTP1PP1", "run_dir": str(tmp_path / "run")})
    with prepare(config):
        with pytest.raises(FolderInUse):
            prepare(config)
    with prepare(config) as again:
        assert again.run_dir == str(tmp_path / "run")


def _tiny():
    from hgraph.runtime.train.model_setup import build_model
    return build_model(config_from_options({"model": "tiny"})[0])


def test_under_a_launcher_every_error_names_its_rank_and_host_in_one_line():
    from types import SimpleNamespace

    from hgraph.errors import HGraphError, RunFailed
    from hgraph.runtime.train.run import errors_named
    from hgraph.runtime.train.run_folders import Refused
    env = SimpleNamespace(where=lambda: "rank 3 on node-b")
    with pytest.raises(HGraphError) as bad:
        with errors_named(env):
            raise HGraphError("--steps must be >= 1")
    assert str(bad.value) == "rank 3 on node-b: --steps must be >= 1" and not isinstance(bad.value, RunFailed)
    with pytest.raises(RunFailed, match="^rank 3 on node-b: every one of the 2 steps was skipped$"):
        with errors_named(env):
            raise RunFailed("every one of the 2 steps was skipped")
    with pytest.raises(RunFailed, match=r"^rank 3 on node-b: RuntimeError: \[gloo\] Connection closed by peer$"):
        with errors_named(env):
            raise RuntimeError("[gloo] Connection closed by peer\nmore detail")
    with pytest.raises(Refused, match="^in use$"):          # every rank said it already: as it is
        with errors_named(env):
            raise Refused("in use")
    with pytest.raises(ValueError):                        # a local run: errors as they are
        with errors_named(None):
            raise ValueError("x")
