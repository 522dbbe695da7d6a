"""The README's sample of the default run (``tools/report/readme_sample.py``): regenerated from a run's
printed lines, and shaped like them (the comparison with a real run's lines is in
``tests/runtime/train/test_train_planner.py``, on the short default run that test already makes)."""
from pathlib import Path

from hgraph.tools.report.readme_sample import (BEGIN, END, abridge, line_kind, line_shape, readme_sample, shapes,
                                               with_sample)

README = Path(__file__).resolve().parents[3] / "README.md"

STEP = ("step    {}  1xTP2PP1+2xTP1PP1            est   744.22 ms  measured   1858.0 ms  loss 6.260899      4381 "
        "tok/s  cache {}")


def test_the_readme_block_is_a_sample_of_the_default_run():
    lines = readme_sample(README.read_text(encoding="utf-8"))
    assert lines[0].startswith("hgraph train: llama:tiny on 4 CPU processes") and lines[-1].startswith("run dir: DIR")
    assert all(line == "..." or line_kind(line) is not None for line in lines), lines
    assert {"header", "planner setup", "planner", "step", "graph cache", "summary", "summary figures",
            "run dir"} <= set(shapes(lines))


def test_a_line_s_shape_is_its_kind_and_field_words():
    kind, words = line_shape(STEP.format(0, "miss"))
    assert kind == "step" and words == {"step", "est", "ms", "measured", "loss", "tok/s", "cache", "hit/miss"}
    assert line_shape(STEP.format(12, "hit")) == line_shape(STEP.format(0, "miss"))
    assert line_shape("run dir: /tmp/x/run (metrics.jsonl, 10 plot files)", "/tmp/x/run") == \
        line_shape("run dir: DIR (metrics.jsonl, 10 plot files)")
    # the planner's clauses on the best homogeneous strategy and a cap come and go: one shape
    planner = ("planner: 3 candidates (3 proposed + 0 proposed without the micro-batch charge + 0 of a wider "
               "proposal{}): 4xTP1PP1, 2xTP2PP1; cost model measured")
    assert line_shape(planner.format(" (the best homogeneous among them)")) == \
        line_shape(planner.format(" + the best homogeneous, at most 2")) == line_shape(planner.format(""))
    # a field added to the step line changes its shape
    assert line_shape(STEP.format(0, "hit") + "  MFU 3.1%")[1] != line_shape(STEP.format(0, "hit"))[1]


def test_abridged_and_written_between_the_markers():
    printed = ["hgraph train: llama:tiny on 4 CPU processes"] + [STEP.format(k, "hit") for k in range(10)] + \
        ["summary: 10 steps", "run dir: /tmp/r/run (metrics.jsonl, 10 plot files)"]
    short = abridge(printed, "/tmp/r/run")
    assert [line_kind(s) or s for s in short] == ["header", "step", "step", "step", "...", "step", "...", "step",
                                                  "summary", "run dir"]
    assert short[5] == STEP.format(5, "hit") and short[-1] == "run dir: DIR (metrics.jsonl, 10 plot files)"
    readme = f"intro\n{BEGIN}\n```\nold\n```\n{END}\nrest\n"
    again = with_sample(readme, short)
    assert readme_sample(again) == short and again.startswith("intro\n") and again.endswith(f"{END}\nrest\n")
