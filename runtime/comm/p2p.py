"""Point-to-point sends and receives, staged through host memory where the backend needs it.

gloo takes CUDA tensors in its collectives, but ``send``/``recv`` of a CUDA tensor aborts the process
(``gloo::IoException``, measured on torch 2.11 with two ranks on one GPU). Several ranks sharing one GPU
talk over gloo (``hgraph train --device cuda --backend gloo``), so their pipeline activations and LNK
transfers go through a host copy: a send copies the tensor to a host buffer and sends that; a receive
lands in a host buffer and is copied into the device tensor when it is waited for.

Every function takes ``stage`` (the caller passes ``host_staged(tensor.device)``); staging a CPU tensor
copies it into a host buffer all the same, so the staged path runs, and is tested, without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist


def host_staged(device: torch.device, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether point-to-point of tensors on ``device`` over ``group`` must go through host memory:
    CUDA tensors over gloo."""
    return torch.device(device).type == "cuda" and dist.get_backend(group) == "gloo"


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return host.copy_(t)


@dataclass
class StagedWork:
    """The work of a staged send or receive: waiting finishes it (a receive is copied into ``dest``)."""

    work: Any
    host: torch.Tensor                       # the host buffer (kept alive until the work is done)
    dest: Optional[torch.Tensor] = None      # a receive's device tensor

    def wait(self) -> bool:
        self.work.wait()
        if self.dest is not None:
            self.dest.copy_(self.host)
            self.dest = None
        return True


def isend(t: torch.Tensor, dst: int, *, tag: int = 0, group: Optional[dist.ProcessGroup] = None, stage: bool = False) -> Any:
    """``dist.isend``, from a host copy of ``t`` when ``stage``."""
    if not stage:
        return dist.isend(t, dst, group=group, tag=tag)
    host = _host_copy(t)
    return StagedWork(dist.isend(host, dst, group=group, tag=tag), host)


def irecv(t: torch.Tensor, src: int, *, tag: int = 0, group: Optional[dist.ProcessGroup] = None, stage: bool = False) -> Any:
    """``dist.irecv`` into ``t``, through a host buffer when ``stage`` (``t`` is written on ``wait``)."""
    if not stage:
        return dist.irecv(t, src, group=group, tag=tag)
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return StagedWork(dist.irecv(host, src, group=group, tag=tag), host, t)


@dataclass(frozen=True)
class PeerOp:
    """One send (``send``) or receive of ``tensor`` with ``peer`` under ``tag``."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int


def batch_isend_irecv(transfers: Sequence[PeerOp], *, group: Optional[dist.ProcessGroup] = None, stage: bool = False) -> list:
    """``dist.batch_isend_irecv`` of ``transfers``: one work per transfer (NCCL's one work for the
    whole batch stands for each); staged, every tensor goes through a host buffer."""
    if not transfers:
        return []
    if not stage:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, t.peer,
                                                   group=group, tag=t.tag) for t in transfers])
        return works + [works[-1]] * (len(transfers) - len(works))
    hosts = [_host_copy(t.tensor) if t.send else
             torch.empty(t.tensor.shape, dtype=t.tensor.dtype, device="cpu", pin_memory=t.tensor.is_cuda)
             for t in transfers]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if t.send else dist.irecv, h, t.peer,
                                               group=group, tag=t.tag) for t, h in zip(transfers, hosts)])
    if len(works) != len(transfers):          # one work for the whole batch: wait for it once
        works = works + [works[-1]] * (len(transfers) - len(works))
    return [StagedWork(w, h, None if t.send else t.tensor) for t, h, w in zip(transfers, hosts, works)]
