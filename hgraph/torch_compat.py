"""The torch versions hgraph runs on: the floor, and the one place that calls version-specific APIs.

``pyproject.toml`` asks for ``torch >= TORCH_FLOOR``. Two features set that floor, both torch 2.6:
``torch.compiler.set_stance`` (recomputed blocks run their compiled regions eagerly) and
``torch.export.Dim.DYNAMIC`` (the export frontend's dynamic batch and length). ``FLOOR_KEYWORDS``
lists the keywords hgraph passes to torch functions that exist in the floor version;
``tests/hgraph/test_torch_compat.py`` checks the installed torch against it and that the project
passes no other keyword to those functions.

What moved or appeared after the floor is asked for here, by attribute or signature, never by version
name:

* the recompile limit of dynamo: ``torch._dynamo.config.recompile_limit`` (2.7; ``cache_size_limit``
  before). ``torch.compile(..., recompile_limit=)`` is newer still (absent in 2.11), so it is not used;
* PyTorch's varlen attention kernel (``torch.nn.attention.varlen``, 2.10), whose keywords changed
  between releases (2.11: ``is_causal``, no GQA; 2.13: ``window_size`` and ``enable_gqa``);
* the single-tensor all-gather and reduce-scatter: ``all_gather_single`` / ``reduce_scatter_single``
  where this torch has them (the ``*_into_tensor`` / ``*_tensor`` names are deprecated there), the
  older names otherwise.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
from typing import Iterator, Optional

import torch
import torch.distributed as dist

TORCH_FLOOR = (2, 6)

# function -> keywords hgraph passes to it, all present in torch 2.6
FLOOR_KEYWORDS: dict[str, frozenset[str]] = {
    "torch.compile": frozenset({"backend", "dynamic", "fullgraph", "mode", "options", "disable"}),
    "torch.compiler.set_stance": frozenset({"stance"}),
    "torch.export.export": frozenset({"dynamic_shapes", "strict", "kwargs"}),
    "torch.load": frozenset({"map_location", "weights_only", "mmap"}),
    "torch.utils.checkpoint.checkpoint": frozenset({"use_reentrant", "context_fn"}),
    "torch.random.fork_rng": frozenset({"devices"}),
    # member-only group creation (runtime/comm/process_groups; the keyword is torch 2.1's)
    "torch.distributed.new_group": frozenset({"use_local_synchronization", "backend"}),
}
# attributes hgraph reads that appeared late (all present in torch 2.6)
FLOOR_ATTRIBUTES = ("torch.export.Dim.DYNAMIC", "torch.compiler.set_stance", "torch.compiler.list_backends",
                    "torch._foreach_copy_", "torch._fused_adam_", "torch._fused_adamw_",
                    # the MoE op's exported form (hgraph.moe); torch._grouped_mm is asked for by hasattr
                    "torch.compiler.is_exporting", "torch.library.custom_op")


def resolve(path: str) -> object:
    """The object a dotted ``torch...`` path names (AttributeError / ImportError when absent)."""
    parts = path.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))   # a submodule not imported yet
    return obj


def _recompile_limit_name() -> str:
    import torch._dynamo     # heavy (half of torch's own import time): only when compiling
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


@contextlib.contextmanager
def limit_recompiles(limit: int) -> Iterator[None]:
    """Dynamo recompiles a function at most ``limit`` times while this is entered (then runs it
    eagerly and warns). Scoped, so other compiled code of the process keeps its own limit."""
    name = _recompile_limit_name()
    with torch._dynamo.config.patch(**{name: limit}):
        yield


all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def has_torch_varlen() -> bool:
    """Whether this torch has PyTorch's varlen attention kernel."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def torch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                           scale: Optional[float]) -> torch.Tensor:
    """PyTorch's varlen kernel, causal, on packed ``[T, H, D]`` (``k``/``v`` may have fewer heads)."""
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)          # causal: no key after the query
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:                                    # query head h reads key/value head h // group
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
