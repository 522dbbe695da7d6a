"""The README's exit codes are the code's: its table lists 0, 1, 2, 130 and 143, and each comes from the
code path it names. End to end: 1 for a non-finite loss and for a run whose every step was skipped and 2
for bad input (``tests/tools/cli/test_train_cli.py``), 130 and 143 for SIGINT and SIGTERM
(``tests/tools/cli/test_process_lifetime.py``, ``test_exit_signal.py``)."""
import re
import signal
from pathlib import Path

import pytest

from hgraph.errors import HGraphError, RunFailed
from hgraph.runtime.train.exit_signal import EXIT_CODE
from hgraph.tools import cli

README = Path(__file__).resolve().parents[3] / "README.md"


def _readme_codes() -> dict[int, str]:
    block = README.read_text(encoding="utf-8").split("<!-- exit-codes -->", 1)[1].split("<!-- /exit-codes -->")[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", block, re.M)}


def test_the_readme_lists_every_code():
    codes = _readme_codes()
    assert sorted(codes) == [0, 1, 2, 128 + signal.SIGINT, EXIT_CODE] == [0, 1, 2, 130, 143]
    assert "non-finite loss" in codes[1] and "every step skipped" in codes[1] and "bad input" in codes[2]
    assert "SIGINT" in codes[130] and "SIGTERM" in codes[143]


@pytest.mark.parametrize("raised, code", [(None, 0), (RunFailed("step 3: the loss is nan"), 1),
                                          (HGraphError("--steps: must be >= 1"), 2)])
def test_main_maps_the_outcome_to_its_code(monkeypatch, capsys, raised, code):
    def run(_args):
        if raised is not None:
            raise raised
        return 0
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(_run=run)
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(_run=run)
    assert cli.main(["report", "x"]) == code == _expected(code)
    err = capsys.readouterr().err.strip()
    assert (err == "") if raised is None else (err == f"hgraph report: error: {raised}")


def _expected(code: int) -> int:
    assert code in _readme_codes()
    return code
