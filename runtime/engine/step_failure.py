"""What a step's failed collective means: a lost rank (named from the heartbeats) or a timeout (where
each rank's sequence of collectives stopped), as the one line the run ends with."""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

from hgraph.errors import RunFailed
from hgraph.runtime.comm.order.issue import CollectiveIssuer


class RankLostError(RuntimeError):
    """A collective failed because a rank of the run died (named from the heartbeats)."""

    def __init__(self, step: int, lost: Sequence[int], rank: int, cause: BaseException) -> None:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(f"step {step}: lost rank(s) {list(lost)} (no heartbeat); rank {rank} stops "
                         f"({type(cause).__name__}: {first[:160]})")
        self.step, self.lost = step, list(lost)


class RankWatch(Protocol):
    """What the executor needs of a heartbeat (``runtime.train.heartbeat.Heartbeat``)."""

    def lost_ranks(self) -> list[int]: ...      # the ranks that stopped answering, in order


def timed_out(exc: BaseException) -> bool:
    """Whether a collective's error is its timeout (gloo: "Timed out", NCCL's watchdog: "Timeout")."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def step_failure(exc: RuntimeError, step: int, rank: int, watch: Optional[RankWatch],
                 issuer: CollectiveIssuer) -> Optional[Exception]:
    """The error a step that raised ``exc`` ends with (None: ``exc`` itself): ``RankLostError`` when the
    heartbeat lost ranks, ``RunFailed`` saying where the ranks' collectives stopped on a timeout."""
    if isinstance(exc, RankLostError):
        return None
    lost = watch.lost_ranks() if watch is not None else []
    if lost:
        return RankLostError(step, lost, rank, exc)
    if timed_out(exc):
        return RunFailed(f"step {step}: a collective timed out on rank {rank} "
                         f"({str(exc).strip().splitlines()[0][:160]}); where the ranks' collectives "
                         f"stopped: {issuer.stopped_line()}")
    return None
