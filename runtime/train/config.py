"""The configuration of a training run: one frozen dataclass per section of ``hgraph train``'s TOML
file, held by a frozen ``TrainConfig`` together with what the caller resolves for the run.

The sections and their keys are those of ``hgraph.tools.cli.train_schema`` (``[model] [data]
[cluster] [optimizer] [planner] [checkpointing] [logging]``), with the same defaults, so
``TrainConfig()`` holds the options of a bare ``hgraph train`` (which then resolves the run-time
fields: the built-in documents, the metrics file in its run folder, the step lines and bars). A key
is named like its flag without dashes (``--tokens-per-iter`` is ``data.tokens_per_iter``), and no
two sections share a key name, so a config can be built and read by key alone, with no knowledge
of the schema:

* ``TrainConfig.from_values({"lr": 0.01, "steps": 3, ...})`` puts every key into its section (the
  command line builds its config so from the schema's resolved values; tests and library users
  name the keys they set);
* ``config.with_values(steps=4, docs=...)`` is a new config with those keys changed: nothing changes
  a config after it is built;
* ``config.values()`` is every key's value; ``config.lr`` reads ``config.optimizer.lr`` (except the
  keys ``model``, ``data`` and ``optimizer``, whose names are those of their sections).

Values are the runtime's: byte sizes are numbers (``planner.memory_budget``,
``planner.host_memory_budget``, ``cluster.device_memory``
also ``"auto"``: sized on the ranks from the model), the schedule is the ``"S1;S2"`` text of
``--strategy-schedule``. A run is planner-driven unless it has a schedule (``planner_driven``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from hgraph.runtime.train.progress import ProgressFactory


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: what is trained, in which working precision, from which seed or weights."""

    model: str = "llama:tiny"                  # zoo spec (llama:tiny, hf:gpt2, tiny = llama:tiny) or FILE.py:CLASS
    model_args: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "fp32"
    seed: int = 0
    dropout: str = "apply"                     # apply: the model's train-mode dropout, strategy-invariant; off
    sequence_parallel: bool = True             # Megatron SP under TP>1 where the model allows it; False: off
    init_from: Optional[str] = None            # initial weights: safetensors, hgraph checkpoint or state_dict
    vocab_parallel_loss: str = "auto"          # a TP-split vocabulary's loss: on | off | auto (on below fp32)
    compile: str = "auto"                      # torch.compile of the rank graphs: on | off | auto (on with CUDA)
    compile_backend: str = "inductor"          # its torch.compile backend (aot_eager: no code generated)


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the documents and how many of them a step and the run take."""

    data: Optional[str] = None                 # store prefix, JSONL, raw text, "W:SRC,W:SRC" (None: docs)
    tokenizer: Optional[str] = None            # tokenizer.json or HF tokenizer folder (raw text data)
    text_key: str = "text"                     # the text field of raw JSONL / parquet / dataset records
    builtin_docs: Optional[int] = None         # the command line's built-in documents: how many, and
    builtin_scale: float = 1 / 16              # ... their length scale
    tokens_per_iter: int = 8192
    steps: int = 60                            # the run's total (a resumed run continues up to it)
    shuffle: bool = False                      # a seeded permutation per epoch (else file order)
    long: str = "error"                        # documents over the context: error | truncate | split | drop
    eval_data: Optional[str] = None            # validation documents (a source like ``data``)
    eval_every: Optional[int] = None           # validation loss after every K-th step
    eval_tokens: Optional[int] = None          # tokens of validation documents (None: tokens_per_iter)


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: the ranks, their backend and memory, and how long a collective may wait."""

    world_size: int = 4
    gpus_per_node: int = 8
    device: str = "auto"                       # cuda | cpu | auto (the command line resolves it; here:
                                               # CUDA under NCCL, else CPU)
    backend: str = "auto"                      # auto: NCCL with a GPU per local process, else gloo
    device_memory: Union[float, str, None] = "auto"   # bytes per rank bounding MaxLen, "auto" or None
    timeout: Optional[float] = None            # None: 60 s for local processes, 600 s under a launcher
    heartbeat_timeout: float = 60.0            # a rank silent this long is named and the run ends
    collective_order: str = "free"             # free | strict: each collective completes before the next
    #                                            (NCCL's strictest reading; a hang names itself after
    #                                            heartbeat_timeout)
    verify_collectives: bool = False           # check every rank's recorded collectives after a new
    #                                            Program's first step
    peak_tflops: Optional[float] = None        # a device's dense bf16 peak for MFU (None: known GPUs' table)


@dataclass(frozen=True)
class OptimizerConfig:
    """``[optimizer]``: the sharded optimizer and its settings."""

    optimizer: str = "adam"                    # adam | adamw
    lr: float = 1e-3
    lr_schedule: str = "auto"                  # auto (constant; the CLI's built-in run: cosine) | constant |
    #                                            cosine | linear | wsd (runtime.train.lr_schedule)
    warmup_steps: Optional[int] = None         # None: 0
    min_lr: Optional[float] = None             # the decay's end (None: 0)
    decay_steps: Optional[int] = None          # None: to the run's end (wsd: its last 10% of steps)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: Optional[float] = None       # None: the optimizer's default (0 Adam, 1e-2 AdamW)
    grad_clip: Optional[float] = None
    skip_nonfinite: bool = False
    optimizer_impl: str = "fused"              # fused | exact (engine/optimizer)
    shard_group: Union[int, str] = "world"     # G dividing the world | world | auto: the states are sharded
    #                                            over groups of G ranks (planner/cost/shard_group)


@dataclass(frozen=True)
class PlannerConfig:
    """``[planner]``: which strategy each step runs and how the documents are dispatched and packed."""

    strategy_schedule: Optional[str] = None    # "S1;S2": step k runs S_(k mod n) (None: planner-driven)
    strategies: str = "auto"                   # the planner's candidates: "auto" or "S1;S2"
    max_candidates: Optional[int] = None       # most candidates of "auto" (None: the proposal's set)
    profile: str = "measure"                   # cost model: measure | analytic | NAME | FILE
    method: str = "fast"                       # dispatch method: fast | greedy | cpsat
    time_limit: float = 10.0                   # seconds per CP-SAT solve (method cpsat)
    plan_ahead: int = 2                        # plans computed ahead in the planner process (0: inline),
                                               # and steps whose new strategies are built ahead
    outlier_queues: int = 0                    # WLB outlier-delay queues of the data stream (0: no delay)
    microbatch_tokens: Optional[int] = None
    memory_budget: Optional[float] = None      # activation bytes per rank: dynamic recomputation (DCP-intra)
    offload: str = "off"                       # activation offload to host memory: off | on | auto
    host_memory_budget: Optional[float] = None  # offloaded bytes per rank (None: half the RAM over its ranks)
    cp_sharding: str = "adaptive"              # adaptive | per-document | per-sequence
    balance: str = "none"                      # "sp-accumulation" (or "dcp-inter"): per-batch SP size


@dataclass(frozen=True)
class CheckpointingConfig:
    """``[checkpointing]``: where and when checkpoints are saved, and whether the run resumes."""

    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None     # None: only after the last step
    keep_checkpoints: Optional[int] = None
    async_checkpoint: bool = False             # write in a background thread (the step waits for a copy)
    resume: bool = False                       # continue from the newest checkpoint in checkpoint_dir
    resume_fallback: bool = False              # ... or the previous one when the newest is broken
    save_final: Optional[str] = None           # the gathered fp32 state_dict, written at the end
    exit_signal_handler: bool = True           # with checkpoint_dir: SIGTERM saves and stops (exit_signal)


@dataclass(frozen=True)
class LoggingConfig:
    """``[logging]``: what the run writes and prints."""

    run_dir: Optional[str] = None
    metrics: Optional[str] = None              # one JSON line per step
    plots: bool = True
    progress: str = "auto"                     # the command line's bars: auto | on | off
    log_every: int = 1                         # a step line every this many steps (and the last)
    json: bool = False
    track_memory: bool = False                 # peak activation bytes per rank (on with a memory budget)
    tensorboard: Optional[str] = None          # a folder: every step's scalars as TensorBoard events
    wandb: Optional[str] = None                # a wandb project: the same scalars, offline (when installed)
    flat_loss_threshold: float = 1e-3          # warn once when the loss moves less (relative) after the
    #                                            warmup (loss_health); 0: no warning


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "cluster": ClusterConfig,
                             "optimizer": OptimizerConfig, "planner": PlannerConfig,
                             "checkpointing": CheckpointingConfig, "logging": LoggingConfig}
# key -> its section (key names are unique over the sections)
SECTION_OF: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class TrainConfig:
    """One run's configuration: the sections, and what the caller resolved for this run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    docs: Optional[Sequence[Sequence[int]]] = None     # the documents' token ids (instead of data.data)
    data_sources: Optional[str] = None                 # ``data`` with raw sources replaced by their stores
    eval_sources: Optional[str] = None                 # ``eval_data`` likewise
    resume_from: Optional[str] = None                  # the checkpoint folder a resume loads (every rank)
    log_steps: bool = False                            # rank 0 prints the step, planner and checkpoint lines
    progress_bars: Optional[ProgressFactory] = None    # rank 0's progress bars (runtime.train.progress)

    @classmethod
    def from_values(cls, values: Mapping[str, Any] = {}, /, **more: Any) -> "TrainConfig":  # noqa: B006
        """A config of the defaults with the keys of ``values`` and ``more`` (``more`` wins) set."""
        return cls().with_values(**{**values, **more})

    def with_values(self, **changes: Any) -> "TrainConfig":
        """This config with the keys ``changes`` names set (section keys and run-time fields alike)."""
        own = {f.name for f in dataclasses.fields(self) if f.name not in SECTIONS}
        unknown = sorted(k for k in changes if k not in SECTION_OF and k not in own)
        if unknown:
            raise TypeError(f"unknown training config key(s) {', '.join(unknown)}")
        per_section: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if key in SECTION_OF:
                per_section.setdefault(SECTION_OF[key], {})[key] = value
        top = {k: v for k, v in changes.items() if k in own}
        sections = {s: dataclasses.replace(getattr(self, s), **kv) for s, kv in per_section.items()}
        return dataclasses.replace(self, **sections, **top)

    def values(self) -> dict[str, Any]:
        """Every section key's value, section by section."""
        return {k: getattr(getattr(self, s), k) for k, s in SECTION_OF.items()}

    @property
    def planner_driven(self) -> bool:
        """Whether the planner picks every step's strategy (no ``--strategy-schedule``)."""
        return self.planner.strategy_schedule is None

    def __getattr__(self, name: str) -> Any:
        # only called for names that are not attributes: a section key, read from its section
        section = SECTION_OF.get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, section), name)
