"""Which ranks' MoE routing counts are summed where (``runtime/engine/router_losses`` issues the sums,
``order/derive`` derives them): the ranks that hold the other tokens of a micro-batch, read from the
dimension registry (``hgraph.dims``) rather than named."""
from __future__ import annotations

from hgraph import dims
from hgraph.dims import BindingKey


def token_holder_keys(sliced: bool) -> list[str]:
    """The groups whose ranks hold other tokens of a micro-batch, in the order a document's counts are
    summed over them: the dimensions that split tokens (``dims.SEQUENCE``, inside out: Ulysses, CP),
    then the TP group when the MoE op runs on a TP rank's token slice (``sliced``: its experts whole
    under sequence parallelism)."""
    return [d.key for d in dims.SEQUENCE if d.key is not None] + ([BindingKey.TP] if sliced else [])
