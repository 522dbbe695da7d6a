"""The canonical form of causal attention, shared by the frontends' attention rewrites.

Attention becomes ``F.scaled_dot_product_attention(q, k, v, is_causal=True, ...)`` or, where its
scores are capped (``tanh(s / c) * c``) or windowed, ``ops.causal_attention`` with ``softcap`` /
``window``. A model's mask is evaluated on an example of positions 0..T-1 (``mask_evaluator`` in
``eager_attention``) and read here: causal, or causal within a sliding window of ``w`` keys. A
window only shows on an example longer than it, hence ``mask_example_length``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from hgraph import ops

NOT_CAUSAL = -1


def causal_window(allowed: torch.Tensor) -> Optional[int]:
    """What the boolean mask ``allowed`` (``[..., T, T]``, True = the query sees the key) is for
    positions 0..T-1: None for the causal mask, ``w`` for causal within a sliding window of ``w``
    keys (a query at ``i`` sees ``i - w + 1 .. i``; detectable when ``w < T``), ``NOT_CAUSAL`` else."""
    t = allowed.shape[-1]
    if allowed.dim() < 2 or allowed.shape[-2] != t or t == 0:
        return NOT_CAUSAL
    rows = allowed.reshape(-1, t, t)
    w = int(rows[0, t - 1].sum())
    i = torch.arange(t)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < w)
    if w == 0 or not bool((rows == band).all()):
        return NOT_CAUSAL
    return None if w == t else w


def causal_attention_node(graph: fx.Graph, q: fx.Node, k: fx.Node, v: fx.Node, kwargs: dict,
                          softcap: Optional[float], window: Optional[int]) -> fx.Node:
    """The canonical attention node: causal SDPA, or ``ops.causal_attention`` when the scores are
    capped or windowed (SDPA cannot say either). ``kwargs``: scale, enable_gqa, dropout_p."""
    if softcap is None and window is None:
        return graph.call_function(F.scaled_dot_product_attention, (q, k, v), {"is_causal": True, **kwargs})
    return graph.call_function(ops.causal_attention, (q, k, v), {**kwargs, "softcap": softcap, "window": window})


def mask_example_length(model: Any, least: int) -> int:
    """The example length masks are evaluated at: longer than the model's sliding window (a config's
    ``sliding_window``), which would otherwise look causal."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        return least                     # a window the config switches off (Qwen2, Qwen3)
    return max(least, int(window) + 1) if isinstance(window, int) and window > 0 else least
