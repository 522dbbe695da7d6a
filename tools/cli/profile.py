"""``hgraph profile``: measure a cost profile (a, b, c per scheme, memory constants) on this machine.

Dual-layer profiling (the Data-Centric Parallel paper's method): the model is timed with 1 and 2
decoder layers, forward + backward, per sequence length; the difference is one layer, extrapolated to
the layers of one pipeline stage.
The written file has the format of the built-in profiles, so ``--profile FILE`` reads it back.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama
from hgraph.runtime.planner.cost.profiler import profile_cost_model
from hgraph.runtime.train.devices import CPU_WORLD_SIZE
from hgraph.strategy import Scheme
from hgraph.tools.cli.common_options import DEVICE_MEMORY_FORMS, add_device_memory
from hgraph.runtime.train.run_config import parse_bytes


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure a cost profile of a model on this machine", description=__doc__)
    p.add_argument("--model", required=True, metavar="llama:NAME", help="model of the zoo, e.g. llama:tiny")
    p.add_argument("--model-args", default=None, metavar="JSON", help='config overrides, e.g. \'{"hidden_size": 128}\'')
    p.add_argument("--schemes", default="TP1PP1", metavar="S1,S2", help="schemes to profile (TP1 only on CPU)")
    p.add_argument("--lengths", default="128,256,512,1024", metavar="L1,L2,...", help="sequence lengths to time")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads while timing (default: what one rank of hgraph train's local CPU run has, "
                        "the cores over its 4 processes, at least 1; torch's own with OMP_NUM_THREADS set)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per point (the fastest counts), after 2 warm-up runs")
    p.add_argument("--name", default=None, help="profile name in the file (default: the model spec)")
    add_device_memory(p, default="80G", old_gib_flag=True,
                      help=f"memory of one device for the profile's memory model: {DEVICE_MEMORY_FORMS} (default 80G)")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write the profile file here")
    p.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    return p


# predicted / measured of the whole-model check within which the profile is taken to agree with itself
CHECK_AGREES = (0.8, 1.25)


def rank_threads() -> int | None:
    """The torch threads one rank of ``hgraph train``'s local CPU run has (``runtime.train.launch``:
    the cores over its processes), None (torch's) when ``OMP_NUM_THREADS`` says."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // CPU_WORLD_SIZE)


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HGraphError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 2:
        raise HGraphError(f"--{what} needs integers >= 2, got {text!r}")
    return values


def _build_model(spec: str, args_json: str | None):
    family, _, name = spec.partition(":")
    if family != "llama" or not name:
        raise HGraphError(f"unknown model {spec!r}: expected llama:NAME (e.g. llama:tiny)")
    overrides = {}
    if args_json:
        try:
            overrides = json.loads(args_json)
        except json.JSONDecodeError as exc:
            raise HGraphError(f"--model-args is not valid JSON: {exc.msg}") from None
        if not isinstance(overrides, dict):
            raise HGraphError("--model-args must be a JSON object of config fields")
    config = llama.make_config(name, **overrides)
    return llama, config


def run(args: argparse.Namespace) -> int:

    schemes = []
    for part in args.schemes.split(","):
        if part.strip():
            schemes.append(Scheme.parse(part))
    if not schemes:
        raise HGraphError("--schemes is empty: give e.g. TP1PP1,TP1PP2")
    lengths = _parse_ints(args.lengths, "lengths")
    if args.repeats < 1:
        raise HGraphError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise HGraphError(f"--threads must be >= 1, got {args.threads}")
    threads = args.threads if args.threads is not None else rank_threads()
    llama, config = _build_model(args.model, args.model_args)
    h = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    params_per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size + 2 * h

    cost, raw = profile_cost_model(
        args.name or args.model, lambda n: llama.build(config, num_layers=n), hidden=h, layers=config.num_layers,
        vocab=config.vocab_size, params_per_layer=params_per_layer, schemes=schemes, lengths=lengths,
        repeats=args.repeats, threads=threads, gpu_memory_bytes=int(parse_bytes(args.device_memory, "--device-memory")),
        device=f"cpu ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
               f"{threads or torch.get_num_threads()} threads)")
    profile = cost.to_profile_dict()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(profile, f, indent=1)
            f.write("\n")
    if args.json:
        json.dump(profile, sys.stdout)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout
    out.write(f"profiled {args.model} ({config.num_layers} layers, hidden {h}) on {raw['device']}\n")
    out.write("  per-layer fwd+bwd ms: " + ", ".join(f"l={l}: {t:.3f}" for l, t in zip(lengths, raw["layer_ms"])) + "\n")
    out.write(f"  {'scheme':<10} {'a':>12} {'b':>12} {'c':>10}\n")
    for s in schemes:
        a, b, c = cost.coeffs(s) if cost.has(s) else cost.profiled[(s.tp, s.pp, s.cp)]
        out.write(f"  {str(s):<10} {a:>12.4g} {b:>12.4g} {c:>10.4g}\n")
    check = raw["check"]
    out.write(f"  check: the whole {check['layers']}-layer model at l={check['length']}: measured "
              f"{check['measured_ms']:.3f} ms, the profile gives {check['predicted_ms']:.3f} ms ({check['ratio']:.2f}x)"
              + ("" if CHECK_AGREES[0] <= check["ratio"] <= CHECK_AGREES[1] else
                 "; they disagree: the machine was busy while timing (other processes, or threads waiting for "
                 "each other): profile again, with --threads 1 or more --repeats")
              + "\n")
    A = dict(cost.memory.activation_coeff)[1]
    out.write(f"  activation A = {A:.2f} bytes/token/layer per hidden (measured), "
              f"UtilLen(TP1) = {cost.util_len_tokens[1]}\n")
    if args.output:
        out.write(f"wrote {args.output} (load it with --profile {args.output})\n")
    return 0
