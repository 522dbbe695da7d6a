"""``hgraph simulate``: JSON output and errors."""
import json

import numpy as np
import pytest

from hgraph.strategy import Strategy
from hgraph.tools.cli import main


@pytest.fixture()
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    lens = np.minimum(rng.lognormal(6.5, 1.5, size=4000).astype(int) + 1, 60000)
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, lens)) + "\n")
    return p


def test_json(lengths_file, capsys):
    assert main(["simulate", "--lengths", str(lengths_file), "--profile", "llama-7b", "--world-size", "8",
                 "--max-len", "16384", "--tokens-per-iter", "50000", "--iters", "2",
                 "--systems", "hgraph,megatron,dcp", "--max-cp", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["systems"]) == {"hgraph", "megatron", "dcp"}
    for r in out["systems"].values():
        assert len(r["latency_ms"]) == 2 and r["throughput_tokens_per_s"] > 0
    h = out["systems"]["hgraph"]["throughput_tokens_per_s"]
    best = max(v["throughput_tokens_per_s"] for k, v in out["systems"].items() if k != "hgraph")
    assert out["speedup_over_best_baseline"] == pytest.approx(h / best)


def test_human(lengths_file, capsys):
    assert main(["simulate", "--lengths", str(lengths_file), "--profile", "llama-7b", "--world-size", "8",
                 "--max-len", "16384", "--tokens-per-iter", "50000", "--iters", "1", "--systems", "hgraph,megatron"]) == 0
    assert "speedup of hgraph" in capsys.readouterr().out


def test_errors(lengths_file, capsys):
    base = ["simulate", "--lengths", str(lengths_file), "--tokens-per-iter", "50000", "--iters", "1"]
    assert main(base + ["--profile", "llama-7b", "--world-size", "8", "--max-len", "16384", "--systems", "foo"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(base + ["--profile", "llama-7b", "--world-size", "8", "--max-len", "9999999"]) == 2
    assert "largest MaxLen" in capsys.readouterr().err
    assert main(base + ["--profile", "llama-7b", "--world-size", "1", "--max-len", "4096"]) == 2
    assert "no scheme" in capsys.readouterr().err
    assert main(base + ["--profile", "nope", "--world-size", "8", "--max-len", "4096"]) == 2


def _shared_lengths():
    from pathlib import Path
    p = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "wikipedia_lengths.txt"
    return p if p.exists() else None


@pytest.mark.skipif(_shared_lengths() is None, reason="needs ../shared/data/wikipedia_lengths.txt")
def test_benchmarks_run_in_tiny_configurations(capsys):
    from hgraph.tools.bench import simulate as bench_simulate, wlb as bench_wlb
    assert bench_simulate.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenarios"][0]["speedup"] > 0
    assert bench_wlb.main(["--batches", "3", "--solver-batches", "1", "--solver-time-limit", "0.1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows["wlb q=2 cap=memory"]["imbalance"] >= 1.0


def test_the_ulysses_only_and_cp_only_baselines(lengths_file, capsys):
    """FlexSP-style (heterogeneous Ulysses groups per step, no CP) and Megatron-style CP-only baselines
    are printed with hgraph's speedup over each; without derived CP and UL (--max-cp 1) both are named
    as skipped."""
    base = ["simulate", "--lengths", str(lengths_file), "--profile", "llama-7b", "--world-size", "4",
            "--max-len", "16384", "--tokens-per-iter", "40000", "--iters", "1", "--systems", "hgraph,flexsp,megatron-cp"]
    assert main(base + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["systems"]) == {"hgraph", "flexsp", "megatron-cp"} and not out["skipped"]
    flexsp = [p for c in out["systems"]["flexsp"]["notes"]["candidates"] for p in Strategy.parse(c).pipelines]
    assert any(p.ul > 1 for p in flexsp) and all(p.pp == 1 and p.cp == 1 for p in flexsp)
    assert "CP" in out["systems"]["megatron-cp"]["config"] and "UL" not in out["systems"]["megatron-cp"]["config"]
    h = out["systems"]["hgraph"]["throughput_tokens_per_s"]
    for name in ("flexsp", "megatron-cp"):
        assert out["speedups"][name] == pytest.approx(h / out["systems"][name]["throughput_tokens_per_s"])
    assert main(base) == 0
    text = capsys.readouterr().out
    assert "  flexsp " in text and "  megatron-cp " in text
    assert f"speedup of hgraph over (tokens/s): flexsp {out['speedups']['flexsp']:.2f}x, megatron-cp" in text
    assert main(base[:-1] + ["flexsp,megatron-cp", "--max-cp", "1"]) == 0     # nothing left to run
    text = capsys.readouterr().out
    assert "flexsp       skipped: the cost model has no Ulysses scheme" in text and "megatron-cp  skipped" in text


def test_a_system_that_delays_documents_is_compared_by_tokens_per_second(lengths_file, capsys):
    """WLB's outlier delay trains some documents in extra iterations at the end: its mean iteration can
    be shorter than hgraph's while hgraph is faster; the table shows each system's iterations and total
    time, says why WLB ran more, and the speedups are of tokens/s (the same tokens in all)."""
    argv = ["simulate", "--lengths", str(lengths_file), "--profile", "llama-7b", "--world-size", "8",
            "--max-len", "16384", "--tokens-per-iter", "50000", "--iters", "2", "--systems", "hgraph,wlb"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)["systems"]
    wlb, hg = out["wlb"], out["hgraph"]
    extra = wlb["iterations"] - 2
    assert extra > 0 and wlb["notes"]["extra_flush_iterations"] == extra and hg["iterations"] == 2
    tokens = [sum(r["latency_ms"]) / 1e3 * r["throughput_tokens_per_s"] for r in (wlb, hg)]
    assert tokens[0] == pytest.approx(tokens[1])                      # the same tokens
    assert main(argv) == 0
    text = capsys.readouterr().out.splitlines()
    row = next(line for line in text if line.startswith("  wlb "))
    assert row.split()[1] == str(2 + extra) and float(row.split()[4]) == pytest.approx(sum(wlb["latency_ms"]) / 1e3,
                                                                                      abs=0.006)
    assert (f"  wlb: {2 + extra} iterations for the 2 mini-batches: its outlier delay holds documents back and "
            f"trains them in {extra} more at the end, so its mean iteration is lighter; compare tokens/s (the same "
            "tokens in all)") in text
    assert any(line.startswith("speedup of hgraph over (tokens/s): wlb ") for line in text)
