"""Throughput of a training step: tokens/s, model TFLOP/s per device and MFU.

Model FLOPs count what the model computes, whatever the strategy runs (recomputation, TP/CP
communication and padding are not counted), as Megatron-LM and torchtitan count them so that the
figures compare with theirs:

* ``6 * P * tokens``: every matmul weight (``P``: the weights of the graph's linear ops, the output
  head included, the embedding lookups not) multiplies each token once forward and twice backward;
* ``12 * W * sum(l**2)`` over the step's documents: attention's two ``l x l`` matmuls (``W``: heads x
  head size, summed over the attention layers), forward and backward, on the full score matrix
  (not halved for the causal mask, as both count it). A packed micro-batch attends within each
  document, so the quadratic term is per document: a step of many short documents does far less
  attention work than one of a few long ones with as many tokens.

MFU = achieved model TFLOP/s per device / the device's dense bf16 peak (``peak_tflops``: the table of
known GPUs below, or ``--peak-tflops``); none on CPU or on a GPU the table does not know.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hgraph.meta import OpKind, get_meta

#: dense bf16 peak TFLOP/s (tensor cores, no sparsity) of known GPUs, matched in order against
#: ``torch.cuda.get_device_name`` (every word of a key is a word of the name, case aside)
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),          # SXM (HBM3); the PCIe and NVL cards are matched above
    ("H800 PCIe", 756.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def known_peak_tflops(device_name: str) -> Optional[float]:
    """The table's dense bf16 peak for a GPU's name, None when it is not in the table."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for key, peak in PEAK_BF16_TFLOPS:
        if all(word in words for word in key.lower().split()):
            return peak
    return None


def device_peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """``override`` if given, else the table's peak of a CUDA device; None on CPU or an unknown GPU."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    return known_peak_tflops(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class ModelFlops:
    """What the model FLOPs of a step depend on: matmul weights and attention width."""

    matmul_params: int
    attention_width: int

    @classmethod
    def of(cls, compiled: Any) -> "ModelFlops":
        """From a compiled model's HGraph: the weights of its linear ops (each use, so a tied weight
        counts for the head) and, per attention op, heads x head size of its query."""
        hg = compiled.hgraph
        params = 0
        for node in hg.gm.graph.nodes:
            m = get_meta(node)
            if m.op == OpKind.LINEAR and m.param is not None:
                shape = hg.params[m.param].shape
                params += int(torch.Size(shape).numel())
        attention_ops = sum(1 for n in hg.gm.graph.nodes if get_meta(n).op == OpKind.ATTENTION)
        cfg = hg.model_config
        width = attention_ops * int(cfg.num_heads or 0) * int(cfg.head_dim or 0)
        return cls(params, width)

    def step_flops(self, doc_lengths: Sequence[int]) -> float:
        """Model FLOPs of one training step (forward and backward) on documents of these lengths."""
        tokens = sum(int(n) for n in doc_lengths)
        squares = sum(int(n) * int(n) for n in doc_lengths)
        return 6.0 * self.matmul_params * tokens + 12.0 * self.attention_width * squares


def step_throughput(flops: float, tokens: int, time_s: float, world_size: int,
                    peak_tflops: Optional[float]) -> dict:
    """The per-step figures: ``tokens_per_s``, ``tflops_per_device`` (model TFLOP/s per rank), ``mfu``
    (a fraction; None without a peak) and the ``model_tflop`` and ``peak_tflops`` they come from."""
    seconds = max(time_s, 1e-12)
    per_device = flops / seconds / world_size / 1e12
    return {"tokens_per_s": tokens / seconds, "model_tflop": flops / 1e12, "tflops_per_device": per_device,
            "peak_tflops": peak_tflops, "mfu": per_device / peak_tflops if peak_tflops else None}
