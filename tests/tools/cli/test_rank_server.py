"""``hgraph train`` starts its ranks' forkserver first (with transformers for ``hf:`` models), nothing
for help or a launcher's rank; the ``hgraph`` program freezes its heap before the interpreter exits."""
import gc
import sys

import pytest

import hgraph.tools.cli as cli
from hgraph.tools.cli import rank_server
from hgraph.tools.cli.rank_server import model_spec, rank_libraries


@pytest.fixture
def started(monkeypatch):
    calls = []
    monkeypatch.setattr(rank_server, "start_rank_server", lambda libraries: calls.append(tuple(libraries)))
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_train_starts_the_ranks_server_before_reading_its_flags_and_only_train_does(started, capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", "hf:gpt2", "--steps", "many"])
    assert started == [("transformers",)]
    with pytest.raises(SystemExit):
        cli.main(["memory", "--model", "hf:gpt2", "--steps", "many"])
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert started == [("transformers",)]
    capsys.readouterr()


def test_the_model_comes_from_the_flag_or_the_config_file(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('[model]\nmodel = "hf:llama"\n')
    assert model_spec(["--model=llama:tiny"]) == "llama:tiny"
    assert model_spec(["--config", str(run)]) == "hf:llama"
    assert model_spec(["--config", str(run), "--model", "tiny"]) == "tiny"
    assert rank_libraries(["--config", str(run)]) == ("transformers",)
    assert rank_libraries(["--model", "tiny"]) == ()
    # an unreadable config starts the server without extras; the command then names the file
    assert rank_libraries(["--config", str(tmp_path / "missing.toml")]) == ()


def test_a_launchers_rank_starts_no_server(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rank_libraries(["--model", "hf:gpt2"]) is None


def test_the_program_freezes_its_heap_for_the_exit(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hgraph", "--version"])
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(SystemExit):
            cli.entry()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert capsys.readouterr().out.startswith("hgraph ")
