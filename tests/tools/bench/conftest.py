import pytest
import torch


@pytest.fixture
def one_thread():
    """torch on one thread for a tiny model's steps: on a shared machine more threads only contend
    (a smoke run of llama-moe:tiny took 20 s on 2 busy cores with two threads, 1.5 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
