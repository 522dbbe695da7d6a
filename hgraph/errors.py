"""Errors that carry a message meant for the user: the CLI prints it as one line, with exit code 2
for bad input (``HGraphError``) and 1 for a run that started and failed (``RunFailed``)."""


class HGraphError(Exception):
    """Bad input: a strategy, model, file or option that hgraph cannot accept.

    The message says what is wrong, where, and what is allowed.
    """


class RunFailed(HGraphError):
    """A run that started well and failed: a non-finite loss, every step skipped (exit code 1, so that
    a launcher may restart it; bad input, which a restart cannot mend, is exit code 2)."""


class StrategyError(HGraphError, ValueError):
    """A malformed or impossible parallel strategy."""


class TraceError(HGraphError):
    """A model that the frontend could not turn into an HGraph."""
