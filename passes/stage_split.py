"""Stage split: contiguous blocks per pipeline stage, balanced by parameter count.

The embedding (block ``"pre"``) always lives in the first stage and the final norm / head
(``"post"``) in the last; the repeated blocks are cut into ``pp`` contiguous runs minimising the
largest stage's parameter count (an exact linear-partition dynamic program; ties prefer earlier cuts).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

import torch.fx as fx

from hgraph.errors import StrategyError
from hgraph.meta import SlotKind, get_meta

PRE, POST = "pre", "post"


def block_param_costs(gm: fx.GraphModule, param_numel: Mapping[str, int]) -> dict[str, int]:
    """Parameter elements used by each block (a tied parameter counts in every block that uses it)."""
    cost: dict[str, int] = {}
    for node in gm.graph.nodes:
        m = get_meta(node)
        if m.slot != SlotKind.PULL_PARAMETER or m.param is None:
            continue
        for user in node.users:
            block = get_meta(user).block
            if block is not None:
                cost[block] = cost.get(block, 0) + param_numel[m.param]
    return cost


def split_stages(blocks: Sequence[str], costs: Mapping[str, int], pp: int) -> tuple[tuple[str, ...], ...]:
    """The repeated blocks of each of ``pp`` stages (``pre``/``post`` are implied in the first/last)."""
    layers = [b for b in blocks if b not in (PRE, POST)]
    if pp > len(layers):
        raise StrategyError(f"PP={pp} is larger than the model's {len(layers)} layers; "
                            f"PP must be between 1 and {len(layers)}")
    w = [costs.get(b, 0) for b in layers]
    pre, post = costs.get(PRE, 0), costs.get(POST, 0)
    n = len(layers)
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)

    def seg(i: int, j: int, s: int) -> int:  # cost of stage s holding layers[i:j]
        return prefix[j] - prefix[i] + (pre if s == 0 else 0) + (post if s == pp - 1 else 0)

    @lru_cache(maxsize=None)
    def best(i: int, s: int) -> tuple[int, tuple[int, ...]]:
        """Min over splits of layers[i:] into stages s..pp-1 of the max stage cost, and the cuts."""
        if s == pp - 1:
            return seg(i, n, s), ()
        result: tuple[int, tuple[int, ...]] | None = None
        for j in range(i + 1, n - (pp - 1 - s) + 1):
            rest, cuts = best(j, s + 1)
            value = max(seg(i, j, s), rest)
            if result is None or value < result[0]:
                result = (value, (j,) + cuts)
        assert result is not None
        return result

    _, cuts = best(0, 0)
    bounds = (0,) + cuts + (n,)
    return tuple(tuple(layers[bounds[s]:bounds[s + 1]]) for s in range(pp))


def stage_of_blocks(stage_blocks: Sequence[Sequence[str]]) -> dict[str, int]:
    """Map every block name, including ``pre`` and ``post``, to its stage."""
    out = {PRE: 0, POST: len(stage_blocks) - 1}
    for s, blocks in enumerate(stage_blocks):
        for b in blocks:
            out[b] = s
    return out
