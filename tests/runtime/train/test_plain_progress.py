"""``PlainLines``: the progress of a front door that draws nothing (``hgraph.train``) is plain lines,
the ones ``hgraph train`` prints off a terminal (runtime/train/progress.py)."""
from hgraph.runtime.train.progress import PlainLines, PrintedLines, progress_bar


def test_a_plain_bar_prints_each_noted_update_and_a_quiet_one_only_its_lines(capsys):
    bar = progress_bar(PlainLines, 3, "planner setup", rank=0, plain=True)
    bar.update(1, "compute TP1")
    bar.update(1)                         # no note: nothing to say
    bar.write("a line")
    bar.update(5, "proposal")
    bar.close()
    quiet = progress_bar(PlainLines, 3, "training", rank=0)
    quiet.update(1, "step 0")
    assert type(progress_bar(PlainLines, 3, "x", rank=1, plain=True)) is PrintedLines      # other ranks
    assert capsys.readouterr().out.splitlines() == ["planner setup: compute TP1 (1/3)", "a line",
                                                    "planner setup: proposal (3/3)"]
