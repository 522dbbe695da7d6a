"""The empty slot: a placeholder node that a strategy may later fill with a subgraph.

An empty slot is the identity, so an HGraph with empty slots computes exactly what the original
module computes. What kind of slot a node is lives in its NodeMeta (``slot``, ``comm_point``,
``param``); instantiation replaces the node with the subgraph of one strategy.
"""
from __future__ import annotations

import torch


def empty_slot(x: torch.Tensor) -> torch.Tensor:
    """Identity placeholder for a pull_parameter, push_gradient or comm_activation slot."""
    return x
