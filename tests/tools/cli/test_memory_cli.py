"""`hgraph memory`: per-rank figures from the runtime's counts, grouped rows, the device memory check,
a 7B-shaped model on 64 ranks without allocating it, and bad input."""
import json

import pytest
import torch

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.engine.model_states import rank_states
from hgraph.runtime.planner.cost.runtime_memory import loss_transient_bytes, with_device_memory
from hgraph.runtime.planner.service.iteration import model_cost_model
from hgraph.strategy import Cluster, Scheme, Strategy
from hgraph.tools.cli import main
from hgraph.tools.cli.memory import ranks_text

STRATEGY = "1xTP2PP2+2xTP1PP1"


def run(capsys, *argv):
    code = main(["memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_figures_are_the_runtime_counts(capsys):
    code, out, err = run(capsys, "--model", "llama:tiny", "--strategy", STRATEGY, "--tokens", "512",
                         "--device-memory", "12M", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["strategy"], doc["world_size"], doc["tokens"], doc["dtype"]) == (STRATEGY, 6, 512, "float32")
    model = llama.build("tiny")
    compiled = hgraph.compile(model)
    counted = rank_states(compiled, Strategy.parse(STRATEGY), Cluster(6), torch.float32)
    assert [r["rank"] for r in doc["ranks"]] == list(range(6))
    for r, c in zip(doc["ranks"], counted):
        assert (r["masters"], r["moments"], r["working_params"], r["working_grads"], r["step_transient"]) == \
            (c.masters, c.moments, c.working_params, c.working_grads, c.step_transient)
        assert r["peak"] == c.resident + max(r["activations"], c.step_transient)
        assert r["fits"] == (r["peak"] <= 12 * 2 ** 20)
    assert doc["exceeding_ranks"] == [r["rank"] for r in doc["ranks"] if not r["fits"]]
    # 1F1B: the first stage holds two micro-batches of its layers, the last one and the head (and the
    # chunked loss's transient logits of one chunk)
    tp2 = {r["stage"]: r["activations"] for r in doc["ranks"][:4]}
    assert tp2[0] > tp2[1] - loss_transient_bytes(model.config.vocab_size, 512, 2) > 0
    # a PP1 rank's activations are the planner's per-token figure of its scheme, and the chunked loss's
    # transient logits of one chunk
    cost = with_device_memory(model_cost_model("analytic", model, 6), model, 12 * 2 ** 20)
    per_token = cost.memory.activation_bytes_per_token(cost.model, Scheme(1, 1))
    transient = loss_transient_bytes(model.config.vocab_size, 512)
    assert doc["ranks"][4]["activations"] == round(per_token * 512) + transient
    assert doc["max_len"] == {"TP2PP2": cost.max_len(Scheme(2, 2)), "TP1PP1": cost.max_len(Scheme(1, 1))}


def test_table_groups_identical_ranks_and_names_those_over_the_limit(capsys):
    code, out, err = run(capsys, "--model", "tiny", "--strategy", "4xTP1PP1", "--tokens", "1024",
                         "--device-memory", "4M")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("llama:tiny (0.3 M parameters), 4xTP1PP1 on 4 ranks")
    assert lines[1].split()[:3] == ["ranks", "scheme", "stage"]
    assert lines[2].startswith("0-3 (x4)  TP1PP1")        # one row for the four identical ranks
    assert "rank(s) 0-3 exceed it" in out and "MaxLen under it: TP1PP1 <= " in out
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_offload_moves_every_blocks_stash_to_the_host_column(capsys):
    """tiny (4 layers) under 1xTP1PP2 (2 layers a stage): stage 0 holds 2 micro-batches of 2 layers;
    offloaded, all of that is in host memory and the device keeps the 2 layers a backward brings
    back; the last stage keeps its head's and loss's activations on the device too."""
    base = ("--model", "llama:tiny", "--strategy", "1xTP1PP2", "--tokens", "512", "--json")
    plain = json.loads(run(capsys, *base)[1])["ranks"]
    code, out, err = run(capsys, *base, "--offload", "on", "--host-memory-budget", "1M")
    assert code == 0, err
    doc = json.loads(out)
    first, last = doc["ranks"]
    assert first["host_activations"] == plain[0]["activations"] and first["activations"] == plain[0]["activations"] // 2
    assert last["host_activations"] == first["host_activations"] // 2                 # one micro-batch in flight
    assert last["activations"] == plain[1]["activations"]                             # 2 layers back: all of them
    assert doc["offload"] and doc["host_memory"] == 2 ** 20
    assert doc["host_exceeding_ranks"] == [r["rank"] for r in doc["ranks"] if r["host_activations"] > 2 ** 20]
    assert "host" in run(capsys, *base[:-1], "--offload", "on")[1].splitlines()[1].split()


def test_a_7b_model_on_64_ranks_is_counted_without_allocating_it(capsys):
    code, out, err = run(capsys, "--model", "llama:7b", "--strategy", "4xTP8PP2", "--world-size", "64",
                         "--dtype", "bf16", "--device-memory", "80G", "--json")
    assert code == 0, err
    doc = json.loads(out)
    params = llama.CONFIGS["7b"].num_parameters()
    assert doc["parameters"] == params and len(doc["ranks"]) == 64
    assert sum(r["masters"] for r in doc["ranks"]) == 4 * params          # the segments tile the model
    assert max(r["optimizer"] for r in doc["ranks"]) <= 12 * params / 64 * 1.01
    pipeline = [r for r in doc["ranks"] if r["pipeline"] == 0]
    assert params * 2 <= sum(r["working_params"] for r in pipeline) <= params * 2 * 1.01   # bf16, norms replicated
    assert doc["exceeding_ranks"] == [] and doc["max_len"]["TP8PP2"] > 0


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama:nope", "--strategy", "1xTP1PP1"], "unknown llama config 'nope'"),
    (["--model", "tiny", "--strategy", "1xTPXPP1"], "malformed strategy"),
    (["--model", "tiny", "--strategy", "2xTP2PP1", "--world-size", "8"], "uses 4 ranks but the world size is 8"),
    (["--model", "tiny", "--strategy", "1xTP3PP1"], "TP=3 does not divide"),
    (["--model", "tiny", "--strategy", "1xTP1PP1", "--tokens", "0"], "--tokens must be a positive integer"),
    (["--model", "tiny", "--strategy", "1xTP1PP1", "--device-memory", "lots"], "--device-memory 'lots'"),
    (["--model", "tiny", "--strategy", STRATEGY, "--shard-group", "4"], "--shard-group '4': does not divide the "
                                                                        "world size 6"),
    (["--model", "tiny", "--strategy", STRATEGY, "--shard-group", "node"], "--shard-group 'node': not a number"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("strategy", ["2xTP2PP1", "4xTP1PP1"])
def test_max_len_and_the_peak_agree(capsys, strategy):
    """The MaxLen printed under a limit is the longest micro-batch whose peak the table shows under it:
    the planner counts the chunked loss's transient logits too (it printed TP2PP1 <= 1024 tokens under
    --device-memory auto while the same table's TP2PP1 peak at 1024 tokens was 19.86 MiB over 12.86)."""
    code, out, err = run(capsys, "--model", "tiny", "--strategy", strategy, "--device-memory", "auto", "--json")
    assert code == 0, err
    doc = json.loads(out)
    (scheme, max_len), = doc["max_len"].items()
    limit = doc["device_memory"]
    for tokens, fits in ((max_len, True), (max_len + 8, False)):
        if tokens > 1024:
            continue                        # the widest scheme holds the whole context by construction
        code, out, err = run(capsys, "--model", "tiny", "--strategy", strategy, "--device-memory", str(int(limit)),
                             "--tokens", str(tokens), "--json")
        peaks = [r["peak"] for r in json.loads(out)["ranks"]]
        assert (max(peaks) <= limit) == fits, (scheme, tokens, max(peaks), limit)


def test_shard_group_counts_each_ranks_states_within_its_group(capsys):
    """``--shard-group 2`` on 6 ranks: each rank's masters and moments are its rows of a group of 2 (the
    runtime's counts at G = 2, three times what the world's sharding gives a rank), the working weights
    stay the strategy's; the text says over what the states are sharded, as ``hgraph train`` does."""
    docs = {}
    for g in ("2", "world"):
        code, out, err = run(capsys, "--model", "llama:tiny", "--strategy", STRATEGY, "--shard-group", g, "--json")
        assert code == 0, err
        docs[g] = json.loads(out)
    assert (docs["2"]["shard_group"], docs["world"]["shard_group"]) == (2, 6)
    counted = rank_states(hgraph.compile(llama.build("tiny")), Strategy.parse(STRATEGY), Cluster(6, shard_group=2),
                          torch.float32)
    for r, w, c in zip(docs["2"]["ranks"], docs["world"]["ranks"], counted):
        assert (r["masters"], r["moments"], r["step_transient"]) == (c.masters, c.moments, c.step_transient)
        assert (r["working_params"], r["working_grads"]) == (w["working_params"], w["working_grads"])
    assert sum(r["masters"] for r in docs["2"]["ranks"]) == 3 * sum(r["masters"] for r in docs["world"]["ranks"])
    code, out, err = run(capsys, "--model", "llama:tiny", "--strategy", STRATEGY, "--shard-group", "2")
    assert code == 0 and "optimizer states: sharded over groups of 2 ranks (3 copies)" in out, err
