"""``torch.compile`` of a rank's graph, region by region (``hgraph train --compile``).

A rank's graph interleaves compute (linears, norms, activations, rotary embeddings, residuals) with
ops that talk to the runtime: every op that takes the communication context ``comm`` (Pull
Parameter, Push Gradient, the TP and CP collectives, pipeline sends and receives, keyed dropout, the
output head) and the ops marked ``ops.reads_host_values`` (packed attention finds its documents from
the positions in Python). ``compile_regions`` keeps those ops eager, in the graph's order, and hands
every maximal run of compute between them to ``torch.compile``: the collectives keep their issue /
wait order (the schedule is the node order), and inductor fuses what lies between them. A Pull
Parameter chain (it depends on a parameter alone) moves to the front of the run that uses it, so the
pulls placed before each linear do not cut the runs. A region's parameters are its inputs, so runs
alike in structure (every layer's run between two attentions) are one compiled function: a 32-layer
stage compiles a handful of regions, not 64.

Why regions and not one graph per stage: the runtime ops carry Python-side state (LNK plans, bucketed
reductions armed from backward hooks, the micro-batch's CP layout and dropout keys), which registered
custom ops and functional collectives would have to re-express one by one; cutting at them keeps the
communication exactly as eager runs it, at the price of inductor not moving collectives across
compute (the comm stream overlaps them on a GPU instead).

The token dimension changes with every packed micro-batch: regions compile with ``dynamic=True``, so
a stage compiles each region once for any packed length (once more in evaluation, under no_grad; a
size of 1 is specialised by dynamo), and dynamo's recompile limit, set per call through
``hgraph.torch_compat`` (its name and place changed between torch releases), bounds the rest.
``RegionCompiles`` counts the compilations per region, which the executor reports.

With ``on`` a region that does not compile raises naming its first ops; with ``auto`` it runs eagerly
from then on (one warning) and the rest stays compiled.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx

from hgraph.errors import HGraphError
from hgraph.ops import READS_HOST_VALUES
from hgraph.runtime.process.run_log import run_log
from hgraph.runtime.engine.subgraphs import comm_placeholder, extract_subgraph
from hgraph.torch_compat import limit_recompiles

log = run_log(__name__)

COMPILE_MODES = ("auto", "on", "off")
REGION_PREFIX = "hgraph_region_"
RECOMPILE_LIMIT = 8          # per region: past it dynamo runs the region eagerly (and warns)


def compile_wanted(mode: str, device: torch.device) -> bool:
    """Whether ``--compile mode`` compiles on ``device``: ``auto`` compiles on CUDA (on CPU inductor's
    compile time, tens of seconds on a few cores, outweighs what it saves on short runs)."""
    if mode not in COMPILE_MODES:
        raise HGraphError(f"--compile {mode!r}: expected one of {', '.join(COMPILE_MODES)}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def check_backend(name: str) -> None:
    """A one-line error for a ``torch.compile`` backend name torch does not know."""
    try:
        torch._dynamo.lookup_backend(name)
    except Exception as exc:     # dynamo raises InvalidBackend; a plugin's import may raise anything
        known = ", ".join(sorted({*torch.compiler.list_backends(), "aot_eager", "eager"}))
        raise HGraphError(f"--compile-backend {name!r}: not a torch.compile backend ({known})") from exc


@dataclass
class RegionCompiles:
    """How often each compiled region of a rank was compiled (dynamo graphs handed to the backend,
    forward; AOTAutograd compiles its backward with it) and which fell back to eager."""

    counts: dict[str, int] = field(default_factory=dict)
    eager: list[str] = field(default_factory=list)
    shared: dict[tuple, "CompiledRegion"] = field(default_factory=dict, repr=False)   # by ``_structure``

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class CompiledRegion(torch.nn.Module):
    """One run of compute of a rank's graph (an ``fx.GraphModule``) behind ``torch.compile``."""

    def __init__(self, name: str, body: fx.GraphModule, backend: str, strict: bool,
                 compiles: RegionCompiles) -> None:
        super().__init__()
        self.name, self.body, self.strict, self.compiles = name, body, strict, compiles
        compiles.counts[name] = 0
        inner = torch._dynamo.lookup_backend(backend)

        def counting(gm: fx.GraphModule, example_inputs: list) -> Callable:
            compiles.counts[name] += 1
            return inner(gm, example_inputs)

        # one graph per region: a break would mean a non-compute op slipped in (a bug in ``_is_eager``)
        self._compiled = torch.compile(body, backend=counting, dynamic=True, fullgraph=True)
        self._failed = False

    def forward(self, *args: Any) -> Any:
        # dynamo guards on strides: an eager op's output layout may vary with its input (packed
        # attention's one-document SDPA vs its per-document loop), so regions take contiguous inputs
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        if self._failed:
            return self.body(*args)
        try:
            with limit_recompiles(RECOMPILE_LIMIT):
                return self._compiled(*args)
        except Exception as exc:     # dynamo / inductor failures have many types: eager tells them apart
            out = self.body(*args)   # a region is pure compute: an error here is the op's own, raised
            first = ", ".join(n.name for n in self.body.graph.nodes if n.op == "call_function")[:160]
            if self.strict:
                raise HGraphError(f"--compile on: region {self.name} ({first}) does not compile: "
                                  f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}") from exc
            warnings.warn(f"region {self.name} ({first}) runs eagerly: it did not compile "
                          f"({type(exc).__name__})", stacklevel=2)
            self._failed = True
            self.compiles.eager.append(self.name)
            return out


def _is_eager(n: fx.Node, comm: Optional[fx.Node], eager: set) -> bool:
    """An op that talks to the runtime, reads tensor values on the host, or unpacks what one returned."""
    if n.op == "call_function" and getattr(n.target, READS_HOST_VALUES, False):
        return True
    if comm is not None and comm in n.all_input_nodes:
        return True
    if n.op == "get_attr":
        return False
    # a graph-module block (recompute's outlined layers) is called through ops that take comm: above
    return n.target in (operator.getitem, getattr) and n.all_input_nodes[0] in eager


def _runs(graph: fx.Graph, comm: Optional[fx.Node]) -> list[tuple[str, list[fx.Node]]]:
    """The graph as steps in execution order: ``("node", [n])`` run in the outer graph, ``("region",
    nodes)`` a run of compute. Pull chains (eager ops fed by placeholders, parameters and each other
    alone) inside a run move before its compute."""
    eager: set[fx.Node] = set()
    free: set[fx.Node] = set()
    steps: list[tuple[str, list[fx.Node]]] = []
    run: list[fx.Node] = []

    def flush() -> None:
        steps.extend(("node", [n]) for n in run if n in free)
        compute = [n for n in run if n not in free]
        if compute:
            steps.append(("region", compute))
        run.clear()

    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            steps.append(("node", [n]))
            continue
        if n.op == "output":
            flush()
            steps.append(("node", [n]))
            continue
        if _is_eager(n, comm, eager):
            eager.add(n)
            if all(a.op in ("placeholder", "get_attr") or a in free for a in n.all_input_nodes):
                free.add(n)
                run.append(n)
                continue
            flush()
            steps.append(("node", [n]))
        else:
            run.append(n)
    return steps


def _structure(body: fx.Graph) -> tuple:
    """What a region computes, whatever its nodes are named: ops, targets and constants in order, the
    values by position. Parameters are inputs, so two runs alike (the layers') are the same function."""
    index = {n: i for i, n in enumerate(body.nodes)}

    def norm(a: fx.node.Argument) -> str:
        return repr(fx.node.map_arg(a, lambda n: f"%{index[n]}"))

    return tuple((n.op, None if n.op == "placeholder" else repr(n.target), norm(n.args), norm(n.kwargs))
                 for n in body.nodes)


def compile_regions(gm: fx.GraphModule, backend: str = "inductor", strict: bool = False,
                    compiles: Optional[RegionCompiles] = None) -> tuple[fx.GraphModule, RegionCompiles]:
    """A new GraphModule computing what ``gm`` computes, its compute runs behind ``torch.compile``.

    ``gm``'s parameters are shared (the same objects), as are its submodules; a submodule that is
    itself a graph (recompute's outlined blocks) has its regions compiled too. ``backend``: a
    ``torch.compile`` backend name (``inductor``; ``aot_eager`` traces and differentiates without
    generating code); ``strict``: raise where a region does not compile (``--compile on``).
    """
    compiles = compiles if compiles is not None else RegionCompiles()
    graph = gm.graph
    comm = comm_placeholder(graph)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    owner: dict[str, Union[torch.nn.Module, torch.Tensor]] = {}
    for kind, nodes in _runs(graph, comm):
        if kind == "node":
            env[nodes[0]] = new.node_copy(nodes[0], lambda x: env[x])
            continue
        body, inputs, outputs = extract_subgraph(nodes)
        key = _structure(body)
        region = compiles.shared.get(key)
        if region is None:      # the first of its kind: the layers' alike runs share it
            region = CompiledRegion(f"{REGION_PREFIX}{len(compiles.counts)}", fx.GraphModule(gm, body),
                                    backend, strict, compiles)
            compiles.shared[key] = region
        name = f"{region.name}_{sum(1 for k in owner if k.startswith(region.name + '_'))}"
        owner[name] = region
        call = new.call_module(name, tuple(env[a] for a in inputs))
        for i, m in enumerate(outputs):
            env[m] = new.call_function(operator.getitem, (call, i))
            env[m].meta = dict(m.meta)
    for n in new.nodes:
        if n.op == "get_attr" and n.target not in owner:
            target = operator.attrgetter(n.target)(gm)      # the same Parameter objects
            if isinstance(target, fx.GraphModule):
                target, _ = compile_regions(target, backend, strict, compiles)
            owner[n.target] = target
    out = fx.GraphModule(owner, new)
    out.graph.lint()
    log.debug("compile: %d regions", sum(1 for k in owner if k.startswith(REGION_PREFIX)))
    return out, compiles
