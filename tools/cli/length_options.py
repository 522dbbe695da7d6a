"""Options shared by the planner commands (``plan``, ``propose``, ``pack``, ``simulate``).

``add_workload_options`` declares the dataset / cluster options they have in common (``--lengths``,
``--profile``, ``--world-size``, ``--gpus-per-node``, ``--device-memory``, ``--max-len``, and
``--offload`` / ``--host-memory-budget``: the relief the engine would apply, which lengthens every
scheme's MaxLen and prices its micro-batches: ``schedule.relief``).

Length handling shared by ``hgraph propose``, ``pack`` and ``simulate``:

Documents longer than the context ``--max-len`` are truncated to it (the papers' practice; ``plan``
does the same) except where a command says otherwise; documents that no scheme can hold are an
error naming the longest one and the largest MaxLen, unless ``--long truncate|drop`` asks to cut
them to the largest MaxLen or to leave them out.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.engine.offload import OFFLOAD_MODES, rank_host_budget
from hgraph.frontends.zoo import ZOO_CONFIGS, zoo_names
from hgraph.runtime.planner.cost.cost_model import load_cost_model, with_offload
from hgraph.runtime.planner.service.iteration import config_cost_model
from hgraph.tools.cli.common_options import DEVICE_MEMORY_FORMS, add_device_memory, add_gpus_per_node, add_world_size
from hgraph.runtime.train.run_config import parse_bytes

LONG_CHOICES = ("error", "truncate", "drop")


ANALYTIC_PREFIX = "analytic:"


def analytic_config(ref: str):
    """The zoo config named by ``analytic:FAMILY:NAME`` (``--profile``: the analytic prior of its shape)."""
    spec = ref[len(ANALYTIC_PREFIX):]
    family, _, name = spec.partition(":")
    configs = ZOO_CONFIGS.get(family)
    if family == "hf" or configs is None or name not in configs:
        raise HGraphError(f"--profile {ref!r}: analytic: takes a zoo model, one of "
                          f"{', '.join(n for n in zoo_names() if not n.startswith('hf:'))}")
    return configs[name]


def profile_cost_model(ref: str, *, world_size: int, gpus_per_node: int, gpu_memory_bytes=None, **options):
    """``load_cost_model`` of ``ref``, or for ``analytic:FAMILY:NAME`` the analytic prior of that zoo
    config's shape (``config_cost_model``: a MoE config's experts and EP schemes included) with
    ``options`` (``max_cp``, ``max_ul``) and the device memory applied."""
    if not ref.startswith(ANALYTIC_PREFIX):
        return load_cost_model(ref, world_size=world_size, gpus_per_node=gpus_per_node,
                               gpu_memory_bytes=gpu_memory_bytes, **options)
    cost = config_cost_model(analytic_config(ref), world_size, gpus_per_node)
    changes = {k: v for k, v in options.items() if v is not None}
    if gpu_memory_bytes is not None:
        changes["memory"] = replace(cost.memory, gpu_memory_bytes=int(gpu_memory_bytes))
    return replace(cost, name=ref, **changes)


def workload_cost_model(args, **options):
    """The cost model of ``--profile`` on ``--world-size`` GPUs of ``--device-memory`` each (``options``
    go to ``load_cost_model``); a profile none of whose schemes fits the cluster is a one-line error.
    ``--profile analytic:FAMILY:NAME`` is the analytic prior of a zoo config (``profile_cost_model``).
    Without ``max_cp`` in ``options``, CP degrees grow past the profile's until a scheme holds
    ``--max-len`` tokens (or the cluster is too small for more)."""
    memory = None if args.device_memory is None else int(parse_bytes(args.device_memory, "--device-memory"))
    offload = getattr(args, "offload", "off")
    host = None
    if offload != "off":
        host = rank_host_budget(parse_bytes(args.host_memory_budget, "--host-memory-budget"),
                                args.gpus_per_node, args.world_size)

    def load(**more):
        return with_offload(profile_cost_model(args.profile, world_size=args.world_size,
                                               gpus_per_node=args.gpus_per_node, gpu_memory_bytes=memory,
                                               **{**options, **more}), offload, host)

    cost = load()
    context = getattr(args, "max_len", None)
    if options.get("max_cp") is None and context is not None:
        # No CP degree asked for: derive CP schemes up to the smallest power of two whose MaxLen
        # holds the context (2048K tokens of llama-32b need CP 16 x UL 13, or CP 128 without Ulysses),
        # within the cluster.
        max_cp = cost.max_cp
        while cost.largest_max_len() < context and max_cp * 2 <= args.world_size:
            max_cp *= 2
            cost = load(max_cp=max_cp)
    if not cost.schemes:
        raise HGraphError(
            f"no scheme of profile {cost.name!r} fits {args.world_size} GPUs with {args.gpus_per_node} per node "
            "(each scheme needs TP*PP*CP GPUs, TP inside one node, and model states that fit in memory)")
    return cost


def add_workload_options(p, *, max_len_help: str = "context length") -> None:
    """``--lengths FILE --profile NAME|FILE --world-size N [--gpus-per-node G] [--device-memory SIZE]
    --max-len L``."""
    p.add_argument("--lengths", required=True, metavar="FILE",
                   help="document lengths: one integer per line, or JSONL objects with input_ids")
    p.add_argument("--profile", required=True, metavar="NAME|FILE",
                   help="cost profile: llama-7b, llama-13b, llama-32b, a profile file, FILE:NAME, or "
                        "analytic:FAMILY:NAME (the analytic prior of a zoo config, e.g. analytic:llama-moe:16b)")
    add_world_size(p, required=True, old_gpus=True, help="number of GPUs")
    add_gpus_per_node(p)
    add_device_memory(p, help=f"memory of one GPU: {DEVICE_MEMORY_FORMS} (default: the profile's own)")
    p.add_argument("--max-len", required=True, type=int, metavar="L", help=max_len_help)
    p.add_argument("--offload", choices=OFFLOAD_MODES, default="off",
                   help="activation relief as hgraph train --offload without a memory budget: auto (a micro-batch "
                        "past a scheme's device memory recomputes or offloads layers, the cheaper way), on (every "
                        "layer offloaded), off (default: MaxLen with every activation on the device)")
    p.add_argument("--host-memory-budget", default=None, metavar="BYTES",
                   help="host bytes of offloaded activations per GPU with --offload (default: half this host's "
                        "RAM over --gpus-per-node)")


def add_long_option(p, what: str) -> None:
    p.add_argument("--long", choices=LONG_CHOICES, default="error",
                   help=f"documents longer than {what}: error (default), truncate them to it, or drop them")


def limit_lengths(lengths: np.ndarray, limit: int, policy: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Apply ``policy`` to documents longer than ``limit``: (lengths, their indices in the file)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    index = np.arange(lengths.size, dtype=np.int64)
    over = lengths > limit
    if not over.any():
        return lengths, index
    if policy == "truncate":
        return np.minimum(lengths, limit), index
    if policy == "drop":
        if over.all():
            raise HGraphError(f"every document is longer than {what} ({limit} tokens); nothing left after --long drop")
        return lengths[~over], index[~over]
    i = int(np.argmax(lengths))
    raise HGraphError(f"document {i} has {int(lengths[i])} tokens, more than {what} ({limit}); "
                      "pass --long truncate or --long drop to cut or skip such documents")
