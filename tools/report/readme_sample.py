"""The README's sample of what the default run prints, regenerated from a real run, and the shape of a
printed line that a test compares with a real run's, so that the sample cannot go stale silently.

``python -m hgraph.tools.report.readme_sample [--readme README.md]`` runs the default ``hgraph train
--progress off --run-dir DIR`` (a few minutes on 2 CPU cores), keeps every line it prints with the step
lines abridged (the first three, one from the middle, the last, ``...`` between), writes ``DIR`` for
the run folder and puts them between the README's ``<!-- default-run-output -->`` markers. With
``--lines FILE`` it takes the printed lines of such a run from a file instead of running one.

``line_shape(line)``: the line's kind (``step``, ``summary``, ``planner``, ...) and its field words,
every number, strategy, scheme, path and count left out; ``sample_shapes`` and a real run's lines then
compare kind by kind (``tests/tools/report/test_readme_sample.py``).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

BEGIN, END = "<!-- default-run-output -->", "<!-- /default-run-output -->"

# (kind, how the line starts): the lines the default run prints, in the order they come
KINDS = (
    ("header", r"hgraph train: \S+ on "),
    ("planner setup", r"planner setup: "),
    ("planner", r"planner: "),
    ("step", r"step +\d+ "),
    ("dropout", r"dropout: "),
    ("sequence parallelism", r"sequence parallelism: "),
    ("optimizer states", r"optimizer states: "),
    ("graph cache", r"graph cache: "),
    ("summary", r"summary: "),
    ("summary figures", r" +loss "),
    ("run dir", r"run dir: "),
)
_STRATEGY = re.compile(r"\b(\d+x)?(TP\d+PP\d+(CP\d+)?(UL\d+)?)(\+\d+x(TP\d+PP\d+(CP\d+)?(UL\d+)?))*\b")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?([eE][-+]?\d+)?")
# words that differ from step to step, not between formats: a cache hit or miss (or a Program built
# ahead of its step, which the step line says instead: "built ahead")
_SAME = {"hit": "hit/miss", "miss": "hit/miss"}
_BUILT_AHEAD = re.compile(r"\bbuilt ahead\b")
# clauses that come and go from run to run (``auto_candidates.auto_candidates``' source): whether and where the
# best homogeneous strategy joins the candidates, and a --max-candidates cap
_ALTERNATIVES = ((re.compile(r" \(the best homogeneous among them\)| \+ the best homogeneous"), ""),
                 (re.compile(r", at most \d+"), ""))


def line_kind(line: str) -> Optional[str]:
    """The kind of a printed line (None: not one of the default run's)."""
    return next((kind for kind, start in KINDS if re.match(start, line)), None)


def line_shape(line: str, run_dir: Optional[str] = None) -> tuple[Optional[str], frozenset]:
    """``(kind, field words)`` of a printed line: its words without numbers, strategies, schemes and
    the run folder (``run_dir``; the README writes it ``DIR``)."""
    text = _BUILT_AHEAD.sub("cache hit", line.replace(run_dir or "DIR", " "))
    for pattern, same in _ALTERNATIVES:
        text = pattern.sub(same, text)
    text = _NUMBER.sub(" ", _STRATEGY.sub(" ", text))
    words = re.findall(r"[A-Za-z][A-Za-z_/'-]*[A-Za-z]|[A-Za-z]", text)
    return line_kind(line), frozenset(_SAME.get(w, w) for w in words)


def shapes(lines: Iterable[str], run_dir: Optional[str] = None) -> dict[str, frozenset]:
    """Field words per kind over ``lines`` (lines of no kind, ``...`` and notes, are left out)."""
    out: dict[str, set] = {}
    for line in lines:
        kind, words = line_shape(line, run_dir)
        if kind is not None:
            out.setdefault(kind, set()).update(words)
    return {k: frozenset(v) for k, v in out.items()}


def readme_sample(readme: str) -> list[str]:
    """The sample lines between the README's markers (inside its code fence)."""
    try:
        block = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    except IndexError:
        raise ValueError(f"the README has no {BEGIN} ... {END} block") from None
    return [line for line in block.strip().strip("`").strip("\n").splitlines() if line.strip()]


def abridge(lines: Sequence[str], run_dir: str) -> list[str]:
    """The printed lines for the README: the step lines cut to the first three, one from the middle
    and the last, ``...`` between; the run folder written ``DIR``."""
    steps = [i for i, line in enumerate(lines) if line_kind(line) == "step"]
    keep = set(steps[:3] + steps[len(steps) // 2:len(steps) // 2 + 1] + steps[-1:])
    out: list[str] = []
    for i, line in enumerate(lines):
        if i in steps and i not in keep:
            if out and out[-1] != "...":
                out.append("...")
            continue
        out.append(line.replace(run_dir, "DIR").rstrip())
    return out


def with_sample(readme: str, lines: Sequence[str]) -> str:
    """``readme`` with the block between the markers replaced by ``lines`` in a code fence."""
    head, rest = readme.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return head + BEGIN + "\n```\n" + "\n".join(lines) + "\n```\n" + END + tail


def run_default(run_dir: Path) -> list[str]:
    """The lines the default run prints (stdout), run in a subprocess as a user runs it."""
    cmd = [sys.executable, "-m", "hgraph.tools.cli", "train", "--progress", "off", "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return done.stdout.splitlines()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.report.readme_sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", default="README.md", help="the README to update (default README.md)")
    p.add_argument("--lines", default=None, metavar="FILE", help="a default run's printed lines, instead of a run")
    p.add_argument("--run-dir", default=None, metavar="DIR", help="the run folder those lines name")
    args = p.parse_args(argv)
    if args.lines is not None:
        lines, run_dir = Path(args.lines).read_text().splitlines(), args.run_dir or "DIR"
    else:
        with tempfile.TemporaryDirectory(prefix="hgraph-readme-") as tmp:
            run_dir = str(Path(tmp) / "run")
            lines = run_default(Path(run_dir))
    path = Path(args.readme)
    sample = abridge(lines, run_dir)
    path.write_text(with_sample(path.read_text(encoding="utf-8"), sample), encoding="utf-8")
    print("\n".join(sample))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
