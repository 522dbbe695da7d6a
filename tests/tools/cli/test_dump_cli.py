"""`hgraph dump`: every format for two heterogeneous strategies on 8 ranks, and bad input."""
import json
import xml.etree.ElementTree as ET

import pytest

from hgraph.tools.cli import main

STRATEGIES = ["1xTP4PP1+2xTP2PP1", "1xTP2PP2+1xTP1PP2+2xTP1PP1"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_json_lists_every_rank_with_params_and_subgraphs(capsys, strategy):
    code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--world-size", "8", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["strategy"] == strategy and doc["world_size"] == 8
    assert [r["rank"] for r in doc["ranks"]] == list(range(8))
    for r in doc["ranks"]:
        assert set(r) >= {"rank", "pipeline", "stage", "tp_rank", "cp_rank", "params", "subgraphs"}
        for p in r["params"]:
            assert set(p) == {"name", "full_shape", "shard_shape", "shard_dim"}
        kinds = {s["kind"] for s in r["subgraphs"]}
        assert {"pull_parameter", "push_gradient"} <= kinds
        for s in r["subgraphs"]:
            assert s["kind"] in ("pull_parameter", "push_gradient", "comm_activation")
            assert isinstance(s["bytes"], int) and isinstance(s["peers"], list) and s["ops"]
        pushes = [s["param"] for s in r["subgraphs"] if s["kind"] == "push_gradient"]
        assert sorted(pushes) == sorted(p["name"] for p in r["params"])
    tp4 = doc["ranks"][0]
    q = next(p for p in tp4["params"] if p["name"] == "layers.0.self_attn.q_proj.weight")
    if strategy.startswith("1xTP4"):
        assert q["shard_shape"] == [16, 64] and q["shard_dim"] == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_svg_and_html_are_valid_and_colour_the_subgraph_kinds(capsys, tmp_path, strategy):
    svg = tmp_path / "g.svg"
    code, _, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--world-size", "8",
                       "--format", "svg", "-o", str(svg), "--model-args", '{"num_layers": 2}')
    assert code == 0, err
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = svg.read_text()
    for kind in ("pull_parameter", "push_gradient", "comm_activation"):
        assert kind in text
    assert "rank 7" in text
    code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--world-size", "8",
                         "--format", "html", "--rank", "0", "--model-args", '{"num_layers": 2}')
    assert code == 0, err
    assert out.lstrip().lower().startswith("<!doctype html") and "<svg" in out
    assert f"<h1>llama:tiny under {strategy}: rank 0 of 8</h1>" in out


def test_html_boxes_each_layer_block_and_slot_subgraph_and_keeps_comm_edges(capsys):
    code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", "1xTP2PP2+1xTP1PP1", "--format", "html",
                         "--model-args", '{"num_layers": 2}')
    assert code == 0, err
    assert "<h1>llama:tiny under 1xTP2PP2+1xTP1PP1: all 5 ranks</h1>" in out
    data = json.loads(out.split('<script type="application/json" id="graph-data">')[1].split("</script>")[0])
    boxes = data["boxes"]
    blocks = {b["tip"].split(" / ")[-1] for b in boxes.values() if b["parent"] is None}
    assert {"layers.0", "layers.1"} <= blocks
    slots = [b for b in boxes.values() if b["kind"] in ("pull_parameter", "push_gradient", "comm_activation")]
    assert {"pull_parameter", "push_gradient", "comm_activation"} == {b["kind"] for b in slots}
    # a pulled weight of a layer sits in that layer's box, named without the layer's prefix
    q = next(b for b in slots if b["name"] == "pull self_attn.q_proj.weight")
    assert boxes[q["parent"]]["name"] == "layers.0"
    top = {item[0] for item in data["levels"][""]["items"]}
    assert len(top) < len(data["nodes"]) / 10 and not data["open"]
    assert data["comm"], "activation edges between the stages"
    for src, dst, _ in data["comm"]:
        assert src.split(".")[0] != dst.split(".")[0]  # node ids are r<rank>.<name>


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dot_text_and_python(capsys, strategy):
    code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--world-size", "8", "--format", "dot",
                         "--model-args", '{"num_layers": 2}')
    assert code == 0, err
    assert out.lstrip().startswith("digraph") and "cluster" in out and out.count("{") == out.count("}")
    code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--world-size", "8", "--format", "text")
    assert code == 0, err
    assert out.count("== rank ") == 8
    code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--world-size", "8",
                         "--format", "python", "--rank", "7")
    assert code == 0, err
    compile(out, "<dump>", "exec")   # valid Python
    assert "class Rank7(torch.nn.Module)" in out and "# ---- push_gradient" in out


def test_large_model_is_dumped_without_allocating_weights(capsys):
    code, out, err = run(capsys, "dump", "llama:7b", "--strategy", "1xTP8PP4+4xTP4PP2+8xTP1PP1", "--world-size", "72",
                         "--rank", "0", "--format", "json", "--gpus-per-node", "8")
    assert code == 0, err
    r = json.loads(out)["ranks"][0]
    q = next(p for p in r["params"] if p["name"] == "layers.0.self_attn.q_proj.weight")
    assert q["full_shape"] == [4096, 4096] and q["shard_shape"] == [512, 4096]


@pytest.mark.parametrize("argv, message", [
    (["dump", "llama:nope", "--strategy", "1xTP1PP1"], "nope"),
    (["dump", "nowhere.py:Model", "--strategy", "1xTP1PP1"], "nowhere.py"),
    (["dump", "llama:tiny", "--strategy", "2xTP2PQ1"], "position 6"),
    (["dump", "llama:tiny", "--strategy", "1xTP8PP1"], "attention heads"),
    (["dump", "llama:tiny", "--strategy", "2xTP1PP1", "--world-size", "3"], "world size is 3"),
    (["dump", "llama:tiny", "--strategy", "1xTP1PP1", "--model-args", "{bad"], "--model-args"),
    (["dump", "llama:tiny", "--strategy", "1xTP1PP1", "--rank", "4"], "rank 4"),
    (["dump", "llama:tiny", "--strategy", "2xTP1PP1", "--shard-group", "3"], "--shard-group '3': does not divide"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_untraceable_model_names_where_and_suggests_export(capsys, tmp_path):
    src = tmp_path / "bad_model.py"
    src.write_text(
        "import torch\n"
        "class Bad(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])\n"
        "    def forward(self, input_ids, position_ids=None):\n"
        "        x = input_ids.float()\n"
        "        if x.sum() > 0:\n"
        "            x = x + 1\n"
        "        return x\n")
    code, out, err = run(capsys, "dump", f"{src}:Bad", "--strategy", "1xTP1PP1")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "export" in err and "Traceback" not in err


# ---- from a run directory ------------------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"model": "llama:tiny", "model_args": {}, "world_size": 4,
                                            "gpus_per_node": 8, "dtype": "fp32"}))
    used = ["4xTP1PP1", "1xTP2PP1+2xTP1PP1", "4xTP1PP1", "2xTP1PP2"]
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "strategy": s, "loss": 1.0}) + "\n"
                                             for k, s in enumerate(used)))
    return d


def test_run_dir_dumps_each_strategy_used_once_with_its_steps(capsys, run_dir, tmp_path):
    code, out, _ = run(capsys, "dump", "--run-dir", str(run_dir), "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["world_size"] == 4 and doc["model"] == "llama:tiny"
    assert [(s["strategy"], s["steps"]) for s in doc["strategies"]] == [
        ("4xTP1PP1", [0, 2]), ("1xTP2PP1+2xTP1PP1", [1]), ("2xTP1PP2", [3])]
    assert all(s["dump"]["strategy"] == s["strategy"] and len(s["dump"]["ranks"]) == 4 for s in doc["strategies"])
    code, out, _ = run(capsys, "dump", "--run-dir", str(run_dir), "--rank", "1")
    assert code == 0 and out.count("# ==== ") == 3 and "# ==== 4xTP1PP1: 2 steps (0, 2)" in out
    code, _, err = run(capsys, "dump", "--run-dir", str(run_dir), "--format", "svg", "-o", str(tmp_path / "svg"))
    assert code == 0 and sorted(p.name for p in (tmp_path / "svg").iterdir()) == [
        "1xTP2PP1+2xTP1PP1.svg", "2xTP1PP2.svg", "4xTP1PP1.svg"]
    ET.parse(tmp_path / "svg" / "2xTP1PP2.svg")
    code, out, _ = run(capsys, "dump", "--run-dir", str(run_dir), "--format", "json", "--shard-group", "2")
    assert code == 0 and all(s["dump"]["shard_group"] == 2 for s in json.loads(out)["strategies"])


@pytest.mark.parametrize("setup, argv, message", [
    (None, ["--format", "svg"], "needs -o DIR"),
    ("no-run-json", [], "run.json does not exist"),
    ("bad-metrics", [], "metrics.jsonl:2: not a metrics line"),
    (None, ["llama:tiny"], "give no MODEL or --strategy"),
])
def test_run_dir_bad_input_is_one_line_and_exit_2(capsys, run_dir, setup, argv, message):
    if setup == "no-run-json":
        (run_dir / "run.json").unlink()
    elif setup == "bad-metrics":
        (run_dir / "metrics.jsonl").write_text('{"step": 0, "strategy": "4xTP1PP1"}\n{"step": 1}\n')
    code, _, err = run(capsys, "dump", "--run-dir", str(run_dir), *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_training_records_the_run_for_dump(tmp_path, capsys):
    from hgraph.runtime.train.config import TrainConfig
    from hgraph.runtime.train.run_record import read_run_record, write_run_record
    config = TrainConfig.from_values(model="llama:tiny", world_size=2, steps=3, tokens_per_iter=64,
                                     model_args={"num_layers": 2}, strategies="auto", profile="measure")
    write_run_record(tmp_path, config)
    record = read_run_record(tmp_path)
    assert record["model"] == "llama:tiny" and record["model_args"] == {"num_layers": 2}
    assert record["world_size"] == 2 and record["strategies"] == "auto" and record["profile"] == "measure"


def test_shard_group_dumps_the_pull_and_push_plans_of_the_group(capsys):
    """``--shard-group 4`` on 8 ranks: every rank's Pull and Push exchange inside its group of 4 (the
    Program of that cluster's plans), where the world's layout has ranks pulling across it; the text
    names the group and the replicas the shards are summed with."""
    strategy = "1xTP2PP2+2xTP2PP1"
    docs = {}
    for g in ("4", "world"):
        code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--shard-group", g, "--json")
        assert code == 0, err
        docs[g] = json.loads(out)
    assert (docs["4"]["shard_group"], docs["world"]["shard_group"]) == (4, 8)
    for r in docs["4"]["ranks"]:
        group = set(range(r["rank"] // 4 * 4, r["rank"] // 4 * 4 + 4))
        lay = r["optimizer"]
        assert set(lay["shard_group"]) == group and lay["replicas"] == [r["rank"] % 4, r["rank"] % 4 + 4]
        assert lay["pull_peers"] and set(lay["pull_peers"]) <= group and set(lay["push_peers"]) <= group
        for sg in r["subgraphs"]:
            if sg["kind"] in ("pull_parameter", "push_gradient"):
                assert set(sg["peers"]) <= group, sg
    assert any(not set(r["optimizer"]["pull_peers"]) <= set(range(r["rank"] // 4 * 4, r["rank"] // 4 * 4 + 4))
               for r in docs["world"]["ranks"])
    code, out, err = run(capsys, "dump", "llama:tiny", "--strategy", strategy, "--shard-group", "4", "--rank", "5")
    assert code == 0, err
    assert "optimizer states: sharded over ranks 4-7 (G 4), its shards summed across the 2 groups with ranks [1, 5]" \
        in out
