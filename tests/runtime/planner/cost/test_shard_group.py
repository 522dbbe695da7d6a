"""``--shard-group``: its values and what ``auto`` chooses (``planner/cost/shard_group``)."""
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.shard_group import STATE_BYTES, choose_shard_group, parse_shard_group, resolve_shard_group


@pytest.mark.parametrize("value, world, want", [("world", 64, 64), (None, 8, 8), ("8", 64, 8), (16, 64, 16),
                                                ("AUTO", 64, "auto"), (" 1 ", 4, 1)])
def test_values(value, world, want):
    assert parse_shard_group(value, world) == want


@pytest.mark.parametrize("value, match", [("3", "does not divide the world size 64"), ("0", "does not divide"),
                                          ("-8", "does not divide"), ("eight", "not a number"),
                                          (True, "not a number"), ("8.0", "not a number")])
def test_bad_values_are_one_line_naming_what_is_allowed(value, match):
    with pytest.raises(HGraphError, match=match) as info:
        parse_shard_group(value, 64)
    assert "allowed: an integer dividing the world size 64, world or auto" in str(info.value)
    assert "\n" not in str(info.value)


def test_auto_takes_the_smallest_node_multiple_whose_states_fit_half_the_budget():
    params = 70e9
    gib = 2 ** 30
    # 70B: 20 bytes a parameter; at 80 GiB a rank may hold 40 GiB of states: G * 40 GiB >= 1.4 TB
    g, why = choose_shard_group(1024, 8, params, 80 * gib)
    assert g == 64 and STATE_BYTES * params / 64 <= 40 * gib < STATE_BYTES * params / 32
    assert "fit" in why
    assert choose_shard_group(1024, 8, 1e9, 80 * gib)[0] == 8            # a small model: one node
    assert choose_shard_group(4, 8, 1e9, 1.0)[0] == 4                    # within a node: the world
    assert choose_shard_group(24, 8, 1e12, 80 * gib)[0] == 24            # nothing fits: the world
    assert choose_shard_group(48, 8, 1e9, None)[0] == 8                  # no budget: a node
    assert choose_shard_group(40, 8, 70e9, 80 * gib)[0] == 40            # multiples of 8 dividing 40: 8, 40
    assert resolve_shard_group("auto", 1024, 8, params, "auto")[0] == 8   # a budget not in bytes: unknown
    assert resolve_shard_group("16", 1024, 8, params, 80 * gib) == (16, "")
