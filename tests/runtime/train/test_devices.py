"""``hgraph train`` on the devices of the machine (``runtime.train.devices``), CUDA faked where asked.

On a GPU machine the world size defaults to the GPUs visible and ``--device-memory auto`` is one GPU's
memory; more ranks than GPUs is one line naming the ways out (``--device cpu``, ``--backend gloo``);
without CUDA the default run stays 4 CPU processes over gloo. No process starts here.
"""
import types

import pytest
import torch

from hgraph.errors import HGraphError
from hgraph.runtime.train import devices
from hgraph.runtime.train.run_config import config_from_options

GPU_BYTES = 80 * 2 ** 30


@pytest.fixture
def gpus(monkeypatch):
    """Make torch see ``n`` GPUs of 80 GiB each."""
    def see(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None: types.SimpleNamespace(total_memory=GPU_BYTES, name="NVIDIA H100"))
    return see


def _config(**options):
    return config_from_options(options)[0]


def test_without_cuda_the_default_run_is_four_cpu_processes(gpus):
    gpus(0)
    c = _config().cluster
    assert (c.device, c.world_size, c.device_memory) == ("cpu", 4, "auto")
    assert devices.backend_for(c.device, c.backend, c.world_size) == "gloo"
    assert devices.describe(c.device, c.world_size, "gloo") == "4 CPU processes (gloo)"
    with pytest.raises(HGraphError, match="--device cuda: torch sees no CUDA GPU here; --device cpu"):
        _config(device="cuda")


def test_on_one_gpu_the_default_run_is_one_rank_with_the_gpus_memory(gpus):
    gpus(1)
    c = _config().cluster
    assert (c.device, c.world_size, c.device_memory) == ("cuda", 1, float(GPU_BYTES))
    assert devices.backend_for(c.device, c.backend, c.world_size) == "nccl"
    assert devices.describe(c.device, c.world_size, "nccl") == "1 GPU"
    gpus(8)
    assert _config().cluster.world_size == 8
    assert _config(world_size=2).cluster.world_size == 2


def test_more_ranks_than_gpus_is_one_line_naming_the_ways_out(gpus):
    gpus(1)
    with pytest.raises(HGraphError) as refused:       # bad input: the command prints it, exit 2
        _config(world_size=4)
    err = f"{refused.value}\n"
    assert err.count("\n") == 1 and err == (
        "--world-size 4: this machine has 1 GPU (NVIDIA H100) and NCCL needs one "
        "per rank; use --world-size 1, --device cpu (4 CPU processes over gloo), or --backend gloo "
        "(4 ranks sharing the GPU)\n")


def test_cpu_processes_or_ranks_sharing_the_gpu_on_request(gpus):
    gpus(1)
    c = _config(world_size=4, device="cpu").cluster
    assert (c.device, c.world_size, c.device_memory) == ("cpu", 4, "auto")
    assert devices.backend_for(c.device, c.backend, c.world_size) == "gloo"
    shared = _config(world_size=4, backend="gloo").cluster      # shared-device mode
    assert (shared.device, shared.world_size, shared.device_memory) == ("cuda", 4, GPU_BYTES / 4)
    assert devices.describe(shared.device, 4, "gloo") == "4 ranks sharing 1 GPU (gloo)"
    with pytest.raises(HGraphError, match="--backend nccl needs --device cuda"):
        _config(device="cpu", backend="nccl")
    assert devices.rank_device("cpu", 3, "gloo") == torch.device("cpu")
    assert devices.rank_device("auto", 3, "gloo") == torch.device("cpu")      # a config built in code
