"""A test-only parallel dimension, registered through ``hgraph.dims.registered`` (never in the
production tables): ``RS<n>``, whose ranks hold the same weights and tokens (``Splits.REPLICAS``) and
sit between the sequence ranks and the stages in the rank layout. What the registry generates for it
(text form, errors, rank layout, groups, bindings, coordinates, roles, push shares, the loss share) is
checked by ``tests/hgraph/test_dims.py``.
"""
from hgraph import dims
from hgraph.dims import Dim, Splits

#: the test dimension: written ``RS<n>`` after UL, between CP (layout 2) and PP (layout 3)
RS = Dim("rs", "RS", 2.5, "reshard", Splits.REPLICAS, key="rs")


def with_reshard():
    """The registry with ``RS`` added while the block runs."""
    return dims.registered(RS)
