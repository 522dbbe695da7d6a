"""``hgraph train``'s schema and the runtime's TrainConfig: the same sections, keys and defaults."""
import argparse
import dataclasses

import torch

from hgraph.runtime.train.config import SECTIONS, TrainConfig
from hgraph.tools.cli import train as cmd_train, train_schema as rc


def _parse(*flags):
    parser = argparse.ArgumentParser()
    cmd_train.add_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["train", *flags])


def test_every_key_of_the_schema_is_a_field_of_its_section_with_its_default():
    assert tuple(SECTIONS) == rc.SECTIONS
    defaults = TrainConfig().values()
    assert set(defaults) == set(rc.BY_DEST)
    for key in rc.SCHEMA:
        assert key.dest in {f.name for f in dataclasses.fields(SECTIONS[key.section])}, key.dest
        assert defaults[key.dest] == key.default, key.dest


def test_the_command_line_fills_the_config_from_the_resolved_values(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config, _ = cmd_train.config_from_args(_parse())
    assert config == TrainConfig().with_values(device="cpu")     # no options: the defaults, on this CPU
    (tmp_path / "run.toml").write_text('[optimizer]\nlr = 0.5\n[data]\nsteps = 7\n[planner]\nmemory-budget = "1M"\n')
    config, _ = cmd_train.config_from_args(_parse("--config", str(tmp_path / "run.toml"), "--lr", "0.01",
                                                  "--strategy-schedule", "4xTP1PP1"))
    assert config.optimizer.lr == 0.01 and config.data.steps == 7           # flags win over the file
    assert config.planner.memory_budget == 2 ** 20 and not config.planner_driven


def test_no_sequence_parallel_turns_sp_off_on_the_command_line_and_in_toml(tmp_path):
    assert TrainConfig().model.sequence_parallel                              # on by default
    config, _ = cmd_train.config_from_args(_parse("--no-sequence-parallel"))
    assert config.model.sequence_parallel is False
    (tmp_path / "run.toml").write_text('[model]\nsequence-parallel = false\n')
    config, _ = cmd_train.config_from_args(_parse("--config", str(tmp_path / "run.toml")))
    assert config.model.sequence_parallel is False
