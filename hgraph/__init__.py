"""hgraph: compile an nn.Module into per-rank programs for dynamic heterogeneous parallel strategies."""
from hgraph.errors import HGraphError, StrategyError, TraceError
from hgraph.strategy import Cluster, RankCoord, Scheme, Strategy

__all__ = ["Cluster", "HGraphError", "RankCoord", "Scheme", "Strategy", "StrategyError", "TraceError"]
from hgraph.compiled import CompiledModule, compile  # noqa: E402,A001
from hgraph.options import CompileOptions  # noqa: E402
from hgraph.program import Program, RankProgram  # noqa: E402
from hgraph.training import TrainResult, train  # noqa: E402

__all__ += ["CompiledModule", "CompileOptions", "Program", "RankProgram", "TrainResult", "compile", "train"]
