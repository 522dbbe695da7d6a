"""One command-line vocabulary: every subcommand that talks about a cluster takes ``--world-size``,
``--gpus-per-node`` and (where memory matters) ``--device-memory``; the old spellings still work with a
one-line note; help is plain text, with no reST markup and no module paths."""
import re

import pytest

from hgraph.tools.cli import SUBCOMMANDS, build_parser, main
from hgraph.tools.cli.length_options import workload_cost_model

WORKLOAD = ["--lengths", "L.txt", "--profile", "llama-7b", "--max-len", "4096"]
# the arguments each subcommand requires besides the common ones
REQUIRED = {
    "dump": [],
    "memory": ["--model", "tiny", "--strategy", "2xTP1PP1"],
    "plan": WORKLOAD + ["--tokens-per-iter", "9000"],
    "propose": WORKLOAD,
    "simulate": WORKLOAD + ["--tokens-per-iter", "9000", "--iters", "2"],
    "train": [],
    "profile": ["--model", "llama:tiny"],
    "check": ["--model", "llama:tiny", "--strategy", "2xTP1PP1"],
}
WITHOUT_DEVICE_MEMORY = {"dump", "check"}   # a graph dump or an order check has no memory limit to apply
WITHOUT_WORLD_SIZE = {"profile"}         # it times this machine's TP shards


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_every_cluster_subcommand_takes_the_common_flags(command):
    argv = [command, *REQUIRED[command]]
    if command not in WITHOUT_WORLD_SIZE:
        argv += ["--world-size", "8", "--gpus-per-node", "4"]
    if command not in WITHOUT_DEVICE_MEMORY:
        argv += ["--device-memory", "40G"]
    args = build_parser().parse_args(argv)
    if command not in WITHOUT_WORLD_SIZE:
        assert (args.world_size, args.gpus_per_node) == (8, 4)
    if command not in WITHOUT_DEVICE_MEMORY:
        assert args.device_memory == "40G"


def test_the_subcommands_without_a_cluster_are_the_ones_listed():
    assert set(SUBCOMMANDS) - set(REQUIRED) == {"pack", "export", "report", "prepare-data"}


@pytest.mark.parametrize("command", ["plan", "propose", "simulate"])
def test_old_gpus_still_sets_the_world_size_with_a_note(command, capsys):
    argv = [command, *REQUIRED[command], "--gpus", "16"]
    assert build_parser().parse_args(argv).world_size == 16
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hgraph {command}: note: --gpus is deprecated and will be removed in the next release; "
                   "use --world-size"]
    with pytest.raises(SystemExit):                     # one of the two spellings is required
        build_parser().parse_args([command, *REQUIRED[command]])


def test_old_gpu_memory_of_profile_is_gib_and_warns(capsys):
    args = build_parser().parse_args(["profile", "--model", "llama:tiny", "--gpu-memory", "40"])
    assert args.device_memory == "40.0G"
    assert "--gpu-memory is deprecated" in capsys.readouterr().err
    assert build_parser().parse_args(["profile", "--model", "llama:tiny"]).device_memory == "80G"


def test_device_memory_of_the_planner_commands_replaces_the_profiles_memory():
    parse = build_parser().parse_args
    default = workload_cost_model(parse(["propose", *WORKLOAD, "--world-size", "16"]))
    smaller = workload_cost_model(parse(["propose", *WORKLOAD, "--world-size", "16", "--device-memory", "40G"]))
    assert smaller.memory.gpu_memory_bytes == 40 * 2 ** 30 < default.memory.gpu_memory_bytes
    assert all(smaller.max_len(s) < default.max_len(s) for s in smaller.schemes)


def test_a_bad_device_memory_is_one_line(tmp_path, capsys):
    (tmp_path / "L.txt").write_text("100\n200\n")
    argv = ["propose", *WORKLOAD, "--world-size", "16", "--device-memory", "lots"]
    argv[argv.index("L.txt")] = str(tmp_path / "L.txt")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device-memory 'lots'" in err[0]


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_is_plain_text_for_users(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    markup = re.findall(r"``|:[a-z]+:`|hgraph\.(?:runtime|passes|tools|frontends)\b|\b\w+/\w+\.py\b|DESIGN\.md", out)
    assert not markup, markup
