"""Save on SIGTERM: a preempted run (SLURM, a spot instance) stops at a step boundary with a checkpoint.

As Megatron's ``--exit-signal-handler``, on by default whenever the run has a checkpoint folder
(``--no-exit-signal-handler`` turns it off): a rank's SIGTERM handler only notes the signal; at the
end of every step the ranks agree on it with one all-reduce (MAX of a 0/1 flag), so when the signal
reached only some ranks (or only the launcher, which passes it on: ``launch.spawn(forward_sigterm=
True)``) all stop after the same step. They save a checkpoint there, and the run exits with
``EXIT_CODE`` = 143 = 128 + SIGTERM: what a shell reports for a process ended by SIGTERM, non-zero
so that neither a scheduler nor ``torchrun --max-restarts`` takes the run for finished (Megatron's
handler, in the versions read, ends with ``sys.exit()`` after its save: code 0, a job SLURM records as
COMPLETED), and a value SLURM's ``RequeueExit`` can name to requeue the job (a preemption with
``PreemptMode=REQUEUE`` requeues whatever the code); a requeued attempt resumes by itself
(``hgraph.runtime.train.restart``). A signal during the run's last step changes nothing: that step
ends the run and saves anyway.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

#: The exit code of a run stopped by SIGTERM, checkpoint saved or not.
EXIT_CODE = 128 + signal.SIGTERM


def saves_on_sigterm(config: Any) -> bool:
    """Does ``config``'s run stop with a checkpoint on SIGTERM (a checkpoint folder, handler on)?"""
    ckpts = config.checkpointing
    return ckpts.checkpoint_dir is not None and ckpts.exit_signal_handler


class ExitSignal:
    """Notes SIGTERM in this process from ``install`` to ``close``; ``agreed`` asks every rank."""

    name = "SIGTERM"

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None

    @classmethod
    def install(cls) -> Optional["ExitSignal"]:
        """The handler installed (None off the main thread, where Python allows none)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        out = cls()
        out._previous = signal.signal(signal.SIGTERM, out._note)
        return out

    def _note(self, signum: int, frame: Any) -> None:
        self.received = True

    def agreed(self, device: torch.device) -> bool:
        """Did any rank get the signal? (collective on the default group: every rank calls it after
        every step)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
