"""``hgraph plan`` end to end through the CLI entry point."""
import json

import numpy as np
import pytest

from hgraph.runtime.data.lengths import minibatches
from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.planner.plan import PipelinePlan, Plan, estimate_plan
from hgraph.strategy import Scheme, Strategy
from hgraph.tools.cli import main


@pytest.fixture
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(6.0, 1.3, size=400).astype(np.int64), 1)
    lengths[5] = 50_000  # longer than the context: truncated
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, lengths)) + "\n")
    return p, lengths


BASE = ["plan", "--profile", "llama-7b", "--world-size", "16", "--max-len", "16384", "--tokens-per-iter", "60000"]


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output(capsys, lengths_file):
    path, lengths = lengths_file
    code, out, err = _run(capsys, BASE + ["--lengths", str(path), "--iters", "3", "--json",
                                          "--strategies", "4xTP2PP2;2xTP8PP1;1xTP8PP1+2xTP4PP1"])
    assert code == 0
    data = json.loads(out)
    assert data["candidates"] == ["4xTP2PP2", "2xTP8PP1", "1xTP8PP1+2xTP4PP1"]
    truncated = np.minimum(lengths, 16384)
    batches = minibatches(truncated, 60000)[:3]
    assert len(data["iterations"]) == 3
    cost = load_cost_model("llama-7b", world_size=16)
    for it, ids in zip(data["iterations"], batches):
        assert set(it) == {"index", "num_docs", "tokens", "strategy", "est_latency_ms", "solve_ms", "pipelines"}
        docs = [d for p in it["pipelines"] for mb in p["microbatches"] for d in mb]
        assert sorted(docs) == ids.tolist()  # 0-based file indices, each once
        assert it["num_docs"] == len(ids) and it["tokens"] == int(truncated[ids].sum())
        assert it["strategy"] in data["candidates"]
        # The JSON estimate is the cost model's, recomputed from the printed micro-batches.
        strategy = Strategy.parse(it["strategy"])
        plan = Plan(strategy, [PipelinePlan(Scheme.parse(p["scheme"]), p["ranks"], p["microbatches"], p["est_latency_ms"])
                               for p in it["pipelines"]], it["est_latency_ms"], it["solve_ms"],
                    {int(d): int(truncated[d]) for d in ids})
        assert estimate_plan(plan, cost) == it["est_latency_ms"]
    assert data["iterations"][0]["tokens"] <= 60000


def test_methods_agree_on_validity(capsys, lengths_file):
    path, lengths = lengths_file
    for method in ("greedy", "cpsat"):
        code, out, _ = _run(capsys, BASE + ["--lengths", str(path), "--json", "--method", method, "--time-limit", "0.5",
                                            "--strategies", "1xTP8PP1+2xTP4PP1"])
        assert code == 0
        it = json.loads(out)["iterations"][0]
        ids = minibatches(np.minimum(lengths, 16384), 60000)[0]
        assert sorted(d for p in it["pipelines"] for mb in p["microbatches"] for d in mb) == ids.tolist()


def test_human_output_and_auto(capsys, lengths_file):
    path, _ = lengths_file
    code, out, _ = _run(capsys, BASE + ["--lengths", str(path), "--iters", "2"])
    assert code == 0
    assert "iteration 0:" in out and "iteration 1:" in out and "est ms" in out
    assert "candidate strategies" in out


@pytest.mark.parametrize("content,args,match", [
    ("", [], "empty"),
    ("12\nx7\n", [], r"l\.txt:2: "),
    ("12\n", ["--profile", "gpt-x"], "unknown profile 'gpt-x'"),
    ("12\n", ["--world-size", "1", "--profile", "llama-32b"], "no scheme of profile 'llama-32b' fits 1 GPUs"),
    ("100\n900000\n", ["--max-len", "1000000", "--world-size", "8", "--iters", "2"], "document 1 has 900000 tokens.*largest MaxLen"),
    ("12\n", ["--strategies", "3xTP2PP2"], "uses 12 ranks but the world size is 16"),
    ("12\n", ["--strategies", "2xTP3"], "malformed"),
    ("12\n", ["--iters", "0"], "--iters must be a positive integer"),
])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, content, args, match):
    p = tmp_path / "l.txt"
    p.write_text(content)
    argv = BASE + ["--lengths", str(p)]
    # later options override earlier ones in argparse
    code, out, err = _run(capsys, argv + args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("hgraph plan: error:")
    import re
    assert re.search(match, err), err


def test_an_analytic_zoo_profile_plans_a_moe_model_with_ep_pipelines(capsys, lengths_file):
    path, _ = lengths_file
    argv = ["plan", "--profile", "analytic:llama-moe:16b", "--world-size", "16", "--max-len", "8192",
            "--tokens-per-iter", "60000", "--lengths", str(path), "--json",
            "--strategies", "2xTP1PP1EP8;1xTP1PP1EP8+4xTP2PP1"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    data = json.loads(out)
    assert data["candidates"] == ["2xTP1PP1EP8", "1xTP1PP1EP8+4xTP2PP1"]
    assert any(p["scheme"] == "TP1PP1EP8" for p in data["iterations"][0]["pipelines"])
    code, out, err = _run(capsys, ["plan", "--profile", "analytic:llama-moe:huge", "--world-size", "16", "--max-len",
                                   "8192", "--tokens-per-iter", "60000", "--lengths", str(path)])
    assert code == 2 and not out and len(err.strip().splitlines()) == 1
    assert "analytic: takes a zoo model" in err and "llama-moe:16b" in err
