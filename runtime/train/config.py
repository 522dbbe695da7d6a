"""The configuration of a training run: one frozen dataclass per section of ``hgraph train``'s TOML
file, held by a frozen ``TrainConfig`` together with what the caller resolves for the run.

Every option is declared here once: a field of its section (``[model] [data] [cluster] [optimizer]
[planner] [checkpointing] [logging]``) made by ``runtime.train.option.option``, carrying its default,
its kind, allowed values and smallest value, and its help. ``runtime.train.config_keys`` generates
the option table and the TOML reader from these fields (and ``hgraph.tools.cli.train_schema`` the
``hgraph train`` flags), so ``TrainConfig()`` holds the options of a bare ``hgraph train`` (whose run
object, ``runtime.train.run.prepare``, then resolves the run-time fields: the built-in documents, the
metrics file in its run folder, the step lines and bars). An option is named like
its flag without dashes (``--tokens-per-iter`` is ``data.tokens_per_iter``), and no two sections
share a name, so a config can be built by key alone, with no knowledge of the sections:

* ``TrainConfig.from_values({"lr": 0.01, "steps": 3, ...})`` puts every key into its section (the
  command line builds its config so from the resolved values; tests and library users name the keys
  they set);
* ``config.with_values(steps=4, docs=...)`` is a new config with those keys changed: nothing changes
  a config after it is built;
* ``config.values()`` is every key's value; an option is read through its section
  (``config.optimizer.lr``, typed); ``config.lr`` is an AttributeError that names the section.

Values are the runtime's: byte sizes are numbers (``planner.memory_budget``,
``planner.host_memory_budget``, ``cluster.device_memory``
also ``"auto"``: sized on the ranks from the model), the schedule is the ``"S1;S2"`` text of
``--strategy-schedule``. A run is planner-driven unless it has a schedule (``planner_driven``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES
from hgraph.runtime.train.option import option
from hgraph.runtime.train.progress import ProgressFactory


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: what is trained, in which working precision, from which seed or weights."""

    model: str = option("llama:tiny", kind="str", metavar="SPEC",
        help=("zoo config (llama:tiny, hf:gpt2, ...), hf:DIR (a local Hugging Face model folder: its "
              "config.json and safetensors weights) or FILE.py:CLASS"))
    model_args: Mapping[str, Any] = option(default_factory=dict, kind="table", metavar="JSON",
        help="model config overrides or class kwargs (a TOML table; on the command line a JSON object)")
    dtype: str = option("fp32", kind="str", choices=("fp32", "bf16"),
        help="working precision (masters stay fp32)")
    seed: int = option(0, kind="int", minimum=0,
        help="seed of the model initialisation, the built-in data, the planner and the dropout masks")
    dropout: str = option("apply", kind="str", choices=("apply", "off"),
        help=("the model's train-mode dropout: apply (masks keyed by document, position and site, the same "
              "under every strategy) or off"))
    sequence_parallel: bool = option(True, kind="bool",
        help=("Megatron sequence parallelism under TP > 1: the activations between TP regions hold 1/TP of "
              "the tokens (reduce-scatter / all-gather instead of all-reduce); on where the model allows it"
              " (else TP runs without it, said at the start); --no-sequence-parallel to compare"))
    vocab_parallel_loss: str = option("auto", kind="str", choices=("auto", "on", "off"),
        help=("the loss of a vocabulary split over TP ranks: on (Megatron's vocabulary-parallel cross-"
              "entropy: no logits gathered), off (each chunk's logits gathered for torch's log_softmax: the"
              " single-device arithmetic), auto (on with a working dtype below fp32)"))
    compile: str = option("auto", kind="str", choices=("auto", "on", "off"),
        help=("torch.compile of each rank's graph: the compute between its communication ops, fused by "
              "inductor, the token dimension dynamic (on, off, auto: on with CUDA)"))
    compile_backend: str = option("inductor", kind="str", metavar="NAME",
        help=("the torch.compile backend of --compile (inductor; aot_eager traces and differentiates "
              "without generating code)"))
    moe_aux_loss: str = option("none", kind="str", choices=("none", "per-document", "hf", "global-batch"),
        help=("the MoE load-balancing loss added to the training loss (times --moe-aux-loss-coef): "
              "per-document (each document's routing counts over all its tokens, whatever the strategy), "
              "hf (Hugging Face's product of means over the tokens as a rank holds them: it changes with "
              "the micro-batch split and the strategy), global-batch (the routing counts of the whole "
              "mini-batch, whatever the strategy; it costs one extra forward pass per step), none (as Megatron's default coefficient 0 and HF's "
              "output_router_logits=False)"))
    moe_aux_loss_coef: float = option(0.01, kind="float", minimum=0.0,
        help="the coefficient of --moe-aux-loss (Megatron's recommended 1e-2)")
    moe_z_loss_coef: float = option(0.0, kind="float", minimum=0.0,
        help="the coefficient of the MoE router z-loss (ST-MoE's 1e-3; 0: none)")
    init_from: Optional[str] = option(None, kind="path", optional=True, metavar="PATH",
        help=("start from these weights instead of the seeded init (and of an hf:DIR model's own): a "
              "safetensors file or folder, an hgraph checkpoint folder, or a torch state_dict file; names "
              "matched by FQN (default: none; a resumed run continues from its checkpoint)"))


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the documents and how many of them a step and the run take."""

    data: Optional[str] = option(None, kind="path", optional=True, metavar="PREFIX|FILE|MIX",
        help=("training data: a token store PREFIX (hgraph prepare-data), JSONL with input_ids, raw text "
              "(JSONL text, parquet, a datasets folder, text files) with --tokenizer, or a mixture "
              "'W1:SRC1,W2:SRC2' (default: the built-in long-tail dataset)"))
    tokenizer: Optional[str] = option(None, kind="path", optional=True, metavar="TOK",
        help=("tokenizer of raw --data / --eval-data: tokenizer.json or a local Hugging Face tokenizer "
              "folder (the text is tokenized as hgraph prepare-data does, into the run folder, before the "
              "processes start)"))
    text_key: str = option("text", kind="str", metavar="KEY",
        help="text field of raw JSONL / parquet / dataset records")
    shuffle: bool = option(False, kind="bool",
        help="a new seeded permutation of the documents every epoch (--seed); default: file order")
    long: str = option("error", kind="str", choices=("error", "truncate", "split", "drop"),
        help=("documents longer than the model's context or --tokens-per-iter: error, truncate, split "
              "(consecutive chunks, each its own document) or drop; counted in the summary"))
    eval_data: Optional[str] = option(None, kind="path", optional=True, metavar="SRC",
        help="validation documents (a source like --data; the first --eval-tokens of it)")
    eval_every: Optional[int] = option(None, kind="int", minimum=1, optional=True, metavar="K",
        help="validation loss (eval_loss in the metrics) after every K-th step")
    eval_tokens: Optional[int] = option(None, kind="int", minimum=1, optional=True, metavar="T",
        help="tokens of validation documents, whole documents in file order (default: --tokens-per-iter)")
    builtin_docs: Optional[int] = option(None, kind="int", minimum=1, optional=True, metavar="N",
        help="documents of the built-in dataset (default: enough for --steps without repeating one)")
    builtin_scale: float = option(1 / 16, kind="float", minimum=1e-6, metavar="X",
        help="length scale of the built-in dataset (real Wikipedia lengths times this)")
    tokens_per_iter: int = option(8192, kind="int", minimum=1, metavar="T",
        help="tokens per mini-batch (whole documents in order)")
    steps: int = option(60, kind="int", minimum=1, metavar="K",
        help="total steps of the run (a resumed run continues up to it)")


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: the ranks, their backend and memory, and how long a collective may wait."""

    world_size: int = option(4, kind="int", minimum=1, metavar="N",
        help=("number of ranks (default: one per GPU visible with --device cuda, 4 local processes on CPU; "
              "under torchrun or SLURM the launcher's, and another value is an error)"))
    # "auto" left unresolved (a config not from the command line): CUDA under NCCL, else CPU
    device: str = option("auto", kind="str", choices=("auto", "cuda", "cpu"),
        help=("where the ranks run (auto: cuda when torch sees a GPU, else cpu); on cuda with --backend "
              "gloo several ranks share a GPU (shared-device mode, for development)"))
    gpus_per_node: int = option(8, kind="int", minimum=1, metavar="G",
        help=("ranks per node; a TP group never crosses a node (default: 8; under torchrun or SLURM the "
              "launcher's ranks per node, and another value is an error)"))
    backend: str = option("auto", kind="str", choices=("auto", "gloo", "nccl"),
        help=("collective backend (auto: nccl when every local process can have a GPU of its own, else "
              "gloo; the same rule under torchrun)"))
    # given as text (512M), held as bytes: the front door parses it
    device_memory: Union[float, str, None] = option("auto", kind="str", metavar="BYTES|auto|none",
        help=("memory per rank (512M, 2G) that bounds each scheme's longest micro-batch (MaxLen, from this "
              "runtime's measured activation and model-state bytes); none: no limit; auto: on CUDA one "
              "GPU's memory (shared by the ranks on it); on CPU with the built-in data, sized from the "
              "model (the widest TP scheme just holds the model's context), with --data none"))
    timeout: Optional[float] = option(None, kind="float", minimum=1e-3, optional=True, metavar="S",
        help=("seconds a collective may wait, a lost rank is reported within it (default: 60 for local "
              "processes, 600 under torchrun or SLURM, whose nodes start at different times)"))
    heartbeat_timeout: float = option(60.0, kind="float", minimum=1e-3, metavar="S",
        help=("seconds a rank may stop answering (stopped, frozen host) before a peer names it by rank and "
              "host and the run ends"))
    collective_order: str = option("free", kind="str", choices=("free", "strict"),
        help=("strict: every rank completes each collective (a point-to-point batch as one) before it "
              "issues the next, across all its groups, the most conservative reading of NCCL, so an "
              "inconsistent order hangs on gloo too; a hang is named (ranks, groups, each one's operation) "
              "after --heartbeat-timeout (or 0.8 of --timeout if sooner); free: collectives of different "
              "groups overlap"))
    verify_collectives: bool = option(False, kind="bool",
        help=("record what each rank issues (group, operation, shape, dtype) and check every rank's "
              "sequence after each new strategy's first step: a group whose members disagree, or an order "
              "that could deadlock NCCL, ends the run naming the ranks and the first differing operation"))
    peak_tflops: Optional[float] = option(None, kind="float", minimum=1e-6, optional=True, metavar="TFLOPS",
        help=("one device's dense bf16 peak TFLOP/s for the MFU of every step (default: a table of known "
              "GPUs, e.g. H100 SXM 989; none on CPU)"))
    # the engine's communication knobs, handed to each Program's ParamSync (runtime/comm/param_sync.py)
    push_bucket_bytes: int = option(DEFAULT_BUCKET_BYTES, kind="int", minimum=1, metavar="BYTES",
        help=("bytes of gradient shards reduced together in one push bucket, the buckets issued in one "
              "global order on every rank (default: 26214400, DDP's 25 MiB)"))
    pull_bucket_bytes: Optional[int] = option(None, kind="int", minimum=1, optional=True, metavar="BYTES",
        help=("bytes of working parameters all-gathered together in one pull bucket (default: the "
              "backend's: 25 MiB on gloo, whose gathers are all-to-alls, 256 KiB otherwise)"))
    overlap_push: bool = option(True, kind="bool",
        help=("issue the push's reductions from the backward's hooks as their buckets fill, overlapped "
              "with the rest of the backward (and the optimizer update under plain data parallelism); "
              "--no-overlap-push: all of them after the last backward"))


@dataclass(frozen=True)
class OptimizerConfig:
    """``[optimizer]``: the sharded optimizer and its settings."""

    optimizer: str = option("adam", kind="str", choices=("adam", "adamw"),
        help="sharded optimizer")
    lr: float = option(0.001, kind="float", minimum=0.0,
        help="learning rate (the schedule's peak)")
    betas: tuple[float, float] = option((0.9, 0.999), kind="pair", metavar="B1,B2",
        help="Adam betas B1,B2 (TOML: [0.9, 0.999])")
    eps: float = option(1e-08, kind="float", minimum=0.0,
        help="Adam epsilon")
    weight_decay: Optional[float] = option(None, kind="float", minimum=0.0, optional=True,
        help="weight decay (default: 0 for adam, 1e-2 for adamw)")
    grad_clip: Optional[float] = option(None, kind="float", minimum=1e-12, optional=True, metavar="NORM|none",
        help="clip by global gradient norm (none: no clipping)")
    skip_nonfinite: bool = option(False, kind="bool",
        help="skip the update of a step whose loss is NaN/inf")
    # "auto" at the runtime is constant: the command line gives its built-in run the cosine recipe
    lr_schedule: str = option("auto", kind="str", choices=("auto", "constant", "cosine", "linear", "wsd"),
        help=("constant, cosine, linear or wsd (warmup, stable, linear decay over the last --decay-steps); "
              "auto: cosine with 10% warmup to lr/10 for the built-in default run, constant with --data"))
    warmup_steps: Optional[int] = option(None, kind="int", minimum=0, optional=True, metavar="W",
        help="linear warmup steps (default 0; auto: 10% of --steps)")
    min_lr: Optional[float] = option(None, kind="float", minimum=0.0, optional=True,
        help="learning rate at the end of the decay (default 0; auto: lr/10)")
    decay_steps: Optional[int] = option(None, kind="int", minimum=1, optional=True, metavar="D",
        help=("steps of the decay (default: to the end of the run after the warmup; wsd: the last 10% of "
              "the steps)"))
    shard_group: Union[int, str] = option("world", kind="str", metavar="G|world|auto", integers=True,
        help=("the optimizer states (fp32 masters, Adam's moments) are sharded over each group of G "
              "consecutive ranks and replicated across the groups: a rank pulls and pushes inside its "
              "group, then sums its gradient shards across the groups (G = a node: a rank's peers no longer"
              " grow with the world, for N/G copies of the states); world: over all ranks (the default: the"
              " memory every run had); auto: the smallest node multiple whose states fit half the device "
              "memory (said at the start)"))
    optimizer_impl: str = option("fused", kind="str", choices=("fused", "exact"),
        help=("the update: fused (torch's fused Adam kernel on each rank's flat buffers) or exact "
              "(torch.optim.Adam's single-tensor arithmetic, bitwise, also after a resume on another number"
              " of ranks; fused rounds up to an ulp apart)"))


@dataclass(frozen=True)
class PlannerConfig:
    """``[planner]``: which strategy each step runs and how the documents are dispatched and packed."""

    strategy_schedule: Optional[str] = option(None, kind="str", optional=True, metavar="S1;S2;...",
        help=("fixed strategies, step k uses S_(k mod n) (deterministic mode; default: the planner chooses "
              "every step)"))
    strategies: str = option("auto", kind="str", metavar="S1;S2|auto",
        help="candidate strategies 'S1;S2' or auto (proposed for the data)")
    max_candidates: Optional[int] = option(None, kind="int", minimum=1, optional=True,
        help=("most candidate strategies of --strategies auto (none: the proposal's own set plus what "
              "sampled mini-batches add)"))
    profile: str = option("measure", kind="str", metavar="measure|analytic|NAME|FILE",
        help=("cost profile: measure (timed on this machine by the ranks at the start, kept as "
              "RUN_DIR/profile.json), analytic (prior from the model's shape), "
              "llama-7b|llama-13b|llama-32b, FILE or FILE:NAME (measured with hgraph profile)"))
    method: str = option("fast", kind="str", choices=("fast", "greedy", "cpsat"),
        help="dispatch method")
    time_limit: float = option(10.0, kind="float", minimum=1e-3, metavar="S",
        help=("seconds per CP-SAT solve (method cpsat: one solve per candidate strategy not pruned by its "
              "bound)"))
    plan_ahead: int = option(2, kind="int", minimum=0, metavar="Q",
        help=("plans computed ahead in the planner process (bounded queue; 0: plan inline); the ranks build"
              " the new strategies of the known next steps (a fixed schedule's next Q) while the current "
              "one runs"))
    outlier_queues: int = option(0, kind="int", minimum=0, metavar="K",
        help=("WLB outlier-delay queues of the data stream: long documents wait until a group of their "
              "length class (one per rank) gathers (0: no delay; all are trained by the run's last step)"))
    microbatch_tokens: Optional[int] = option(None, kind="int", minimum=1, optional=True, metavar="T",
        help="token limit of a packed micro-batch (default: chosen per pipeline)")
    # given as text (512M), held as bytes: the front door parses it
    memory_budget: Optional[float] = option(None, kind="str", optional=True, metavar="BYTES",
        help=("activation bytes per rank (512M, 2G): blocks are recomputed per micro-batch, as few as fit "
              "(default: no recomputation)"))
    offload: str = option("off", kind="str", choices=("off", "on", "auto"),
        help=("activation offload: a block's saved tensors wait in (pinned) host memory until its backward."
              " on: with --memory-budget blocks offload before any is recomputed, without one every block "
              "offloads; auto: per micro-batch each layer leaves the device the cheaper way (recomputation "
              "or the copies its compute does not hide); off"))
    # given as text (512M), held as bytes: the front door parses it
    host_memory_budget: Optional[float] = option(None, kind="str", optional=True, metavar="BYTES",
        help=("host bytes of offloaded activations per rank (64G; default: half the host's RAM over the "
              "ranks on it); a copy that would pass it stays on the device"))
    cp_sharding: str = option("adaptive", kind="str", choices=("adaptive", "per-document", "per-sequence"),
        help="how CP ranks split a micro-batch")
    balance: str = option("none", kind="str", choices=("none", "sp-accumulation", "dcp-inter"),
        help=("sp-accumulation: homogeneous data parallelism with a per-batch sequence-parallel size, "
              "balanced by gradient accumulation (dcp-inter: its old name)"))


@dataclass(frozen=True)
class CheckpointingConfig:
    """``[checkpointing]``: where and when checkpoints are saved, and whether the run resumes."""

    checkpoint_dir: Optional[str] = option(None, kind="path", optional=True, metavar="DIR",
        help="folder of the checkpoints (none: no checkpoints)")
    checkpoint_every: Optional[int] = option(None, kind="int", minimum=1, optional=True, metavar="K",
        help="save every K steps and at the end (needs checkpoint-dir; default: only at the end)")
    keep_checkpoints: Optional[int] = option(None, kind="int", minimum=2, optional=True, metavar="K",
        help="keep only the newest K checkpoints (at least 2; default: all)")
    async_checkpoint: bool = option(False, kind="bool",
        help=("write checkpoints in a background thread (DCP's async_save): a step waits only for the copy "
              "of the tensors; a save completes before the next one and at the run's end"))
    resume: bool = option(False, kind="bool",
        help=("continue from the newest complete checkpoint in checkpoint-dir (also with another world-"
              "size)"))
    resume_fallback: bool = option(False, kind="bool",
        help=("with resume: when the newest checkpoint is corrupt or truncated, use the previous one "
              "(default: stop with an error naming the file)"))
    save_final: Optional[str] = option(None, kind="path", optional=True, metavar="PATH",
        help="write the final fp32 state_dict (keyed like the module) here")
    exit_signal_handler: bool = option(True, kind="bool",
        help=("with checkpoint-dir: on SIGTERM (a scheduler's preemption) finish the step, save a "
              "checkpoint, say where and exit with code 143 (off: SIGTERM stops the run at once, also exit "
              "143)"))


@dataclass(frozen=True)
class LoggingConfig:
    """``[logging]``: what the run writes and prints."""

    run_dir: Optional[str] = option(None, kind="path", optional=True, metavar="DIR",
        help="run folder for metrics.jsonl and plots (default ./runs/<timestamp>)")
    metrics: Optional[str] = option(None, kind="path", optional=True, metavar="PATH.jsonl",
        help="also write the per-step metrics here")
    plots: bool = option(True, kind="bool",
        help="write the PNG and SVG plots into the run folder at the end")
    progress: str = option("auto", kind="str", choices=("auto", "on", "off"),
        help="progress bars: auto (on a terminal), on, off")
    log_every: int = option(1, kind="int", minimum=1, metavar="K",
        help="print one line every K steps")
    json: bool = option(False, kind="bool",
        help="print one JSON object at the end instead of lines")
    track_memory: bool = option(False, kind="bool",
        help=("measure each rank's peak activation bytes into the metrics (saved-tensor accounting; about "
              "8% of a tiny-model step on CPU; always on with memory-budget)"))
    tensorboard: Optional[str] = option(None, kind="path", optional=True, metavar="DIR",
        help=("write every step's loss, tokens/s, TFLOP/s per device, MFU and peak memory per rank as "
              "TensorBoard scalars into DIR (pip install -e '.[tensorboard]' in the hgraph checkout)"))
    wandb: Optional[str] = option(None, kind="str", optional=True, metavar="PROJECT",
        help=("log the same scalars to this wandb project, offline (wandb sync uploads them); skipped with "
              "a note when wandb is not installed"))
    flat_loss_threshold: float = option(0.001, kind="float", minimum=0.0, metavar="X",
        help=("warn once when the loss moves less than this, relative to where it started, over the 50 "
              "steps after the warmup while the learning rate is above zero (learning rate too high or too "
              "low, saturated softmax); a fine-tune may set it lower, 0 turns the warning off"))


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
    return_final: bool = False                         # rank 0 hands the trained parameters to the caller

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
        # only called for names that are not attributes: an option is read through its section, and
        # a bare option name says which (a config has no flat, untyped keys)
        section = SECTION_OF.get(name)
        where = f"; the option is config.{section}.{name}" if section is not None else ""
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{where}")
