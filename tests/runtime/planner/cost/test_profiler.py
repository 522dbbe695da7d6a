"""``hgraph profile``: dual-layer profiling of a tiny zoo model, written and loaded back."""
import json
import re

import pytest

from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.planner.cost.profiler import measure_activation_coeff
from hgraph.strategy import Scheme
from hgraph.tools.cli import main

llama = pytest.importorskip("hgraph.frontends.zoo.llama")


def test_profile_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    # lengths far apart: the fit must see time grow with length (16..64 tokens of the tiny model are
    # within timing noise on a loaded 2-core machine, and the fit then came out flat)
    code = main(["profile", "--model", "llama:tiny", "--schemes", "TP1PP1,TP1PP2", "--lengths", "32,256,1024",
                 "--repeats", "2", "--threads", "1", "-o", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and json.loads(out.read_text()) == printed
    entry = printed["llama:tiny"]
    assert entry["model"] == {"hidden": 64, "layers": 4, "vocab": 512}
    assert [(s["tp"], s["pp"]) for s in entry["schemes"]] == [(1, 1), (1, 2)]
    assert "saved tensors" in entry["profiling"]["memory_source"]
    cm = load_cost_model(f"{out}:llama:tiny", world_size=2, gpus_per_node=1)
    for s in (Scheme(1, 1), Scheme(1, 2)):
        a, b, c = cm.coeffs(s)
        assert min(a, b, c) >= 0 and a + b > 0 and cm.max_len(s) > 0
    # The points behind each fit follow the dual-layer model: ceil(layers/PP) layers + the rest.
    prof = entry["profiling"]
    for (l, t1), (_, t2), lay, rest in zip(prof["points"]["TP1PP1"], prof["points"]["TP1PP2"], prof["layer_ms"],
                                           prof["rest_ms"]):
        assert t1 == pytest.approx(4 * lay + rest) and t2 == pytest.approx(2 * lay + rest)


def test_activation_coefficient_counts_saved_tensors():
    A = measure_activation_coeff(lambda n: llama.build("tiny", num_layers=n), hidden=64, vocab=512, length=64)
    # fp32 decoder layer: at least the inputs of q/k/v/o, the MLP and the norms are saved.
    assert 4 * 10 <= A <= 4 * 200


@pytest.mark.parametrize("argv,match", [
    (["--schemes", "TP2PP1"], "multi-process profiling"),
    (["--schemes", "TP1PP1UL2"], "TP, CP or UL > 1 needs multi-process profiling"),
    (["--model", "gpt:tiny"], "expected llama:NAME"),
    (["--model", "llama:nope"], "unknown llama config"),
    (["--lengths", "16,32"], "at least 3 distinct lengths"),
    (["--model-args", "{bad"], "not valid JSON"),
])
def test_profile_errors(capsys, argv, match):
    base = ["profile", "--model", "llama:tiny", "--lengths", "16,32,64", "--repeats", "1"]
    args = base + argv
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and match in err and err.count("\n") == 1


def test_the_host_link_is_measured_on_the_device_it_serves():
    from hgraph.runtime.planner.cost.profiler import measure_host_link
    link = measure_host_link("cpu", nbytes=2 ** 20, repeats=2)
    assert link["bytes_per_s"] == min(link["to_host_bytes_per_s"], link["to_device_bytes_per_s"]) > 0
    assert "memcpy" in link["source"]


def test_the_profile_times_with_a_rank_s_threads_and_checks_itself_on_the_whole_model(capsys, monkeypatch):
    """With torch's default threads on a loaded 2-core machine a tiny layer timed 40-430 ms (the threads
    wait for each other), 100x a layer's time in the run: the profile times with the threads a rank of
    a local run has, and checks its figures against the whole model timed the same way."""
    import os
    from hgraph.tools.cli.profile import rank_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_threads() == max(1, (os.cpu_count() or 1) // 4)
    assert main(["profile", "--model", "llama:tiny", "--lengths", "32,64,128", "--repeats", "2", "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)["llama:tiny"]["profiling"]
    assert raw["threads"] == rank_threads()
    check = raw["check"]
    assert check["length"] == 128 and check["layers"] == 4 and check["measured_ms"] > 0
    assert check["predicted_ms"] == pytest.approx(4 * raw["layer_ms"][2] + raw["rest_ms"][2])
    assert main(["profile", "--model", "llama:tiny", "--lengths", "32,64,128", "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    assert f"{rank_threads()} threads)" in text.splitlines()[0]
    line = next(line for line in text.splitlines() if line.startswith("  check: the whole 4-layer model at l=128"))
    ratio = float(re.search(r"ms \(([0-9.]+)x\)", line).group(1))
    assert ("they disagree" in line) == (not 0.8 <= ratio <= 1.25)
