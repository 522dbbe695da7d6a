"""Choosing the frontend that turns a model into the canonical graph: torch.fx or torch.export.

``"auto"`` tries torch.fx first (fast, keeps Python-level ops) and falls back to torch.export
(Hugging Face models and others fx cannot trace). A model neither handles gets one line naming what
stopped each of them.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from hgraph.errors import HGraphError, TraceError
from hgraph.frontends.export_frontend import export_trace
from hgraph.frontends.fx_frontend import trace
from hgraph.frontends.tracer import LeafSpec
from hgraph.options import FRONTENDS

__all__ = ["FRONTENDS", "trace_model"]


def trace_model(model: nn.Module, *, leaf_modules: Iterable[LeafSpec] = (), frontend: str = "auto",
                dtype: Optional[torch.dtype] = None) -> tuple[fx.GraphModule, str]:
    """The canonical GraphModule of ``model`` and the frontend used (``"fx"`` or ``"export"``).

    ``leaf_modules`` apply to the fx frontend only (torch.export has no leaf modules). ``dtype``: the
    working precision; torch.export traces in it (it records dtypes, torch.fx keeps them symbolic).
    """

    if frontend not in FRONTENDS:
        raise HGraphError(f"unknown frontend {frontend!r}; allowed: {', '.join(FRONTENDS)}")
    if frontend == "fx":
        return trace(model, leaf_modules=leaf_modules), "fx"
    if frontend == "export":
        return export_trace(model, dtype=dtype), "export"
    try:
        return trace(model, leaf_modules=leaf_modules), "fx"
    except TraceError as fx_error:
        try:
            return export_trace(model, dtype=dtype), "export"
        except TraceError as export_error:
            raise TraceError(f"neither frontend handles {type(model).__name__}: {export_error} "
                             f"(torch.fx: {fx_error})") from export_error
