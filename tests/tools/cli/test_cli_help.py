"""Every ``hgraph`` subcommand answers ``--help`` with its usage and exit code 0."""
import re

import pytest

from hgraph.tools.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_of_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hgraph {command}") and len(out.splitlines()) > 3


def test_version_names_hgraph_and_torch(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(r"hgraph \d+\.\d+\.\d+ \(torch .+\)", out), out
