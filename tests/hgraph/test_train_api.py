"""``hgraph.train``: the run of ``hgraph train`` from Python, as a plain script (it starts the local
ranks) and under ``torchrun`` (every rank runs the script), equal to the command's run of the same
options: bitwise where both spawn their ranks alike, and under the noise-aware comparison of the
equivalence tests for torchrun (whose processes run with other thread settings). The model comes
from a factory function defined in the script."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.runtime.reference_training import assert_losses_like, assert_params_like, write_random_documents

import hgraph
from hgraph.errors import HGraphError, RunFailed
from hgraph.frontends.zoo import llama
from hgraph.tools.cli import main

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
OPTIONS = {"world_size": 2, "steps": 3, "tokens_per_iter": 30, "strategy_schedule": "1xTP2PP1;2xTP1PP1;1xTP1PP2"}
SCRIPT = textwrap.dedent('''
    import json
    import sys

    import torch

    import hgraph
    from hgraph.frontends.zoo import llama


    def build(num_layers):
        return llama.build("tiny", num_layers=num_layers)


    if __name__ == "__main__":
        options = json.loads(sys.argv[3])
        result = hgraph.train(build, sys.argv[1], model_args={"num_layers": 2}, **options)
        if result.state_dict is not None:
            torch.save(result.state_dict, sys.argv[2])
            model = result.load_into(build(2))
            assert all(torch.equal(p, result.state_dict[n]) for n, p in model.named_parameters())
        print("RESULT " + json.dumps({"rank": result.rank, "losses": [s["loss"] for s in result.steps],
                                      "has_state": result.state_dict is not None}))
''')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("api")
    (base / "train_script.py").write_text(SCRIPT)
    return base, write_random_documents(base / "docs.jsonl", LENGTHS, seed=3)


def _results(stdout):
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def test_a_script_and_torchrun_train_as_the_command_does(setup, tmp_path, capsys):
    base, data = setup
    script = base / "train_script.py"
    plain = subprocess.Popen([sys.executable, str(script), str(data), str(tmp_path / "plain.pt"), json.dumps(OPTIONS)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    launched = {k: v for k, v in OPTIONS.items() if k != "world_size"}      # the launcher's world size
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", str(script), str(data), str(tmp_path / "torchrun.pt"), json.dumps(launched)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    # the command's run of the same options, while the two others run
    argv = ["train", "--model", f"{script}:build", "--model-args", '{"num_layers": 2}', "--data", str(data),
            "--world-size", "2", "--steps", "3", "--tokens-per-iter", "30", "--strategy-schedule",
            OPTIONS["strategy_schedule"], "--save-final", str(tmp_path / "cli.pt"), "--json"]
    assert main(argv) == 0
    cli_losses = [s["loss"] for s in json.loads(capsys.readouterr().out)["steps"]]
    cli = torch.load(tmp_path / "cli.pt", weights_only=True)
    outs = []
    for proc in (plain, torchrun):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        outs.append(_results(out))

    (one,) = outs[0]
    assert one["rank"] == 0 and one["has_state"] and one["losses"] == cli_losses
    plain_state = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert list(plain_state) == list(cli) and all(torch.equal(plain_state[k], v) for k, v in cli.items())

    assert sorted((r["rank"], r["has_state"]) for r in outs[1]) == [(0, True), (1, False)]
    assert_losses_like(next(r for r in outs[1] if r["rank"] == 0)["losses"], cli_losses)
    assert_params_like(torch.load(tmp_path / "torchrun.pt", weights_only=True), cli, lr=1e-3)


def _nested():
    def build():
        return llama.build("tiny")
    return build


@pytest.mark.parametrize("model, match", [
    (llama.build("tiny"), "got an instance of Llama; pass what builds it"),
    (_nested(), "not defined at the top level"),
    (42, "must be a model spec, a class or a function"),
])
def test_a_model_the_ranks_cannot_rebuild_is_one_clear_error(model, match):
    with pytest.raises(HGraphError, match=match):
        hgraph.train(model, steps=1)


def test_unknown_options_are_named():
    with pytest.raises(HGraphError, match="unknown option.*tokens_per_itr"):
        hgraph.train("llama:tiny", tokens_per_itr=30)


BROKEN = textwrap.dedent('''
    import torch


    class Broken(torch.nn.Module):
        """Looks up 8 token ids only: a document with a larger id fails inside the rank's forward."""

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 16)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16)])
            self.head = torch.nn.Linear(16, 8)

        def forward(self, input_ids, position_ids=None):
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)
''')


def test_a_run_that_fails_in_a_rank_raises_its_own_line(tmp_path):
    """Not "its error is on stderr above": the failing rank's line is the exception's message."""
    (tmp_path / "broken.py").write_text(BROKEN)
    data = write_random_documents(tmp_path / "docs.jsonl", [6, 5, 7], seed=1)     # ids beyond 8
    with pytest.raises(RunFailed, match=r"rank 0 failed: IndexError: index out of range"):
        hgraph.train(f"{tmp_path / 'broken.py'}:Broken", str(data), world_size=1, steps=1, tokens_per_iter=20,
                     strategy_schedule="1xTP1PP1")


def test_trained_weights_come_back_without_a_file(setup, tmp_path, monkeypatch):
    """Rank 0's parameters reach the caller through shared memory: no torch.save / torch.load here,
    and they are the ones the run's --save-final file holds."""
    base, data = setup
    options = {**OPTIONS, "steps": 1}

    def no_file(*args, **kwargs):
        raise AssertionError("the trained weights went through a torch.save / torch.load file")
    with monkeypatch.context() as patched:
        patched.setattr(torch, "save", no_file)
        patched.setattr(torch, "load", no_file)
        result = hgraph.train("llama:tiny", str(data), **options)
    saved = hgraph.train("llama:tiny", str(data), save_final=str(tmp_path / "final.pt"), **options)
    expected = torch.load(tmp_path / "final.pt", weights_only=True)
    assert result.rank == 0 and list(result.state_dict) == list(expected)
    assert all(torch.equal(result.state_dict[k], v) for k, v in expected.items())
    assert all(torch.equal(saved.state_dict[k], v) for k, v in expected.items())
