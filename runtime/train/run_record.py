"""``run.json`` in a run directory: what later tools need to rebuild the run's setting without its
command line (``hgraph dump --run-dir``): the model and its arguments, the cluster, dtype and planner."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from hgraph.errors import HGraphError
from hgraph.runtime.train.config import TrainConfig

RUN_RECORD = "run.json"
_KEYS = ("model", "model_args", "world_size", "gpus_per_node", "dtype", "strategies", "profile", "steps",
         "tokens_per_iter", "data", "plan_ahead", "seed")


def write_run_record(run_dir: Union[str, Path], config: TrainConfig) -> Path:
    """Write ``run.json`` for ``config`` into ``run_dir`` (a schedule run: ``strategies`` null and
    the ``schedule``'s strategies)."""
    values = config.values()
    record = {k: values[k] for k in _KEYS}
    if not config.planner_driven:
        record["strategies"] = None
        record["schedule"] = config.planner.strategy_schedule.split(";")
    path = Path(run_dir) / RUN_RECORD
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def read_run_record(run_dir: Union[str, Path]) -> dict:
    """The run's ``run.json`` (HGraphError naming the file if it is missing or malformed)."""
    path = Path(run_dir) / RUN_RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HGraphError(f"{path} does not exist: not a run directory of hgraph train "
                          "(or a run from before run.json was written)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise HGraphError(f"{path} cannot be read: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("model"), str) \
            or not isinstance(record.get("world_size"), int):
        raise HGraphError(f"{path}: expected an object with 'model' (string) and 'world_size' (integer)")
    return record
