"""``hgraph check``: the verdict line, its JSON, exit 1 on a deadlock and 2 on bad input."""
import json

from hgraph.runtime.comm.order.derive import derive_steps
from hgraph.tools.cli import main


def test_deadlock_free_line_and_json(capsys):
    assert main(["check", "--model", "llama:tiny", "--strategy-schedule", "1xTP2PP1+2xTP1PP1,4xTP1PP1",
                 "--microbatches", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("deadlock-free: 4 ranks, ") and out.out.endswith(" collectives\n")
    assert main(["check", "--model", "llama:tiny", "--strategy", "2xTP2PP1", "--shard-group", "2",
                 "--grad-clip", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] and got["ranks"] == 4 and got["line"] == f"deadlock-free: 4 ranks, {got['collectives']} collectives"


def test_moe_router_losses_collectives_are_checked(capsys):
    """An MoE model with router losses: per document, the counts' all-reduces over the CP group (one per
    MoE layer and micro-batch: 2 x 2 in the working pipeline, the plan's last idles); over the global
    batch, the counting pass's forwards and its all-reduce; deadlock-free either way (``collectives``
    counts each group's operations once)."""
    base = ["check", "--model", "llama-moe:tiny", "--strategy", "2xTP1PP1CP2", "--microbatches", "2", "--json"]
    counts = {}
    for form in ("none", "per-document", "global-batch"):
        assert main(base + ["--moe-aux-loss", form, "--moe-z-loss"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["ok"] and ("MoE load balancing" in got["plans"][0]) == (form != "none")
        counts[form] = got["collectives"]
    assert counts["per-document"] == counts["none"] + 2 * 2
    assert counts["global-batch"] > counts["none"] + 1       # the counting pass's CP gathers, the all-reduce


def test_cycle_exits_1(capsys, monkeypatch):
    """An order with a cycle (two buckets of one rank swapped after the derivation): exit 1, the cycle
    in the line and in the JSON's waits."""
    from hgraph.tools.cli import check

    def swapped(steps):
        seqs = derive_steps(steps)
        seq = seqs[2]
        idx = [i for i, c in enumerate(seq) if c.label.startswith("push bucket")]
        a, b = next((a, b) for a, b in zip(idx, idx[1:]) if seq[a].group != seq[b].group)
        seq[a], seq[b] = seq[b], seq[a]
        return seqs

    monkeypatch.setattr(check, "derive_steps", swapped)
    assert main(["check", "--model", "llama:tiny", "--strategy", "1xTP2PP1+2xTP1PP1", "--microbatches", "1",
                 "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert not got["ok"] and got["line"].startswith("deadlock: rank ")
    assert 2 in {w["rank"] for w in got["waits"]} and len(got["waits"]) >= 2


def test_bad_input_is_one_line(capsys):
    for argv in (["--strategy", "1xTQ2"], ["--strategy", "1xTP2PP1", "--world-size", "4"],
                 ["--strategy", "4xTP1PP1", "--shard-group", "3"], ["--strategy", "4xTP1PP1", "--microbatches", "-1"]):
        assert main(["check", "--model", "llama:tiny", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hgraph check: error: ") and err.count("\n") == 1, err


def test_1024_ranks_homogeneous_then_heterogeneous(capsys):
    """Cluster scale: a homogeneous strategy switching to a heterogeneous one on 1,024 ranks (states
    sharded per node, so a rank's pull stays in its group; 9 s of CPU here, the optimizer sharded over
    the world takes minutes: ``tools/bench/collective_check``)."""
    assert main(["check", "--model", "llama:tiny", "--world-size", "1024", "--shard-group", "8",
                 "--strategy-schedule", "128xTP4PP2,32xTP4PP2+128xTP2PP1+128xTP1PP2+64xTP2PP2",
                 "--microbatches", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] and got["ranks"] == 1024 and got["collectives"] > 20000


def test_shard_group_takes_what_train_takes(capsys):
    """``--shard-group`` as ``hgraph train`` takes it: an integer, ``world`` or ``auto`` (without a
    device memory: a node), resolved the same way: ``auto`` on nodes of 2 is the group of 2."""
    counts = {}
    for value in ("2", "world", "auto"):
        assert main(["check", "--model", "llama:tiny", "--strategy", "4xTP1PP1", "--gpus-per-node", "2",
                     "--shard-group", value, "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["ok"] and got["ranks"] == 4
        counts[value] = got["collectives"]
    assert counts["auto"] == counts["2"] != counts["world"]
    assert main(["check", "--model", "llama:tiny", "--strategy", "4xTP1PP1", "--shard-group", "nodes"]) == 2
    assert "--shard-group 'nodes': not a number" in capsys.readouterr().err
