"""Whether the folders a run writes can be written, found at its start: a probe file created, written,
flushed to disk and removed in each, before any rank starts.

A read-only checkpoint folder used to be found at the first save, after the ranks had trained (two
steps lost on a resume) and as a raw ``OSError``; a missing folder is created, as the run would. Under
``torchrun`` or SLURM each node's local rank 0 probes the folders its node writes (the checkpoint
shards of every node; the run folder on global rank 0's), so a node whose mount is read-only is found
too, and a shared filesystem sees one probe per node, not one per rank.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterable, Optional, Union

from hgraph.errors import HGraphError


def probe_writable(folders: Iterable[tuple[str, Optional[Union[str, Path]]]]) -> None:
    """Each ``(what, folder)`` (``what``: how the message names it, e.g. ``--checkpoint-dir``; None
    folders are skipped) created if missing and a probe file written and removed in it; the first that
    fails is one HGraphError naming the option, the folder and the reason."""
    for what, folder in folders:
        if folder is None:
            continue
        path = Path(folder)
        probe = path / f".hgraph-write-probe-{socket.gethostname()}-{os.getpid()}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"hgraph\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise HGraphError(f"{what} {str(path)!r} cannot be written ({reason}"
                              + (f": {exc.filename}" if exc.filename and str(exc.filename) != str(path) else "")
                              + "); give a folder this run may write") from None
