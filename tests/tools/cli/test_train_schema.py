"""hgraph train configuration: TOML loading and validation, flag overrides, help text."""
from __future__ import annotations

import argparse

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.train import config_keys as ck
from hgraph.tools.cli import train_schema as rc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hgraph train", exit_on_error=False)
    rc.add_arguments(p)
    return p


def _write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_every_flag_of_the_deterministic_train_command_is_a_key():
    from hgraph.tools.cli import train as cmd_train
    sub = argparse.ArgumentParser().add_subparsers()
    p = cmd_train.add_parser(sub)
    # --no-X is the negation of the bool key X; --config names the file itself
    flags = {o.replace("--no-", "--") for a in p._actions for o in a.option_strings
             if o.startswith("--") and o not in ("--help", "--config")}
    keys = {k.flag for k in ck.SCHEMA}
    assert flags <= keys, sorted(flags - keys)
    # and the issue-5 options
    assert {"--checkpoint-dir", "--checkpoint-every", "--resume", "--run-dir", "--method", "--profile",
            "--plan-ahead", "--strategies"} <= keys


def test_schema_is_declarative_and_sections_are_the_seven():
    assert {k.section for k in ck.SCHEMA} == set(ck.SECTIONS)
    assert ck.SECTIONS == ("model", "data", "cluster", "optimizer", "planner", "checkpointing", "logging")
    for key in ck.SCHEMA:
        assert key.help and key.kind in ck.KINDS


def test_defaults_only():
    cfg = ck.resolve(argparse.Namespace())
    assert cfg.values["model"] == "llama:tiny" and cfg.values["world_size"] == 4
    assert cfg.values["betas"] == (0.9, 0.999)
    assert cfg.values["grad_clip"] is None and cfg.values["resume"] is False
    assert set(cfg.sources.values()) == {"default"}


def test_resolved_values_have_no_flat_untyped_attributes():
    """A run reads its options typed, through the sections of its TrainConfig: the resolved values are
    ``values`` and ``sources``, not an attribute per key."""
    cfg = ck.resolve({"lr": 0.01})
    with pytest.raises(AttributeError):
        cfg.lr
    assert cfg.values["lr"] == 0.01 and cfg.where("lr") == "--lr"


def test_file_values_and_flags_win(tmp_path):
    path = _write(tmp_path, """
[model]
model = "llama:tiny-tied"
model-args = { num_layers = 2 }
[data]
tokens_per_iter = 2048
steps = 7
[optimizer]
optimizer = "adamw"
lr = 3e-4
betas = [0.8, 0.95]
grad-clip = 1
[checkpointing]
checkpoint-dir = "ckpt"
checkpoint-every = 5
""")
    args = _parser().parse_args(["--config", str(path), "--lr", "0.01", "--steps", "9", "--resume"])
    cfg = ck.resolve(args)
    assert cfg.values["model"] == "llama:tiny-tied" and cfg.values["model_args"] == {"num_layers": 2}
    assert cfg.values["tokens_per_iter"] == 2048 and cfg.values["optimizer"] == "adamw"
    assert cfg.values["betas"] == (0.8, 0.95)
    assert cfg.values["grad_clip"] == 1.0 and isinstance(cfg.values["grad_clip"], float)
    assert cfg.values["lr"] == 0.01 and cfg.values["steps"] == 9 and cfg.values["resume"] is True           # flags win
    assert cfg.sources["lr"] == "command line" and cfg.sources["tokens_per_iter"] == "run.toml"
    assert cfg.sources["eps"] == "default"
    assert cfg.section("checkpointing")["checkpoint-every"] == 5


def test_the_collective_order_and_its_check_are_cluster_keys(tmp_path):
    cfg = ck.resolve(_parser().parse_args([]))
    assert cfg.values["collective_order"] == "free" and cfg.values["verify_collectives"] is False
    path = _write(tmp_path, "[cluster]\ncollective-order = \"strict\"\nverify-collectives = true\n")
    cfg = ck.resolve(_parser().parse_args(["--config", str(path)]))
    assert cfg.values["collective_order"] == "strict" and cfg.values["verify_collectives"] is True


def test_bool_flag_can_turn_off_a_file_setting(tmp_path):
    path = _write(tmp_path, "[logging]\nplots = true\n[checkpointing]\ncheckpoint-dir = 'c'\nresume = true\n")
    cfg = ck.resolve(_parser().parse_args(["--config", str(path), "--no-resume", "--no-plots"]))
    assert cfg.values["resume"] is False and cfg.values["plots"] is False


def test_shard_group_takes_a_toml_integer_or_a_word(tmp_path):
    path = _write(tmp_path, '[optimizer]\nshard-group = 8\n')
    assert ck.resolve(_parser().parse_args(["--config", str(path)])).values["shard_group"] == "8"
    assert ck.resolve(_parser().parse_args(["--shard-group", "auto"])).values["shard_group"] == "auto"
    with pytest.raises(HGraphError, match=r"shard-group = True: expected a string"):
        ck.resolve(argparse.Namespace(), _write(tmp_path, '[optimizer]\nshard-group = true\n'))


def test_none_unsets_optional_keys(tmp_path):
    path = _write(tmp_path, '[optimizer]\ngrad-clip = "none"\nweight-decay = 0.1\n')
    cfg = ck.resolve(_parser().parse_args(["--config", str(path), "--weight-decay", "none"]))
    assert cfg.values["grad_clip"] is None and cfg.values["weight_decay"] is None


@pytest.mark.parametrize("text, match", [
    ("[optimizer]\nlearning-rate = 1\n", r"run\.toml: unknown key \[optimizer\] learning-rate; allowed in "
                                          r"\[optimizer\]: optimizer, lr, betas"),
    ("[optimiser]\nlr = 1\n", r"unknown section \[optimiser\]; allowed sections: model, data, cluster"),
    ("lr = 1\n", r"top-level key 'lr' is not allowed"),
    ("[optimizer]\nlr = \"fast\"\n", r"\[optimizer\] lr = \"fast\": expected a number"),
    ("[data]\nsteps = 2.5\n", r"\[data\] steps = 2.5: expected an integer"),
    ("[data]\nsteps = true\n", r"\[data\] steps = True: expected an integer"),
    ("[data]\nsteps = 0\n", r"\[data\] steps = 0: must be >= 1"),
    ("[model]\ndtype = \"fp16\"\n", r"\[model\] dtype = \"fp16\": allowed are fp32, bf16"),
    ("[planner]\nmethod = \"exact\"\n", r"\[planner\] method = \"exact\": allowed are fast, greedy, cpsat"),
    ("[cluster]\ncollective-order = \"loose\"\n", r"\[cluster\] collective-order = \"loose\": allowed are free, strict"),
    ("[optimizer]\nbetas = [0.9]\n", r"\[optimizer\] betas = \[0.9\]: expected two numbers"),
    ("[optimizer]\nbetas = [0.9, 1.5]\n", r"each beta must be in \[0, 1\)"),
    ("[optimizer]\ngrad-clip = \"off\"\n", r"grad-clip = \"off\": expected a number or \"none\""),
    ("[logging]\nplots = \"yes\"\n", r"\[logging\] plots = \"yes\": expected true or false"),
    ("[model]\nmodel-args = 3\n", r"model-args = 3: expected a table"),
    ("[data]\nsteps = 3\nsteps = 4\n", r"not valid TOML"),
    ("[data]\nsteps = 3\n[data]\n", r"not valid TOML"),
    ("[data]\ntokens-per-iter = 5\ntokens_per_iter = 6\n", r"given twice"),
    ("[checkpointing]\ncheckpoint-every = 5\n", r"\[checkpointing\] checkpoint-every \(run\.toml\) needs "
                                                r"checkpoint-dir"),
])
def test_bad_files_name_key_value_and_what_is_allowed(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(HGraphError, match=match) as info:
        ck.resolve(argparse.Namespace(), path)
    assert "\n" not in str(info.value)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(HGraphError, match=r"config file '.*nope\.toml' cannot be read"):
        ck.load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize("argv, match", [
    (["--steps", "zero"], "expected int"),
    (["--dtype", "fp16"], "allowed are fp32, bf16"),
    (["--collective-order", "nccl"], "allowed are free, strict"),
    (["--lr", "-1"], "must be >= 0"),
    (["--betas", "0.9"], "expected two numbers"),
    (["--model-args", "[1]"], "expected a table"),
])
def test_bad_flags_are_argparse_errors(argv, match):
    with pytest.raises(argparse.ArgumentError, match=match):
        _parser().parse_args(argv)


def test_flag_combination_checked_after_merge():
    with pytest.raises(HGraphError, match=r"--resume needs checkpoint-dir"):
        ck.resolve(_parser().parse_args(["--resume"]))


def test_help_text_documents_every_key():
    text = rc.help_text()
    for key in ck.SCHEMA:
        assert f"  {key.name} = " in text and key.flag in text
    for section in ck.SECTIONS:
        assert f"[{section}]" in text
    assert "one of fast, greedy, cpsat" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_help_text_defaults_round_trip_as_toml(tmp_path):
    """The help shows each key as 'key = default': those lines form a valid file of the defaults."""
    lines = [line.strip() for line in rc.help_text().splitlines()
             if line.startswith("[") or (line.startswith("  ") and not line.startswith("      "))]
    path = _write(tmp_path, "\n".join(lines) + "\n")
    cfg = ck.resolve(argparse.Namespace(), path)
    assert cfg.values == ck.resolve(argparse.Namespace()).values


def test_dump_toml_round_trips(tmp_path):
    path = _write(tmp_path, """
[model]
model-args = { num_layers = 2, rope = { theta = 500000.0 }, names = ["a", "b"], tie = true }
[optimizer]
betas = [0.8, 0.95]
lr = 0.1
grad-clip = 1.5
[planner]
strategy-schedule = "4xTP1PP1;1xTP2PP2"
""")
    cfg = ck.resolve(_parser().parse_args(["--config", str(path), "--steps", "3", "--no-plots"]))
    text = ck.dump_toml(cfg)
    again = _write(tmp_path, text)
    back = ck.resolve(argparse.Namespace(), again)
    assert back.values == cfg.values
    assert back.values["model_args"]["rope"] == {"theta": 500000.0} and back.values["weight_decay"] is None
    with pytest.raises(HGraphError, match="TOML has no null"):
        ck.dump_toml({**cfg.values, "model_args": {"x": None}})


def test_memory_tracking_is_off_unless_asked_or_budgeted():
    """The saved-tensor accounting costs step time: a plain run does not pay for it."""
    import inspect

    from hgraph.runtime.engine.executor import Executor
    assert inspect.signature(Executor).parameters["track_memory"].default is False
    from hgraph.runtime.train.config_keys import BY_DEST
    assert BY_DEST["track_memory"].default is False
