"""A process's random number generators' states (torch and CUDA, numpy, python ``random``) in a form
a checkpoint stores and ``torch.load(weights_only=True)`` reads back: tensors and plain containers."""
from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch


def capture_rng() -> dict:
    """torch (and CUDA), numpy and python ``random`` states in a ``weights_only``-loadable form."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    out = {"torch": torch.get_rng_state(),
           "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                     "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
           "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                      "gauss": py_gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back the RNG states captured by ``capture_rng``."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
