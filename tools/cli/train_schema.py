"""``hgraph train`` configuration: one declarative table of keys, a TOML loader, flag overrides, help.

Every option of ``hgraph train`` is one ``ConfigKey`` in ``SCHEMA``: its TOML section and key, the
command-line flag of the same name (``--tokens-per-iter`` is ``tokens-per-iter`` under ``[data]``),
type, default, allowed values and help. A run's values come from three layers, later ones winning:
the table's defaults, the TOML file (``--config run.toml``), then the flags actually given.

A TOML file uses the flag names as keys (``tokens_per_iter`` is accepted for ``tokens-per-iter``)
in the seven sections ``[model] [data] [cluster] [optimizer] [planner] [checkpointing] [logging]``.
Optional keys take the string ``"none"`` for "not set" (TOML has no null). Unknown sections or keys, wrong types and
disallowed values raise ``HGraphError`` naming the file, the key, the value and what is allowed (the
CLI prints it and exits with code 2).

``add_arguments(parser)`` declares every flag with an absent default, so ``resolve`` can tell the
flags that were given from those that were not; ``help_text()`` renders the table for ``--help``;
``dump_toml`` writes a resolved configuration back as a file that loads to the same values.

``hgraph train`` builds its run's ``hgraph.runtime.train.config.TrainConfig`` from the resolved
values: the config has a frozen dataclass per section, with these keys and defaults.
"""
from __future__ import annotations

import argparse
import json
import math
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from hgraph.errors import HGraphError

SECTIONS = ("model", "data", "cluster", "optimizer", "planner", "checkpointing", "logging")
KINDS = ("int", "float", "str", "bool", "path", "table", "pair")


@dataclass(frozen=True)
class ConfigKey:
    """One option: ``[section] name`` in TOML, ``--name`` on the command line, ``dest`` in the result.

    ``kind``: int, float, str, bool, path, table (a TOML table / JSON object) or pair (two floats);
    ``optional``: None is a valid value (the default unless given); ``choices``: allowed values;
    ``minimum``: smallest allowed number; ``integers``: a str key that also takes a TOML integer
    (kept as its text, e.g. ``shard-group = 8``).
    """

    section: str
    name: str
    kind: str
    default: Any
    help: str
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    optional: bool = False
    metavar: Optional[str] = None
    integers: bool = False

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def flag(self) -> str:
        return f"--{self.name}"


def _k(section: str, name: str, kind: str, default: Any, help: str, **kw: Any) -> ConfigKey:
    return ConfigKey(section, name, kind, default, help, **kw)


# The table: section order first, then the order shown in --help.
SCHEMA: tuple[ConfigKey, ...] = (
    _k("model", "model", "str", "llama:tiny", "zoo config (llama:tiny, hf:gpt2, ...), hf:DIR (a local Hugging "
       "Face model folder: its config.json and safetensors weights) or FILE.py:CLASS", metavar="SPEC"),
    _k("model", "model-args", "table", {}, "model config overrides or class kwargs (a TOML table; "
       "on the command line a JSON object)", metavar="JSON"),
    _k("model", "dtype", "str", "fp32", "working precision (masters stay fp32)", choices=("fp32", "bf16")),
    _k("model", "seed", "int", 0, "seed of the model initialisation, the built-in data, the planner and "
       "the dropout masks", minimum=0),
    _k("model", "dropout", "str", "apply", "the model's train-mode dropout: apply (masks keyed by document, "
       "position and site, the same under every strategy) or off", choices=("apply", "off")),
    _k("model", "sequence-parallel", "bool", True, "Megatron sequence parallelism under TP > 1: the "
       "activations between TP regions hold 1/TP of the tokens (reduce-scatter / all-gather instead of "
       "all-reduce); on where the model allows it (else TP runs without it, said at the start); "
       "--no-sequence-parallel to compare"),
    _k("model", "vocab-parallel-loss", "str", "auto", "the loss of a vocabulary split over TP ranks: on "
       "(Megatron's vocabulary-parallel cross-entropy: no logits gathered), off (each chunk's logits "
       "gathered for torch's log_softmax: the single-device arithmetic), auto (on with a working dtype "
       "below fp32)", choices=("auto", "on", "off")),
    _k("model", "compile", "str", "auto", "torch.compile of each rank's graph: the compute between its "
       "communication ops, fused by inductor, the token dimension dynamic (on, off, auto: on with CUDA)",
       choices=("auto", "on", "off")),
    _k("model", "compile-backend", "str", "inductor", "the torch.compile backend of --compile (inductor; "
       "aot_eager traces and differentiates without generating code)", metavar="NAME"),
    _k("model", "init-from", "path", None, "start from these weights instead of the seeded init (and of "
       "an hf:DIR model's own): a safetensors file or folder, an hgraph checkpoint folder, or a torch "
       "state_dict file; names matched by FQN (default: none; a resumed run continues from its "
       "checkpoint)", optional=True, metavar="PATH"),
    _k("data", "data", "path", None, "training data: a token store PREFIX (hgraph prepare-data), JSONL with "
       "input_ids, raw text (JSONL text, parquet, a datasets folder, text files) with --tokenizer, or a "
       "mixture 'W1:SRC1,W2:SRC2' (default: the built-in long-tail dataset)", optional=True,
       metavar="PREFIX|FILE|MIX"),
    _k("data", "tokenizer", "path", None, "tokenizer of raw --data / --eval-data: tokenizer.json or a local "
       "Hugging Face tokenizer folder (the text is tokenized as hgraph prepare-data does, into the run "
       "folder, before the processes start)", optional=True, metavar="TOK"),
    _k("data", "text-key", "str", "text", "text field of raw JSONL / parquet / dataset records",
       metavar="KEY"),
    _k("data", "shuffle", "bool", False, "a new seeded permutation of the documents every epoch (--seed); "
       "default: file order"),
    _k("data", "long", "str", "error", "documents longer than the model's context or --tokens-per-iter: "
       "error, truncate, split (consecutive chunks, each its own document) or drop; counted in the summary",
       choices=("error", "truncate", "split", "drop")),
    _k("data", "eval-data", "path", None, "validation documents (a source like --data; the first "
       "--eval-tokens of it)", optional=True, metavar="SRC"),
    _k("data", "eval-every", "int", None, "validation loss (eval_loss in the metrics) after every K-th step",
       optional=True, minimum=1, metavar="K"),
    _k("data", "eval-tokens", "int", None, "tokens of validation documents, whole documents in file order "
       "(default: --tokens-per-iter)", optional=True, minimum=1, metavar="T"),
    _k("data", "builtin-docs", "int", None, "documents of the built-in dataset (default: enough for "
       "--steps without repeating one)", optional=True, minimum=1, metavar="N"),
    _k("data", "builtin-scale", "float", 1 / 16, "length scale of the built-in dataset (real Wikipedia "
       "lengths times this)", minimum=1e-6, metavar="X"),
    _k("data", "tokens-per-iter", "int", 8192, "tokens per mini-batch (whole documents in order)",
       minimum=1, metavar="T"),
    _k("data", "steps", "int", 60, "total steps of the run (a resumed run continues up to it)",
       minimum=1, metavar="K"),
    _k("cluster", "world-size", "int", 4, "number of ranks (default: one per GPU visible with --device cuda, "
       "4 local processes on CPU; under torchrun or SLURM the launcher's, and another value is an error)",
       minimum=1, metavar="N"),
    _k("cluster", "device", "str", "auto", "where the ranks run (auto: cuda when torch sees a GPU, else cpu); "
       "on cuda with --backend gloo several ranks share a GPU (shared-device mode, for development)",
       choices=("auto", "cuda", "cpu")),
    _k("cluster", "gpus-per-node", "int", 8, "ranks per node; a TP group never crosses a node (default: 8; "
       "under torchrun or SLURM the launcher's ranks per node, and another value is an error)", minimum=1,
       metavar="G"),
    _k("cluster", "backend", "str", "auto", "collective backend (auto: nccl when every local process "
       "can have a GPU of its own, else gloo; the same rule under torchrun)",
       choices=("auto", "gloo", "nccl")),
    _k("cluster", "device-memory", "str", "auto", "memory per rank (512M, 2G) that bounds each scheme's "
       "longest micro-batch (MaxLen, from this runtime's measured activation and model-state bytes); "
       "none: no limit; auto: on CUDA one GPU's memory (shared by the ranks on it); on CPU with the "
       "built-in data, sized from the model (the widest TP scheme just holds the model's context), with "
       "--data none", metavar="BYTES|auto|none"),
    _k("cluster", "timeout", "float", None, "seconds a collective may wait, a lost rank is reported "
       "within it (default: 60 for local processes, 600 under torchrun or SLURM, whose nodes start at "
       "different times)", optional=True, minimum=1e-3, metavar="S"),
    _k("cluster", "heartbeat-timeout", "float", 60.0, "seconds a rank may stop answering (stopped, frozen "
       "host) before a peer names it by rank and host and the run ends", minimum=1e-3, metavar="S"),
    _k("cluster", "collective-order", "str", "free", "strict: every rank completes each collective (a "
       "point-to-point batch as one) before it issues the next, across all its groups, the most conservative "
       "reading of NCCL, so an inconsistent order hangs on gloo too; a hang is named (ranks, groups, each "
       "one's operation) after --heartbeat-timeout (or 0.8 of --timeout if sooner); free: collectives of "
       "different groups overlap",
       choices=("free", "strict")),
    _k("cluster", "verify-collectives", "bool", False, "record what each rank issues (group, operation, "
       "shape, dtype) and check every rank's sequence after each new strategy's first step: a group whose "
       "members disagree, or an order that could deadlock NCCL, ends the run naming the ranks and the "
       "first differing operation"),
    _k("cluster", "peak-tflops", "float", None, "one device's dense bf16 peak TFLOP/s for the MFU of every "
       "step (default: a table of known GPUs, e.g. H100 SXM 989; none on CPU)", optional=True,
       minimum=1e-6, metavar="TFLOPS"),
    _k("optimizer", "optimizer", "str", "adam", "sharded optimizer", choices=("adam", "adamw")),
    _k("optimizer", "lr", "float", 1e-3, "learning rate (the schedule's peak)", minimum=0.0),
    _k("optimizer", "betas", "pair", (0.9, 0.999), "Adam betas B1,B2 (TOML: [0.9, 0.999])",
       metavar="B1,B2"),
    _k("optimizer", "eps", "float", 1e-8, "Adam epsilon", minimum=0.0),
    _k("optimizer", "weight-decay", "float", None, "weight decay (default: 0 for adam, 1e-2 for adamw)",
       optional=True, minimum=0.0),
    _k("optimizer", "grad-clip", "float", None, "clip by global gradient norm (none: no clipping)",
       optional=True, minimum=1e-12, metavar="NORM|none"),
    _k("optimizer", "skip-nonfinite", "bool", False, "skip the update of a step whose loss is NaN/inf"),
    _k("optimizer", "lr-schedule", "str", "auto", "constant, cosine, linear or wsd (warmup, stable, linear "
       "decay over the last --decay-steps); auto: cosine with 10% warmup to lr/10 for the built-in default "
       "run, constant with --data", choices=("auto", "constant", "cosine", "linear", "wsd")),
    _k("optimizer", "warmup-steps", "int", None, "linear warmup steps (default 0; auto: 10% of --steps)",
       optional=True, minimum=0, metavar="W"),
    _k("optimizer", "min-lr", "float", None, "learning rate at the end of the decay (default 0; auto: lr/10)",
       optional=True, minimum=0.0),
    _k("optimizer", "decay-steps", "int", None, "steps of the decay (default: to the end of the run after "
       "the warmup; wsd: the last 10% of the steps)", optional=True, minimum=1, metavar="D"),
    _k("optimizer", "shard-group", "str", "world", "the optimizer states (fp32 masters, Adam's moments) are "
       "sharded over each group of G consecutive ranks and replicated across the groups: a rank pulls and "
       "pushes inside its group, then sums its gradient shards across the groups (G = a node: a rank's "
       "peers no longer grow with the world, for N/G copies of the states); world: over all ranks (the "
       "default: the memory every run had); auto: the smallest node multiple whose states fit half the "
       "device memory (said at the start)", metavar="G|world|auto", integers=True),
    _k("optimizer", "optimizer-impl", "str", "fused", "the update: fused (torch's fused Adam kernel on "
       "each rank's flat buffers) or exact (torch.optim.Adam's single-tensor arithmetic, bitwise, also "
       "after a resume on another number of ranks; fused rounds up to an ulp apart)",
       choices=("fused", "exact")),
    _k("planner", "strategy-schedule", "str", None, "fixed strategies, step k uses S_(k mod n) "
       "(deterministic mode; default: the planner chooses every step)", optional=True,
       metavar="S1;S2;..."),
    _k("planner", "strategies", "str", "auto", "candidate strategies 'S1;S2' or auto (proposed for the "
       "data)", metavar="S1;S2|auto"),
    _k("planner", "max-candidates", "int", None, "most candidate strategies of --strategies auto (none: "
       "the proposal's own set plus what sampled mini-batches add)", optional=True, minimum=1),
    _k("planner", "profile", "str", "measure", "cost profile: measure (timed on this machine by the ranks "
       "at the start, kept as RUN_DIR/profile.json), analytic (prior from the model's shape), "
       "llama-7b|llama-13b|llama-32b, FILE or FILE:NAME (measured with hgraph profile)",
       metavar="measure|analytic|NAME|FILE"),
    _k("planner", "method", "str", "fast", "dispatch method", choices=("fast", "greedy", "cpsat")),
    _k("planner", "time-limit", "float", 10.0, "seconds per CP-SAT solve (method cpsat: one solve per "
       "candidate strategy not pruned by its bound)", minimum=1e-3, metavar="S"),
    _k("planner", "plan-ahead", "int", 2, "plans computed ahead in the planner process (bounded queue; "
       "0: plan inline); the ranks build the new strategies of the known next steps (a fixed "
       "schedule's next Q) while the current one runs", minimum=0, metavar="Q"),
    _k("planner", "outlier-queues", "int", 0, "WLB outlier-delay queues of the data stream: long "
       "documents wait until a group of their length class (one per rank) gathers (0: no delay; all are "
       "trained by the run's last step)", minimum=0, metavar="K"),
    _k("planner", "microbatch-tokens", "int", None, "token limit of a packed micro-batch (default: "
       "chosen per pipeline)", optional=True, minimum=1, metavar="T"),
    _k("planner", "memory-budget", "str", None, "activation bytes per rank (512M, 2G): blocks are "
       "recomputed per micro-batch, as few as fit (default: no recomputation)", optional=True,
       metavar="BYTES"),
    _k("planner", "offload", "str", "off", "activation offload: a block's saved tensors wait in (pinned) "
       "host memory until its backward. on: with --memory-budget blocks offload before any is recomputed, "
       "without one every block offloads; auto: per micro-batch each layer leaves the device the cheaper "
       "way (recomputation or the copies its compute does not hide); off", choices=("off", "on", "auto")),
    _k("planner", "host-memory-budget", "str", None, "host bytes of offloaded activations per rank (64G; "
       "default: half the host's RAM over the ranks on it); a copy that would pass it stays on the device",
       optional=True, metavar="BYTES"),
    _k("planner", "cp-sharding", "str", "adaptive", "how CP ranks split a micro-batch",
       choices=("adaptive", "per-document", "per-sequence")),
    _k("planner", "balance", "str", "none", "sp-accumulation: homogeneous data parallelism with a per-batch "
       "sequence-parallel size, balanced by gradient accumulation (dcp-inter: its old name)",
       choices=("none", "sp-accumulation", "dcp-inter")),
    _k("checkpointing", "checkpoint-dir", "path", None, "folder of the checkpoints (none: no "
       "checkpoints)", optional=True, metavar="DIR"),
    _k("checkpointing", "checkpoint-every", "int", None, "save every K steps and at the end (needs "
       "checkpoint-dir; default: only at the end)", optional=True, minimum=1, metavar="K"),
    _k("checkpointing", "keep-checkpoints", "int", None, "keep only the newest K checkpoints (at least 2; "
       "default: all)", optional=True, minimum=2, metavar="K"),
    _k("checkpointing", "async-checkpoint", "bool", False, "write checkpoints in a background thread (DCP's "
       "async_save): a step waits only for the copy of the tensors; a save completes before the next one "
       "and at the run's end"),
    _k("checkpointing", "resume", "bool", False, "continue from the newest complete checkpoint in "
       "checkpoint-dir (also with another world-size)"),
    _k("checkpointing", "resume-fallback", "bool", False, "with resume: when the newest checkpoint is "
       "corrupt or truncated, use the previous one (default: stop with an error naming the file)"),
    _k("checkpointing", "save-final", "path", None, "write the final fp32 state_dict (keyed like the "
       "module) here", optional=True, metavar="PATH"),
    _k("checkpointing", "exit-signal-handler", "bool", True, "with checkpoint-dir: on SIGTERM (a scheduler's "
       "preemption) finish the step, save a checkpoint, say where and exit with code 143 (off: SIGTERM "
       "stops the run at once, also exit 143)"),
    _k("logging", "run-dir", "path", None, "run folder for metrics.jsonl and plots (default "
       "./runs/<timestamp>)", optional=True, metavar="DIR"),
    _k("logging", "metrics", "path", None, "also write the per-step metrics here", optional=True,
       metavar="PATH.jsonl"),
    _k("logging", "plots", "bool", True, "write the PNG and SVG plots into the run folder at the end"),
    _k("logging", "progress", "str", "auto", "progress bars: auto (on a terminal), on, off",
       choices=("auto", "on", "off")),
    _k("logging", "log-every", "int", 1, "print one line every K steps", minimum=1, metavar="K"),
    _k("logging", "json", "bool", False, "print one JSON object at the end instead of lines"),
    _k("logging", "track-memory", "bool", False, "measure each rank's peak activation bytes into the "
       "metrics (saved-tensor accounting; about 8% of a tiny-model step on CPU; always on with "
       "memory-budget)"),
    _k("logging", "tensorboard", "path", None, "write every step's loss, tokens/s, TFLOP/s per device, "
       "MFU and peak memory per rank as TensorBoard scalars into DIR (pip install -e '.[tensorboard]' in the hgraph checkout)",
       optional=True, metavar="DIR"),
    _k("logging", "wandb", "str", None, "log the same scalars to this wandb project, offline (wandb sync "
       "uploads them); skipped with a note when wandb is not installed", optional=True,
       metavar="PROJECT"),
    _k("logging", "flat-loss-threshold", "float", 1e-3, "warn once when the loss moves less than this, "
       "relative to where it started, over the 50 steps after the warmup while the learning rate is above "
       "zero (learning rate too high or too low, saturated softmax); a fine-tune may set it lower, 0 turns "
       "the warning off", minimum=0.0, metavar="X"),
)

KEYS: dict[tuple[str, str], ConfigKey] = {(k.section, k.name): k for k in SCHEMA}
BY_DEST: dict[str, ConfigKey] = {k.dest: k for k in SCHEMA}


def _check_schema() -> None:
    """The table's own consistency (run at import: a bad entry is a programming error)."""
    assert len(BY_DEST) == len(SCHEMA), "two keys share a name"
    for key in SCHEMA:
        assert key.section in SECTIONS and key.kind in KINDS, key
        if key.default is not None or not key.optional:
            _validate(key, key.default, "the schema")


# ---- validation ---------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    return repr(value) if not isinstance(value, str) else f'"{value}"'


def _where(key: ConfigKey, source: str) -> str:
    return f"{source}: [{key.section}] {key.name}" if source != "command line" else f"{key.flag}"


def _validate(key: ConfigKey, value: Any, source: str) -> Any:
    """``value`` checked and normalised for ``key``; HGraphError names key, value and what is allowed."""
    where = _where(key, source)
    if key.optional and (value is None or (isinstance(value, str) and value.lower() == "none")):
        return None
    expected = {"int": "an integer", "float": "a number", "str": "a string", "path": "a path string",
                "bool": "true or false", "table": "a table of model settings", "pair": "two numbers"}[key.kind]
    bad = HGraphError(f"{where} = {_fmt(value)}: expected {expected}"
                      + (' or "none"' if key.optional else ""))
    if key.kind == "bool":
        if not isinstance(value, bool):
            raise bad
    elif key.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
    elif key.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad
        value = float(value)
    elif key.kind in ("str", "path"):
        if key.integers and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            raise bad
    elif key.kind == "table":
        if not isinstance(value, Mapping):
            raise bad
        value = dict(value)
    elif key.kind == "pair":
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise bad
        value = (float(value[0]), float(value[1]))
        if not all(0.0 <= v < 1.0 for v in value):
            raise HGraphError(f"{where} = {list(value)}: each beta must be in [0, 1)")
    if key.choices is not None and value not in key.choices:
        raise HGraphError(f"{where} = {_fmt(value)}: allowed are {', '.join(map(str, key.choices))}")
    if key.minimum is not None and value < key.minimum:
        raise HGraphError(f"{where} = {_fmt(value)}: must be >= {key.minimum:g}")
    return value


def validate_mapping(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Sections of a parsed TOML document -> ``{dest: value}`` (checked; HGraphError on the first problem)."""
    out: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            if not isinstance(table, Mapping):
                raise HGraphError(f"{source}: top-level key {section!r} is not allowed; keys go in the "
                                  f"sections [{'], ['.join(SECTIONS)}]")
            raise HGraphError(f"{source}: unknown section [{section}]; allowed sections: "
                              f"{', '.join(SECTIONS)}")
        if not isinstance(table, Mapping):
            raise HGraphError(f"{source}: {section} = {_fmt(table)}: expected a section [{section}]")
        for name, value in table.items():
            key = KEYS.get((section, name.replace("_", "-")))
            if key is None:
                allowed = ", ".join(k.name for k in SCHEMA if k.section == section)
                raise HGraphError(f"{source}: unknown key [{section}] {name}; allowed in [{section}]: {allowed}")
            if key.dest in out:
                raise HGraphError(f"{source}: [{section}] {name} is given twice (as - and _ spellings)")
            out[key.dest] = _validate(key, value, source)
    return out


def load_config(path: Union[str, Path]) -> dict[str, Any]:
    """The validated values of a TOML file, ``{dest: value}`` (only the keys the file sets)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HGraphError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HGraphError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    return validate_mapping(data, path.name)


# ---- command line -------------------------------------------------------------------------------
def _flag_type(key: ConfigKey) -> Callable[[str], Any]:
    """argparse ``type=`` for ``key``: text -> value, or ArgumentTypeError (argparse: exit 2)."""
    def convert(text: str) -> Any:
        try:
            if key.optional and text.lower() == "none":
                return None
            if key.kind == "int":
                value: Any = int(text)
            elif key.kind == "float":
                value = float(text)
            elif key.kind == "pair":
                value = tuple(float(v) for v in text.split(","))
            elif key.kind == "table":
                value = json.loads(text)
            else:
                value = text
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {key.kind}"
                                             + (" B1,B2" if key.kind == "pair" else "")) from None
        try:
            return _validate(key, value, "command line")
        except HGraphError as exc:
            # "--steps = 0: must be >= 1" -> argparse's "argument --steps: 0: must be >= 1"
            raise argparse.ArgumentTypeError(str(exc).split(" = ", 1)[-1]) from None
    convert.__name__ = key.kind      # argparse names the type in its messages
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every key as a flag (grouped by section) with an absent default, plus ``--config``.

    Bool keys get ``--name`` / ``--no-name``. Use ``resolve`` on the parsed namespace.
    """
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="RUN.toml",
                        help="TOML file with the keys below; flags given on the command line win")
    groups = {s: parser.add_argument_group(f"[{s}]") for s in SECTIONS}
    for key in SCHEMA:
        g = groups[key.section]
        # a help text that already explains its default keeps it; the others get the table's
        text = key.help if "default" in key.help else f"{key.help} (default: {_default_text(key)})"
        text = text.replace("%", "%%")        # argparse %-formats help texts ("8%" would break --help)
        if key.kind == "bool":
            g.add_argument(key.flag, dest=key.dest, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=text)
        else:
            g.add_argument(key.flag, dest=key.dest, type=_flag_type(key), default=argparse.SUPPRESS,
                           choices=None, metavar=key.metavar or (
                               "{" + ",".join(key.choices) + "}" if key.choices else key.kind.upper()),
                           help=text)


@dataclass(frozen=True)
class ResolvedConfig:
    """Every key's value (``values[dest]``) and where it came from (``sources[dest]``: default, the
    config file's name, or ``command line``). Attribute access reads values: ``cfg.tokens_per_iter``."""

    values: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def section(self, name: str) -> dict[str, Any]:
        """The values of one section, keyed by TOML key name."""
        return {k.name: self.values[k.dest] for k in SCHEMA if k.section == name}


def resolve(flags: Union[argparse.Namespace, Mapping[str, Any]], config: Optional[Union[str, Path]] = None
            ) -> ResolvedConfig:
    """Defaults < TOML file < flags given. ``flags``: a namespace from ``add_arguments`` (only the
    flags given are set) or a ``{dest: value}`` mapping; ``config``: the TOML path (default: the
    namespace's ``--config``). Cross-key rules are checked on the result (HGraphError)."""
    given = dict(vars(flags)) if isinstance(flags, argparse.Namespace) else dict(flags)
    config = config if config is not None else given.pop("config", None)
    given.pop("config", None)
    values = {k.dest: k.default for k in SCHEMA}
    sources = {k.dest: "default" for k in SCHEMA}
    if config is not None:
        for dest, value in load_config(config).items():
            values[dest], sources[dest] = value, Path(config).name
    for dest, value in given.items():
        key = BY_DEST.get(dest)
        if key is None:
            continue             # other options of the subcommand (e.g. a parser's own _run)
        values[dest], sources[dest] = _validate(key, value, "command line"), "command line"
    _check_combination(values, sources)
    return ResolvedConfig(values, sources)


def _check_combination(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    def where(dest: str) -> str:
        key = BY_DEST[dest]
        src = sources[dest]
        return key.flag if src == "command line" else f"[{key.section}] {key.name}" + (
            f" ({src})" if src != "default" else "")
    if values["checkpoint_every"] is not None and values["checkpoint_dir"] is None:
        raise HGraphError(f"{where('checkpoint_every')} needs checkpoint-dir (--checkpoint-dir DIR)")
    if values["resume"] and values["checkpoint_dir"] is None:
        raise HGraphError(f"{where('resume')} needs checkpoint-dir (--checkpoint-dir DIR)")
    if values["resume_fallback"] and not values["resume"]:
        raise HGraphError(f"{where('resume_fallback')} needs resume (--resume)")
    if values["eval_every"] is not None and values["eval_data"] is None:
        raise HGraphError(f"{where('eval_every')} needs eval-data (--eval-data SRC)")
    if values["eval_data"] is not None and values["eval_every"] is None:
        raise HGraphError(f"{where('eval_data')} needs eval-every (--eval-every K)")
    if values["keep_checkpoints"] is not None and values["checkpoint_dir"] is None:
        raise HGraphError(f"{where('keep_checkpoints')} needs checkpoint-dir (--checkpoint-dir DIR)")


# ---- writing a config back -------------------------------------------------------------------------
def _toml_literal(key: ConfigKey, value: Any) -> str:
    if value is None:
        return '"none"'
    if key.kind == "bool":
        return "true" if value else "false"
    if key.kind == "pair":
        return "[" + ", ".join(repr(float(v)) for v in value) + "]"
    if key.kind == "table":
        return _plain_toml(value, key.name)
    if key.kind == "float":
        return repr(float(value))
    if key.kind == "int":
        return str(int(value))
    return json.dumps(value)        # a JSON string is a valid TOML basic string


def _plain_toml(value: Any, name: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value) if not isinstance(value, float) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_plain_toml(v, name) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_plain_toml(v, k)}" for k, v in value.items()) + "}"
    raise HGraphError(f"{name} = {value!r}: only numbers, strings, booleans, lists and tables can be "
                      "written to TOML (TOML has no null)")


def dump_toml(config: Union[ResolvedConfig, Mapping[str, Any]]) -> str:
    """Every key's value as a TOML document (e.g. the ``run.toml`` a run folder keeps); loading it
    back with ``load_config`` gives the same values."""
    values = config.values if isinstance(config, ResolvedConfig) else config
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key in (k for k in SCHEMA if k.section == section):
            lines.append(f"{key.name} = {_toml_literal(key, values.get(key.dest, key.default))}")
        lines.append("")
    return "\n".join(lines)


# ---- help ---------------------------------------------------------------------------------------
def _default_text(key: ConfigKey) -> str:
    if key.default is None:
        return "none"
    if key.kind == "bool":
        return "true" if key.default else "false"
    if key.kind == "pair":
        return ",".join(f"{v:g}" for v in key.default)
    if key.kind == "table":
        return "{}"
    if key.kind == "float":
        return f"{key.default:g}"
    return str(key.default)


def _toml_value(key: ConfigKey) -> str:
    if key.default is None:
        return '"none"'
    if key.kind == "bool":
        return "true" if key.default else "false"
    if key.kind == "pair":
        return "[" + ", ".join(f"{v:g}" for v in key.default) + "]"
    if key.kind == "table":
        return "{}"
    if key.kind in ("str", "path"):
        return f'"{key.default}"'
    return _default_text(key)


def help_text(width: int = 100) -> str:
    """The table as text for ``hgraph train --help``: per section, each key with its type, default,
    allowed values, flag and help."""
    lines = ["Configuration file (--config RUN.toml): the sections and keys below; each key is also the",
             "flag of the same name, and a flag given on the command line overrides the file.", ""]
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key in (k for k in SCHEMA if k.section == section):
            allowed = f"; one of {', '.join(key.choices)}" if key.choices else ""
            head = f"  {key.name} = {_toml_value(key)}"
            desc = f"{key.kind}{allowed}; {key.flag}. {key.help}"
            lines.append(head)
            lines.extend(textwrap.wrap(desc, width=width, initial_indent="      ",
                                       subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


_check_schema()
