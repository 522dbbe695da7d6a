"""hgraph: compile an nn.Module into per-rank programs for dynamic heterogeneous parallel strategies."""
from hgraph.errors import HGraphError, StrategyError, TraceError
from hgraph.strategy import Cluster, RankCoord, Scheme, Strategy

__all__ = ["Cluster", "HGraphError", "RankCoord", "Scheme", "Strategy", "StrategyError", "TraceError"]
