"""Every subcommand that prints results takes ``--json`` (the README says so): ``dump`` too, where it is
the same as ``--format json``."""
import json

from hgraph.tools import cli


def test_every_subcommand_takes_json():
    parser = cli.build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    assert set(subcommands) == set(cli.SUBCOMMANDS)
    lacking = [name for name, p in subcommands.items()
               if not any("--json" in a.option_strings for a in p._actions)]
    assert lacking == []


def test_dump_json_is_the_json_format(capsys):
    argv = ["dump", "llama:tiny", "--strategy", "2xTP1PP1", "--rank", "1"]
    assert cli.main(argv + ["--json"]) == 0
    with_flag = json.loads(capsys.readouterr().out)
    assert cli.main(argv + ["--format", "json"]) == 0
    assert with_flag == json.loads(capsys.readouterr().out) and with_flag["strategy"] == "2xTP1PP1"
    assert cli.main(argv + ["--json", "--format", "dot"]) == 2
    assert capsys.readouterr().err.strip() == "hgraph dump: error: --json prints the json format; it excludes --format dot"
