"""hgraph report / tools.plots: figures from a synthetic metrics.jsonl, summary figures, bad input."""
from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET

import pytest

from hgraph.errors import HGraphError
from hgraph.tools.cli import main
from hgraph.tools.report import plots

STRATEGIES = ["4xTP1PP1", "2xTP2PP1", "1xTP2PP1+2xTP1PP1"]


def _record(k: int, full: bool = True) -> dict:
    meas_ms = 100.0 + 10 * (k % 4)
    rec = {"step": k, "strategy": STRATEGIES[k % 3], "loss": 6.0 - 0.1 * k, "tokens": 4000 + k,
           "time_s": meas_ms / 1e3, "pull_s": 0.01, "skipped": False, "cache_hits": k}
    if full:
        # estimates: steps with k % 4 == 0 are off by 25%, the others within 5%
        est = meas_ms * (1.25 if k % 4 == 0 else 0.95)
        rec.update({"pipelines": [{"scheme": "TP1PP1", "est_latency_ms": est, "measured_latency_ms": meas_ms},
                                  {"scheme": "TP1PP1", "est_latency_ms": est / 2, "measured_latency_ms": 50.0}],
                    "rank_busy_s": [0.1, 0.1, 0.05, 0.15], "planner_wait_s": 0.002, "switch_s": 1e-4,
                    "cache_hit": k >= 3, "built_ahead": k in (1, 2), "build_s": 0.25 if k < 3 else None})
    return rec


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 300 and height > 200
    import matplotlib.image
    pixels = matplotlib.image.imread(path)           # decodes the whole image
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.01                       # not a blank canvas


def _check_svg(path) -> None:
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    assert sum(1 for _ in root.iter()) > 50         # drawn elements, not an empty document


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    _write(run / "metrics.jsonl", [_record(k) for k in range(12)])
    return run


def test_report_writes_every_figure_as_png_and_svg(full_run, capsys):
    assert main(["report", str(full_run)]) == 0
    out = capsys.readouterr().out
    for name in plots.PLOT_NAMES:
        _check_png(full_run / f"{name}.png")
        _check_svg(full_run / f"{name}.svg")
        assert f"wrote {full_run / (name + '.png')}" in out
    assert "12 steps" in out and "strategies (3)" in out


def test_strategy_figure_has_a_band_per_strategy(full_run):
    text = (full_run / "strategy_latency.svg").read_text()
    for s in STRATEGIES:
        assert s in text                            # legend entries, one per strategy


def test_summary_figures(full_run, capsys):
    assert main(["report", str(full_run), "--json", "--out", str(full_run / "o"), "--formats", "svg"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["summary"]
    assert s["steps"] == 12 and s["distinct_strategies"] == 3
    assert s["strategies"] == {"4xTP1PP1": 4, "2xTP2PP1": 4, "1xTP2PP1+2xTP1PP1": 4}
    assert s["est_within_10pct"] == pytest.approx(9 / 12)      # k = 0, 4, 8 are 25% off
    assert s["mean_balance"] == pytest.approx(0.15 / 0.1)
    assert s["planner_wait_s"] == pytest.approx(12 * 0.002)
    assert s["cache_hit_rate"] == pytest.approx(9 / 12)
    assert s["build_s"] == pytest.approx(3 * 0.25) and s["built_ahead"] == 2     # the three strategies' builds
    total = sum((100 + 10 * (k % 4)) / 1e3 for k in range(12))
    assert s["steps_per_s"] == pytest.approx(12 / total)
    assert s["first_loss"] == 6.0 and s["last_loss"] == pytest.approx(4.9)
    assert out["skipped"] == {} and len(out["plots"]) == len(plots.PLOT_NAMES)
    assert all(p.endswith(".svg") and p.startswith(str(full_run / "o")) for p in out["plots"])


def test_estimate_comes_from_the_slowest_pipeline():
    rec = _record(1)
    assert plots.estimated_ms(rec) == pytest.approx(110 * 0.95)
    assert plots.estimated_ms({**rec, "est_latency_ms": 7.0}) == 7.0
    assert plots.estimated_ms(_record(1, full=False)) is None


def test_todays_trainer_fields_give_the_figures_they_can(tmp_path, capsys):
    records = [_record(k, full=False) for k in range(5)]
    records[2]["loss"] = float("nan")               # a non-finite step (json writes NaN)
    records[2]["skipped"] = True
    _write(tmp_path / "metrics.jsonl", records)
    assert main(["report", str(tmp_path), "--formats", "svg"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "strategy_latency.svg").exists() and (tmp_path / "loss.svg").exists()
    assert not (tmp_path / "loss.png").exists()
    for name in ("est_vs_measured", "rank_busy", "overheads"):
        assert f"skipped {name}:" in out and not (tmp_path / f"{name}.svg").exists()
    assert "1 skipped steps" in (tmp_path / "loss.svg").read_text()


@pytest.mark.parametrize("content, match", [
    (None, r"metrics file '.*metrics\.jsonl' does not exist"),
    ("", r"holds no steps"),
    ('{"step": 0, "strategy": "4xTP1PP1"\n', r"metrics\.jsonl:1: malformed JSON"),
    (json.dumps(_record(0)) + "\n[1, 2]\n", r"metrics\.jsonl:2: expected one JSON object per step"),
    (json.dumps({k: v for k, v in _record(0).items() if k != "time_s"}) + "\n",
     r"metrics\.jsonl:1: missing field 'time_s'"),
    (json.dumps({**_record(0), "step": "zero"}) + "\n", r"field 'step' = 'zero' has the wrong type"),
    (json.dumps({**_record(0), "loss": "high"}) + "\n", r"field 'loss' must be a number or null"),
])
def test_missing_or_malformed_metrics_exit_2_with_one_line(tmp_path, capsys, content, match):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hgraph report: error: ")
    import re
    assert re.search(match, err), err


def test_bad_format_is_exit_2(full_run, capsys):
    assert main(["report", str(full_run), "--formats", "png,jpg"]) == 2
    assert "allowed are png, svg" in capsys.readouterr().err


def test_missing_matplotlib_is_a_clear_error(monkeypatch, full_run):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # import of it raises ImportError
    with pytest.raises(HGraphError, match=r"plots need matplotlib.*pip install -e '\.\[plots\]'"):
        plots.write_plots(plots.read_metrics(full_run / "metrics.jsonl"), full_run / "x")


def test_plots_module_imports_matplotlib_lazily():
    """No module-level import of matplotlib (nor of the report command): importing costs nothing."""
    import ast
    import inspect

    from hgraph.tools.cli import report as cmd_report
    for module in (plots, cmd_report):
        tree = ast.parse(inspect.getsource(module))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top for a in n.names] + [n.module or "" for n in top
                                                          if isinstance(n, ast.ImportFrom)]
        assert not any(name.startswith("matplotlib") for name in names), module.__name__


def test_summary_without_optional_fields():
    s = plots.summarize([_record(k, full=False) for k in range(3)])
    assert s.mean_balance is None and s.est_within_10pct is None and s.planner_wait_s is None
    assert s.distinct_strategies == 3 and math.isclose(s.mean_step_s, (0.1 + 0.11 + 0.12) / 3)
    assert s.cache_hit_rate is None
    # the trainer's running counters: 2 hits of 5 lookups at the last line
    counted = [{**_record(k, full=False), "cache_hits": k, "cache_misses": 3} for k in range(3)]
    assert plots.summarize(counted).cache_hit_rate == pytest.approx(2 / 5)


def test_summary_counts_the_skipped_non_finite_steps(tmp_path, capsys):
    records = [_record(k, full=False) for k in range(4)]
    records[1].update(skipped=True, loss=float("nan"))
    records[2].update(skipped=True)
    s = plots.summarize(records)
    assert s.skipped_steps == 2 and s.first_loss == 6.0 and s.as_dict()["skipped_steps"] == 2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from hgraph.tools.cli import main
    assert main(["report", str(tmp_path), "--formats", "svg"]) == 0
    assert "; 2 steps skipped (non-finite loss)" in capsys.readouterr().out
