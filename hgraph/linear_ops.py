"""Linear ops of the canonical form besides ``F.linear``.

``in_out_linear(x, weight, bias)`` is a linear layer whose weight is stored ``[in, out]`` (GPT-2's
``Conv1D``; ``F.linear`` stores ``[out, in]``). Keeping the parameter in its own layout (instead of a
transposed copy) lets the graph share the model's parameter, and the passes shard it on the right
dimension: the output dim is dim 1 (COLUMN), the input dim is dim 0 (ROW).
"""
from __future__ import annotations

from typing import Optional

import torch


def in_out_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight + bias`` for a weight stored [in, out] (exactly what ``Conv1D`` computes)."""
    return torch.nn.functional.linear(x, weight.t(), bias)


# Linear ops whose weight is stored [in, out]: TP splits dim 1 for COLUMN and dim 0 for ROW.
IN_OUT_LINEARS = (in_out_linear,)
