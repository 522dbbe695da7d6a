"""Errors that carry a message meant for the user (the CLI prints it as one line, exit code 2)."""


class HGraphError(Exception):
    """Bad input: a strategy, model, file or option that hgraph cannot accept.

    The message says what is wrong, where, and what is allowed.
    """


class StrategyError(HGraphError, ValueError):
    """A malformed or impossible parallel strategy."""


class TraceError(HGraphError):
    """A model that the frontend could not turn into an HGraph."""
