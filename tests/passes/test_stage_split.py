import pytest

from hgraph.errors import StrategyError
from hgraph.passes.stage_split import split_stages, stage_of_blocks

BLOCKS = ["pre"] + [f"layers.{i}" for i in range(6)] + ["post"]


def test_balanced_contiguous_split_with_pre_and_post():
    costs = {f"layers.{i}": 10 for i in range(6)} | {"pre": 10, "post": 10}
    stages = split_stages(BLOCKS, costs, 2)
    assert stages == (("layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5"))
    # a heavy embedding pushes layers to the later stage
    costs["pre"] = 60
    stages = split_stages(BLOCKS, costs, 2)
    assert stages[0] == ("layers.0",) and len(stages[1]) == 5
    assert [b for s in stages for b in s] == BLOCKS[1:-1]


def test_split_minimises_the_largest_stage():
    costs = {"layers.0": 5, "layers.1": 1, "layers.2": 1, "layers.3": 1, "layers.4": 1, "layers.5": 5}
    stages = split_stages(BLOCKS, costs, 3)
    loads = [sum(costs[b] for b in s) for s in stages]
    assert max(loads) == 5 and all(stages)


def test_pp_larger_than_layers_is_an_error():
    with pytest.raises(StrategyError, match="PP=7 is larger than the model's 6 layers"):
        split_stages(BLOCKS, {}, 7)


def test_stage_of_blocks():
    m = stage_of_blocks((("layers.0",), ("layers.1",)))
    assert m == {"pre": 0, "post": 1, "layers.0": 0, "layers.1": 1}
