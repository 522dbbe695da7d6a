"""A run's data checked and made ready once, in the launcher, before any process starts.

``ready_data(config, cache_dir)``: raw sources of ``--data`` / ``--eval-data`` are tokenized into token
stores under ``cache_dir`` (``hgraph.runtime.data.prepare.resolve_raw_sources``; the config's
``data_sources`` / ``eval_sources`` name them); every store's checksum is verified; a token beyond the
model's vocabulary, a document ``--long error`` refuses, mixture weights that do not parse or an
``--eval-data`` without a document are one HGraphError here, not a failure on every rank.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

from hgraph.errors import HGraphError
from hgraph.runtime.data.corpus import open_corpus
from hgraph.runtime.data.prepare import resolve_raw_sources
from hgraph.runtime.data.stored import limit_long
from hgraph.runtime.train.config import TrainConfig


def model_limits(model) -> tuple[Optional[int], Optional[int]]:
    """The model's vocabulary size and context length (None where its config has none)."""
    mcfg = getattr(model, "config", None)
    return getattr(mcfg, "vocab_size", None), getattr(mcfg, "max_seq_len", None)


def ready_data(config: TrainConfig, model, cache_dir: Path,
               say: Optional[Callable[[str], None]] = None) -> TrainConfig:
    """``config`` with its raw sources replaced by stores, checksums, vocabulary, ``--long`` and mixtures
    checked; ``model``: the run's model (on the meta device: only its config is read)."""
    data = config.data
    if data.data is None and data.eval_data is None:
        return config
    vocab, max_len = model_limits(model)
    changes = {}
    for key, spec, resolved in (("data_sources", data.data, config.data_sources),
                                ("eval_sources", data.eval_data, config.eval_sources)):
        if spec is None:
            continue
        what = "--data" if key == "data_sources" else "--eval-data"
        if resolved is None:
            resolved = resolve_raw_sources(spec, data.tokenizer, data.text_key, cache_dir, say, what)
        changes[key] = resolved          # set: the data is checked once
        _, parts = open_corpus(resolved, vocab, verify=True)
        # a training document must fit the model and a step; a validation one the model
        budget = data.tokens_per_iter if key == "data_sources" else sys.maxsize
        for part in parts:
            if not len(part):
                raise HGraphError(f"{what} {spec}: no document")
            limit_long(part, budget, max_len, data.long)
    return config.with_values(**changes) if changes else config
