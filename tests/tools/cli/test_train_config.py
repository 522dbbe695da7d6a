"""``hgraph train``'s schema and the runtime's TrainConfig: the flags and TOML keys are the config's fields."""
import argparse
import dataclasses
import json

import pytest
import torch

from hgraph.errors import HGraphError
from hgraph.runtime.train import config_keys as ck
from hgraph.runtime.train.config import SECTIONS, TrainConfig
from hgraph.tools.cli import main, train as cmd_train


def _parse(*flags):
    parser = argparse.ArgumentParser()
    cmd_train.add_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["train", *flags])


def test_every_key_of_the_schema_is_a_field_of_its_section_with_its_default():
    assert tuple(SECTIONS) == ck.SECTIONS
    defaults = TrainConfig().values()
    assert set(defaults) == set(ck.BY_DEST)
    for key in ck.SCHEMA:
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


def _toml(value):
    """A default as a TOML value (None: "none"; a pair: an array; a table: an inline table)."""
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(map(repr, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def test_the_flags_and_toml_keys_are_generated_from_the_config_fields_and_nothing_else(tmp_path):
    """One declaration per option: every field of every section is an option, and the command
    line's flags and the TOML file's keys are exactly those fields (no more, no fewer)."""
    fields = {(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert all("option" in f.metadata for cls in SECTIONS.values() for f in dataclasses.fields(cls))
    parser = argparse.ArgumentParser()
    sub = cmd_train.add_parser(parser.add_subparsers(dest="cmd"))
    flags = {o for a in sub._actions for o in a.option_strings if o not in ("-h", "--help", "--config")}
    bools = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)
             if f.metadata["option"].kind == "bool"}
    expected = {f"--{name.replace('_', '-')}" for _, name in fields}
    expected |= {f"--no-{name.replace('_', '-')}" for name in bools}
    assert flags == expected
    assert {a.dest for a in sub._actions if a.option_strings and a.dest not in ("help", "config")} == {
        name for _, name in fields}
    # every field is a key of its own section in a TOML file, with its declared default ...
    defaults = TrainConfig()
    text = "".join(f"[{section}]\n" + "".join(f"{f.name.replace('_', '-')} = "
                                              f"{_toml(getattr(getattr(defaults, section), f.name))}\n"
                                              for f in dataclasses.fields(cls))
                   for section, cls in SECTIONS.items())
    (tmp_path / "every.toml").write_text(text)
    loaded = ck.load_config(tmp_path / "every.toml")
    assert {(ck.BY_DEST[d].section, d) for d in loaded} == fields
    assert TrainConfig.from_values(loaded) == TrainConfig()
    # ... and only there: a field named in another section is refused
    (tmp_path / "moved.toml").write_text("[logging]\nlr = 0.1\n")
    with pytest.raises(HGraphError, match=r"unknown key \[logging\] lr"):
        ck.load_config(tmp_path / "moved.toml")


def test_the_engine_options_come_from_flags_and_toml(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config, _ = cmd_train.config_from_args(_parse("--push-bucket-bytes", "4096", "--no-overlap-push"))
    assert (config.cluster.push_bucket_bytes, config.cluster.pull_bucket_bytes) == (4096, None)
    assert config.cluster.overlap_push is False
    (tmp_path / "run.toml").write_text("[cluster]\npull-bucket-bytes = 65536\npush-bucket-bytes = 0\n")
    with pytest.raises(HGraphError, match=r"run.toml: \[cluster\] push-bucket-bytes = 0: must be >= 1"):
        cmd_train.config_from_args(_parse("--config", str(tmp_path / "run.toml")))
    (tmp_path / "run.toml").write_text("[cluster]\npull-bucket-bytes = 65536\npush-bucket-bytes = 1024\n")
    config, _ = cmd_train.config_from_args(_parse("--config", str(tmp_path / "run.toml"), "--push-bucket-bytes", "8"))
    assert (config.cluster.push_bucket_bytes, config.cluster.pull_bucket_bytes) == (8, 65536)


def test_negative_queue_count_is_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_info:     # argparse's own check of the minimum
        main(["train", "--outlier-queues", "-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--outlier-queues: -1: must be >= 0" in err[0]
