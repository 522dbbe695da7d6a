"""The README's ``--lengths FILE`` example runs from the checkout as written: the lengths file it names is
shipped (with ``#`` comment lines, which every ``--lengths`` reader skips)."""
import json
import re
import shlex
from pathlib import Path

from hgraph.runtime.data.lengths import read_lengths
from hgraph.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_the_readme_plan_example_runs(monkeypatch, capsys):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"`(hgraph plan --lengths runtime/data/\S+ [^`]+)`", text.replace("\n", " ")).group(1)
    argv = shlex.split(command)[1:]
    lengths = ROOT / argv[argv.index("--lengths") + 1]
    assert read_lengths(lengths).size == 20000
    monkeypatch.chdir(ROOT)
    argv[argv.index("--iters") + 1] = "1"               # one iteration is enough to show it runs
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["iterations"]) == 1 and plan["iterations"][0]["tokens"] <= 131072
