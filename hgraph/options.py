"""Options of ``hgraph.compile``, passed explicitly to the passes (no global flags)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hgraph.errors import HGraphError

FRONTENDS = ("auto", "fx", "export")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class CompileOptions:
    """working_dtype: precision of the propagation phase (the Pull Parameter cast); None keeps fp32.
    disabled_passes: names of instantiation passes to skip (for debugging).
    leaf_modules: module classes the tracer must not trace into.
    frontend: "auto" (torch.fx, then torch.export when fx fails), "fx" or "export".
    dropout: apply the model's train-mode dropout (strategy-invariant masks); False makes it the identity.
    sequence_parallel: Megatron sequence parallelism under TP > 1 (activations between TP regions hold
    1/TP of the tokens). None (the default): on where the model allows it, off (with the reason in
    ``Program.sequence_parallel_note``) where it does not; True: required (a model that does not allow it
    is an error naming the op); False: off.
    """

    working_dtype: Optional[torch.dtype] = torch.float32
    disabled_passes: tuple[str, ...] = ()
    leaf_modules: tuple[type, ...] = ()
    frontend: str = "auto"
    dropout: bool = True
    sequence_parallel: Optional[bool] = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "CompileOptions":
        dtype = kwargs.pop("dtype", kwargs.pop("working_dtype", torch.float32))
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise HGraphError(f"unknown dtype {dtype!r}; allowed: {', '.join(sorted(_DTYPES))}")
            dtype = _DTYPES[dtype]
        disabled = tuple(kwargs.pop("disable_passes", ()))   # names checked by hgraph.compile
        leaves = tuple(kwargs.pop("leaf_modules", ()))
        frontend = kwargs.pop("frontend", "auto")
        dropout = kwargs.pop("dropout", True)
        sequence_parallel = kwargs.pop("sequence_parallel", None)
        if sequence_parallel not in (None, True, False):
            raise HGraphError(f"hgraph.compile option sequence_parallel must be True, False or None (auto), "
                              f"got {sequence_parallel!r}")
        if not isinstance(dropout, bool):
            raise HGraphError(f"hgraph.compile option dropout must be True or False, got {dropout!r}")
        if frontend not in FRONTENDS:
            raise HGraphError(f"unknown frontend {frontend!r}; allowed: {', '.join(FRONTENDS)}")
        if kwargs:
            raise HGraphError(f"unknown hgraph.compile option(s) {sorted(kwargs)}; allowed: dtype, "
                              "disable_passes, leaf_modules, frontend, dropout, sequence_parallel")
        return cls(dtype, disabled, leaves, frontend, dropout, sequence_parallel)
