"""What a training rank builds from its config before the loop: the model (on the meta device, with
its recorded initialisation, or eagerly), its weight source, the sharded optimizer and the planner's
setup; and the note of what happens to the model's dropout.

``record_model`` builds the model on the meta device (nothing allocated) with the init that
``SeededInit`` replays one tensor at a time; ``build_model`` builds it eagerly (tools and references);
``model_and_weights`` adds the source of its initial values (``hgraph.runtime.weights.choice``).
Front doors use ``record_model`` and ``check_weights`` to check a model and its weights before any
process starts; the ``Trainer`` (``runtime/train/trainer.py``) all of them on every rank.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from hgraph import ops
from hgraph.compiled import CompiledModule
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.engine.compiled_regions import compile_wanted
from hgraph.runtime.engine.executor import shard_dims_of
from hgraph.runtime.engine.optimizer import ShardedAdam, ShardedAdamW
from hgraph.runtime.planner.service.setup import PlannerSetup
from hgraph.runtime.process.run_log import run_log
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.weights.choice import weight_source
from hgraph.runtime.weights.deferred_init import InitRecord, NotRecordable, record_init
from hgraph.runtime.weights.sources import EagerInit, SeededInit, WeightSource

log = run_log(__name__)


def _model_spec(config: TrainConfig) -> str:
    model = config.model
    return model.model if ":" in model.model else f"llama:{model.model}"


def build_model(config: TrainConfig) -> torch.nn.Module:
    """The whole model, built eagerly right after ``torch.manual_seed(seed)`` (tools and references;
    a training rank uses ``record_model``)."""
    torch.manual_seed(config.model.seed)
    return resolve_model_spec(_model_spec(config), config.model.model_args)


def record_model(config: TrainConfig) -> InitRecord:
    """The model on the meta device with its recorded initialisation (``SeededInit`` replays it)."""
    return record_init(lambda: resolve_model_spec(_model_spec(config), config.model.model_args),
                       config.model.seed)


def dropout_status(gm: torch.fx.GraphModule, mode: str) -> str:
    """What happens to the model's dropout: ``"applied (N sites, p ...)"``, ``"off (N sites ...)"`` or
    ``"none"`` (the traced graph has no training dropout)."""
    probs = []
    for n in gm.graph.nodes:
        if n.target is ops.keyed_dropout:
            probs.append(float(n.args[1]))
        elif n.target in (torch.nn.functional.scaled_dot_product_attention, ops.causal_attention) \
                and n.kwargs.get("dropout_p"):
            probs.append(float(n.kwargs["dropout_p"]))
    if not probs:
        return "none"
    what = f"{len(probs)} sites, p {min(probs):g}" + (f"-{max(probs):g}" if max(probs) != min(probs) else "")
    return f"applied ({what})" if mode == "apply" else f"off ({what} disabled by --dropout off)"


def model_and_weights(config: TrainConfig, say: bool = False) -> tuple[torch.nn.Module, WeightSource]:
    """The model on the meta device and the source of its initial values: the recorded seeded init,
    ``hf:DIR``'s safetensors or ``--init-from``'s files (names and shapes checked here, before any
    read; ``hgraph.runtime.weights.choice``). A model whose construction reads tensor values is built
    whole instead (``say``: said once)."""
    try:
        record = record_model(config)
        model, default = record.model, SeededInit(record)
    except NotRecordable as exc:
        if say:
            log.info("hgraph: %s; every rank builds the whole model once to initialise its shards", exc)
        model = build_model(config)
        default = EagerInit(model, config.model.seed)
    return model, weight_source(model, default, _model_spec(config), config.model.init_from)


def check_weights(config: TrainConfig) -> str:
    """The run's weight source opened once and checked against the model (file headers only), so bad
    weights fail before any process starts; returns its description."""
    return model_and_weights(config)[1].description


def make_optimizer(config: TrainConfig, compiled: CompiledModule, rank: int, world_size: int,
                   device: Optional[torch.device] = None, shard_group: Optional[int] = None,
                   group: Any = None) -> ShardedAdam:
    """The run's sharded optimizer; ``shard_group``: its states sharded over groups of that many ranks
    (None: the world), ``group`` the process group of this rank's shard group."""
    opt = config.optimizer
    if opt.optimizer not in ("adam", "adamw"):
        raise HGraphError(f"--optimizer {opt.optimizer!r}: allowed are adam, adamw")
    cls = ShardedAdam if opt.optimizer == "adam" else ShardedAdamW
    full = dict(compiled.original.named_parameters())
    named = [(n, full[n]) for n in compiled.hgraph.params]
    kwargs = {} if opt.weight_decay is None else {"weight_decay": opt.weight_decay}
    return cls(named, shard_dims_of(compiled), rank, world_size, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
               max_grad_norm=opt.grad_clip, device=device, impl=opt.optimizer_impl, shard_group=shard_group,
               group=group, **kwargs)


def planner_setup_of(config: TrainConfig, compiled: CompiledModule, device: torch.device,
                     shard_group: Optional[int] = None) -> PlannerSetup:
    """The planner's setup from the run's configuration, its compiled model's TP slots and the rank's
    device (a measured profile times the model there, in the run's working dtype)."""
    plan, counts = config.planner, compiled.hgraph.slot_counts()
    return PlannerSetup(
        strategies=plan.strategies, profile=plan.profile, max_candidates=plan.max_candidates, method=plan.method,
        time_limit_s=plan.time_limit, memory_budget=plan.memory_budget, plan_ahead=plan.plan_ahead,
        offload=plan.offload, host_memory_budget=plan.host_memory_budget,
        tokens_per_iter=config.data.tokens_per_iter, gpus_per_node=config.cluster.gpus_per_node,
        device_memory=config.cluster.device_memory, working_bytes=2 if config.model.dtype == "bf16" else 4,
        tp_slots=counts.get("tp_enter", 0) + counts.get("tp_exit", 0), log=config.log_steps,
        profile_path=Path(config.logging.metrics).parent / "profile.json" if config.logging.metrics else None,
        device=device, dtype=torch.bfloat16 if config.model.dtype == "bf16" else torch.float32,
        compiled_step=compile_wanted(config.model.compile, device), shard_group=shard_group,
        push_bucket_bytes=config.cluster.push_bucket_bytes, overlap_push=config.cluster.overlap_push)


