"""The least-squares fit of a scheme's latency ``T(l) = a l^2 + b l + c`` to timed points (the profiler's
and the calibration's), kept monotone."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError


def fit_coefficients(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares fit of ``ms = a l^2 + b l + c`` to ``[(l, ms)]``.

    Needs three distinct lengths. A negative ``a`` (attention cost hidden by noise) is refitted as
    linear with ``a = 0``; a negative ``b`` or ``c`` likewise drops that term, so times stay monotone.
    """
    pts = np.asarray(list(points), dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 2:
        raise HGraphError("fit_coefficients needs (length, ms) pairs")
    if len(np.unique(pts[:, 0])) < 3:
        raise HGraphError(f"fitting a*l^2 + b*l + c needs at least 3 distinct lengths, got {len(np.unique(pts[:, 0]))}")
    l, t = pts[:, 0], pts[:, 1]
    columns = {"a": l * l, "b": l, "c": np.ones_like(l)}
    active = ["a", "b", "c"]
    while True:
        X = np.stack([columns[k] for k in active], axis=1)
        sol, *_ = np.linalg.lstsq(X, t, rcond=None)
        fit = dict(zip(active, sol))
        negative = [k for k in active if fit[k] < 0]
        if not negative or len(active) == 1:
            break
        active.remove(negative[0])
    return (float(max(fit.get("a", 0.0), 0.0)), float(max(fit.get("b", 0.0), 0.0)), float(max(fit.get("c", 0.0), 0.0)))
