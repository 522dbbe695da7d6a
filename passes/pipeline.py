"""The pass runner and the ordered pass lists.

A pass is a module-level function ``name_pass(gm, ctx) -> GraphModule``; ``ctx`` is the role's
``PassContext`` (``passes/context``) for the instantiation passes, ``None`` for the frontend ones.
``frontend_passes()`` and ``instantiation_passes()`` are the only places that decide the order.
``run_passes`` logs the numbered list, can disable passes by name, checks that each pass returns a
GraphModule, lints the graph after each, and on an internal failure names the pass and the ones that
ran before it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch.fx as fx

from hgraph import dims
from hgraph.errors import HGraphError
from hgraph.passes.annotate import annotate_pass
from hgraph.passes.context import PassContext
from hgraph.passes.dropout import dropout_pass
from hgraph.passes.moe_ep import moe_ep_pass
from hgraph.passes.moe_router import moe_router_pass
from hgraph.passes.extract_stage import extract_stage_pass
from hgraph.passes.fill_activation_comm import fill_activation_comm_pass
from hgraph.passes.fill_param_slots import fill_param_slots_pass
from hgraph.passes.insert_slots import insert_slots_pass
from hgraph.passes.output_head import output_head_pass
from hgraph.passes.packed_attention import packed_attention_pass
from hgraph.passes.schedule_comm import schedule_comm_pass
from hgraph.passes.sequence_parallel import sequence_parallel_pass
from hgraph.passes.shard_tp import shard_tp_pass

log = logging.getLogger("hgraph.passes")

PassFn = Callable[[fx.GraphModule, Optional[PassContext]], fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    name: str
    fn: PassFn


class PassError(RuntimeError):
    """An internal failure inside a compiler pass (a bug, not bad input)."""


def frontend_passes() -> list[Pass]:
    """Strategy-agnostic passes turning a canonical traced graph into an HGraph with empty slots."""
    return [Pass("annotate", annotate_pass), Pass("insert_slots", insert_slots_pass)]


def instantiation_passes() -> list[Pass]:
    """Per-rank-role passes turning a copy of the HGraph into one rank's program for a strategy."""
    return [
        Pass("extract_stage", extract_stage_pass),
        # EP's pass (a built-in dimension's): before TP sharding, so the other EP ranks' experts, which this
        # role does not hold, are out of the graph by then
        Pass("moe_ep", moe_ep_pass),
        Pass("shard_tp", shard_tp_pass),
        # a registered dimension's own passes (hgraph.dims.Dim.passes), while the slots are still empty
        *(Pass(fn.__name__.removesuffix("_pass"), fn) for d in dims.DIMENSIONS for fn in d.passes),
        Pass("fill_activation_comm", fill_activation_comm_pass),
        Pass("sequence_parallel", sequence_parallel_pass),
        Pass("output_head", output_head_pass),
        Pass("packed_attention", packed_attention_pass),
        Pass("dropout", dropout_pass),
        Pass("moe_router", moe_router_pass),
        Pass("fill_param_slots", fill_param_slots_pass),
        Pass("schedule_comm", schedule_comm_pass),
    ]


def run_passes(gm: fx.GraphModule, ctx: Optional[PassContext], passes: Sequence[Pass], *,
               disabled: Iterable[str] = ()) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``, linting after each; a failure names the pass and those before it."""
    disabled = set(disabled)
    unknown = disabled - {p.name for p in passes}
    if unknown:
        raise HGraphError(f"cannot disable unknown pass(es) {sorted(unknown)}; passes are "
                          f"{[p.name for p in passes]}")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("passes: %s", ", ".join(f"{i + 1}.{p.name}" + (" (disabled)" if p.name in disabled else "")
                                          for i, p in enumerate(passes)))
    done: list[str] = []
    for i, p in enumerate(passes):
        if p.name in disabled:
            continue
        try:
            out = p.fn(gm, ctx)
            if not isinstance(out, fx.GraphModule):
                raise PassError(f"returned {type(out).__name__}, not a GraphModule")
            out.graph.lint()
        except HGraphError:
            raise
        except Exception as exc:
            before = ", ".join(done) or "none"
            raise PassError(f"pass {i + 1} '{p.name}' failed (passes run before it: {before}): "
                            f"{type(exc).__name__}: {exc}") from exc
        gm = out
        done.append(p.name)
    return gm
