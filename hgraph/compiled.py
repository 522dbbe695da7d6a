"""``hgraph.compile`` and the CompiledModule it returns.

Two forms, like ``torch.compile``: ``hgraph.compile(model, **options)`` on an instance, and
``@hgraph.compile`` / ``@hgraph.compile(**options)`` on an ``nn.Module`` subclass (each instance the
class creates is compiled).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from hgraph.errors import HGraphError
from hgraph.graph import HGraph
from hgraph.options import CompileOptions
from hgraph.program import ParamShard, Program
from hgraph.program_text import render_text
from hgraph.strategy import Cluster, Scheme, Strategy

#: The compiler modules this API imports when it first traces and instantiates (a process about to
#: compile, such as the forkserver of training ranks, may import them ahead).
COMPILER_MODULES = ("hgraph.frontends.select", "hgraph.passes.annotate", "hgraph.passes.insert_slots",
                    "hgraph.passes.extract_stage", "hgraph.passes.instantiate")


def build_hgraph(model: nn.Module, **options: Any) -> HGraph:
    """Trace ``model`` and turn it into an HGraph (trace -> annotate_pass -> insert_slots_pass).

    Options: ``leaf_modules`` (module classes or qualified names the fx tracer must not enter);
    ``frontend``: ``"auto"`` (torch.fx, then torch.export when fx fails), ``"fx"`` or ``"export"``;
    ``dtype``: the working precision the graph runs in (torch.export traces in it).
    The HGraph's ``frontend`` attribute says which one was used.
    """
    from hgraph.frontends.select import trace_model  # the API module wires the rooms, lazily
    from hgraph.passes.annotate import annotate_pass
    from hgraph.passes.insert_slots import insert_slots_pass

    unknown = sorted(set(options) - {"leaf_modules", "frontend", "working_dtype"})
    if unknown:
        raise HGraphError(f"unknown build_hgraph option(s) {unknown}; allowed: leaf_modules, frontend, "
                          "working_dtype")
    gm, used = trace_model(model, leaf_modules=options.get("leaf_modules", ()),
                           frontend=options.get("frontend", "auto"), dtype=options.get("working_dtype"))
    gm = annotate_pass(gm, None)
    gm = insert_slots_pass(gm, None)
    hg = HGraph(gm, model)
    hg.frontend = used
    return hg


class CompiledModule(nn.Module):
    """A module traced into an HGraph; runs ``forward`` like the original and instantiates programs.

    ``.hgraph``: the strategy-agnostic graph with empty slots; ``.frontend``: ``"fx"`` or ``"export"``.
    ``.instantiate(strategy, cluster)``: the per-rank Program, cached per (strategy, cluster) for
    interactive use and ``dump``; ``.build_program(strategy, cluster)``: a new Program on every call (a
    training run keeps the ones it uses in its own ``hgraph.runtime.engine.program_cache``);
    ``.param_shards(scheme)`` / ``.stage_blocks(pp)``: only the parameter shards a scheme's ranks
    hold and the layers of each stage (memory sizing).
    ``.dump(strategy, ...)``: text, runnable Python or JSON of the instantiated graphs (DOT, SVG, HTML with
    ``renderer=hgraph.tools.report.dump.render_program``);
    ``.sharding_report(strategy)``: what TP shards and why the rest is whole.
    """

    def __init__(self, model: nn.Module, options: CompileOptions):
        super().__init__()
        self._orig_mod = model
        self.options = options
        self._hgraph = build_hgraph(model, leaf_modules=options.leaf_modules, frontend=options.frontend,
                                   working_dtype=options.working_dtype)
        self._programs: dict[tuple[Strategy, Cluster], Program] = {}
        self._shapes: Optional[dict] = None
        self._layouts: Any = None           # passes.instantiate.ParamLayouts, made on first param_shards
        self.cache_hits = 0
        self.cache_misses = 0

    @property
    def hgraph(self):
        return self._hgraph

    @property
    def original(self) -> nn.Module:
        """The module that was compiled (a training run's is on the meta device)."""
        return self._orig_mod

    @property
    def frontend(self) -> str:
        """The frontend that traced the model: ``"fx"`` or ``"export"``."""
        return self._hgraph.frontend

    @property
    def config(self):
        return getattr(self._orig_mod, "config", None)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._hgraph.run(input_ids, position_ids)

    def symbolic_shapes(self) -> dict:
        if self._shapes is None:
            from hgraph.passes.extract_stage import symbolic_shapes
            self._shapes = symbolic_shapes(self._hgraph.gm)
        return self._shapes

    def instantiate(self, strategy: Union[Strategy, str], cluster: Optional[Cluster] = None, *,
                    world_size: Optional[int] = None, gpus_per_node: int = 8) -> Program:
        """The Program of ``strategy`` (parsed if a string); cached, so a repeat is a dict lookup."""
        strategy = Strategy.of(strategy)
        if cluster is None:
            cluster = Cluster(world_size or strategy.num_ranks, gpus_per_node)
        key = (strategy, cluster)
        prog = self._programs.get(key)
        if prog is not None:
            self.cache_hits += 1
            return prog
        self.cache_misses += 1
        prog = self._programs[key] = self.build_program(strategy, cluster)
        return prog

    def build_program(self, strategy: Union[Strategy, str], cluster: Cluster) -> Program:
        """A new Program of ``strategy`` on ``cluster``, whose ranks are built when asked
        (``Program.rank``); the role graphs are shared with this module's other Programs."""
        from hgraph.passes.instantiate import instantiate
        return instantiate(self._hgraph, Strategy.of(strategy), cluster, self.options, self.symbolic_shapes(),
                           self._param_layouts())

    def sequence_parallel_status(self) -> str:
        """What TP>1 strategies do about sequence parallelism: ``"on"``, ``"off (disabled)"`` or ``"off: "``
        and the reason the model refuses it (``hgraph.passes.sequence_parallel``)."""
        from hgraph.passes.sequence_parallel import SequenceParallelRefused, model_sequence_parallel
        if self.options.sequence_parallel is False:
            return "off (disabled)"
        outcome = model_sequence_parallel(self._hgraph, self.symbolic_shapes())
        if isinstance(outcome, SequenceParallelRefused):
            if self.options.sequence_parallel:
                raise outcome
            return f"off: {outcome}"
        return "on"

    def sharding_report(self, strategy: Union[Strategy, str]):
        """Per TP degree of ``strategy``: each block parameter's placement, why replicated ones are
        whole, and the fraction of bytes sharded (``hgraph.passes.sharding_report.ShardingReport``)."""
        from hgraph.passes.sharding_report import sharding_report
        return sharding_report(self._hgraph, self.symbolic_shapes(), Strategy.of(strategy))

    def param_shards(self, scheme: Union[Scheme, str]) -> dict[tuple[int, int], dict[str, ParamShard]]:
        """The parameter shards of every rank of one ``scheme`` pipeline, keyed ``(stage, tp_rank)``
        (a CP rank holds its TP rank's; under EP, EP rank 0's experts: each EP rank holds as many): what a Program gives those ranks (``RankProgram.params``),
        without graphs or LNK plans, so sizing a strategy's working tensors costs milliseconds at any
        model and world size. A TP degree the model does not allow is a ``StrategyError``."""
        from hgraph.passes.instantiate import validate_scheme_for_model
        scheme = Scheme.parse(scheme) if isinstance(scheme, str) else scheme
        validate_scheme_for_model(scheme, self._hgraph)
        layouts = self._param_layouts()
        return {(stage, t): dict(layouts.params(scheme, stage, t)) for stage in range(scheme.pp)
                for t in range(scheme.tp)}

    def stage_blocks(self, pp: int) -> tuple[tuple[str, ...], ...]:
        """The repeated blocks (layers) of each stage of a ``pp``-stage pipeline, as Programs split it."""
        return self._param_layouts().stage_blocks(pp)

    def _param_layouts(self) -> Any:
        from hgraph.passes.instantiate import ParamLayouts
        if self._layouts is None:
            self._layouts = ParamLayouts(self._hgraph, self.symbolic_shapes())
        return self._layouts

    def dump(self, strategy: Union[Strategy, str], *, world_size: Optional[int] = None, gpus_per_node: int = 8,
             rank: Optional[int] = None, format: str = "text", path: Optional[str] = None,
             model: Optional[str] = None, cluster: Optional[Cluster] = None,
             renderer: Optional[Callable[[Program, str, Optional[int], str], str]] = None) -> str:
        """Render the instantiated programs (all ranks, or one) in ``format``; write to ``path`` if given.
        ``model`` names the model in graph titles (default: its class name); ``cluster`` (instead of
        ``world_size`` and ``gpus_per_node``): its optimizer shard group sets the Pull / Push plans.
        ``renderer(program, format, rank, model)``: default the IR's own text forms (text, python, json:
        ``hgraph.program_text``); the drawn graphs (dot, svg, html) take
        ``hgraph.tools.report.dump.render_program``, which the IR does not import."""
        prog = self.instantiate(strategy, cluster, world_size=world_size, gpus_per_node=gpus_per_node)
        text = (renderer or render_text)(prog, format, rank, model or type(self._orig_mod).__name__)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text


def compile(model: Any = None, **options: Any) -> Any:  # noqa: A001 - mirrors torch.compile
    """Compile an nn.Module instance, or decorate an nn.Module subclass (with or without options)."""
    opts = CompileOptions.from_kwargs(**options)
    _check_disabled_passes(opts.disabled_passes)

    def apply(target: Any) -> Any:
        if isinstance(target, nn.Module):
            return CompiledModule(target, opts)
        if isinstance(target, type) and issubclass(target, nn.Module):
            @functools.wraps(target, updated=())
            def make(*args: Any, **kwargs: Any) -> CompiledModule:
                return CompiledModule(target(*args, **kwargs), opts)
            make.__wrapped_class__ = target
            return make
        raise HGraphError(f"hgraph.compile expects an nn.Module instance or subclass, got {type(target).__name__}")

    return apply if model is None else apply(model)


def _check_disabled_passes(disabled: tuple[str, ...]) -> None:
    from hgraph.passes.pipeline import instantiation_passes
    known = [p.name for p in instantiation_passes()]
    unknown = sorted(set(disabled) - set(known))
    if unknown:
        raise HGraphError(f"cannot disable unknown pass(es) {unknown}; instantiation passes are {known}")
