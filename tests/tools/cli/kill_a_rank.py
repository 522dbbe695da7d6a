"""``hgraph`` with one rank of a launcher's first attempt killed by SIGKILL in the middle of a step.

Run by ``torchrun`` as its script: ``kill_a_rank.py RANK STEP hgraph-arguments...``. In the first
attempt (``TORCHELASTIC_RESTART_COUNT`` 0), global rank RANK kills itself in the optimizer update of
step STEP: after its forward, backward and gradient reduction, before the update, while its peers
wait in the step's collectives. Restarted attempts run ``hgraph`` unchanged.
"""
import os
import signal
import sys

from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.train.trainer import Trainer
from hgraph.tools.cli import main


def arm(kill_step: int) -> None:
    current = {"step": -1}
    trainer_step, update = Trainer.run_step, ShardedAdam.step

    def step(self, batch, *args):
        current["step"] = batch.step
        return trainer_step(self, batch, *args)

    def dying_update(self, *args, **kwargs):
        if current["step"] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return update(self, *args, **kwargs)
    Trainer.run_step, ShardedAdam.step = step, dying_update


if __name__ == "__main__":
    rank, kill_step = int(sys.argv[1]), int(sys.argv[2])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and int(os.environ["RANK"]) == rank:
        arm(kill_step)
    sys.exit(main(sys.argv[3:]))
