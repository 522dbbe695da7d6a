"""Training workers one of whose ranks dies, is signalled or stops mid-step, for the tests of lost ranks,
of SIGTERM and of silent ranks (spawn targets must live in an importable module).

The fault strikes rank ``victim`` in step ``at_step``, between posting the step's pulls and its
forward (every step does both), while its peers wait in the step's collectives.
"""
import os
import signal


def _strike(rank, victim, at_step, fault):
    from hgraph.runtime.engine import executor
    if rank != victim:
        return
    original, calls = executor.run_one_f_one_b, []

    def run_one_f_one_b(*args, **kwargs):     # the step's 1F1B, after its pulls were posted
        calls.append(1)
        if len(calls) == at_step + 1:
            fault()
        return original(*args, **kwargs)
    executor.run_one_f_one_b = run_one_f_one_b


def dying_worker(rank, world, config, victim, at_step):
    """The trainer; rank ``victim`` dies in step ``at_step`` (no report, no cleanup)."""
    from hgraph.runtime.train.rank_run import train_worker
    _strike(rank, victim, at_step, lambda: os._exit(17))
    return train_worker(rank, world, config)


def sigterm_worker(rank, world, config, victim, at_step):
    """The trainer; rank ``victim`` alone gets SIGTERM in step ``at_step`` (its peers never see it)."""
    from hgraph.runtime.train.rank_run import train_worker
    _strike(rank, victim, at_step, lambda: os.kill(os.getpid(), signal.SIGTERM))
    return train_worker(rank, world, config)


def sigstop_worker(rank, world, config, victim, at_step):
    """The trainer; rank ``victim`` stops itself (SIGSTOP: alive, silent, its sockets open) in step
    ``at_step``."""
    from hgraph.runtime.train.rank_run import train_worker
    _strike(rank, victim, at_step, lambda: os.kill(os.getpid(), signal.SIGSTOP))
    return train_worker(rank, world, config)
