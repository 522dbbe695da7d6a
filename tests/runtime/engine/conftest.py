"""Fixtures of the engine's tests."""
import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank():
    """A default process group of one gloo rank in the test process, for the module's tests."""
    store = os.path.join(tempfile.mkdtemp(prefix="hgraph-one-rank-"), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
