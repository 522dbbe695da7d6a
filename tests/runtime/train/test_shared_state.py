"""Rank 0's trained parameters through shared memory: every dtype and shape back bitwise, the block
gone once taken (runtime/train/shared_state.py)."""
from multiprocessing import shared_memory

import pytest
import torch

from hgraph.runtime.train.shared_state import SharedState


def test_a_state_dict_comes_back_bitwise_and_its_block_is_removed():
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3, 5, generator=g), "half": torch.randn(7, generator=g).bfloat16(),
             "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "ids": torch.arange(9).view(3, 3),
             "strided": torch.randn(4, 6, generator=g).t()}
    handle = SharedState.publish(state)
    assert all(e.offset % 64 == 0 for e in handle.entries)
    back = handle.take()
    assert list(back) == list(state)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        assert torch.equal(back[key], value), key
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=handle.name)
