"""Write the bundled document-length sample ``runtime/data/wikipedia_length_sample.txt``.

The built-in dataset of ``hgraph train`` (``hgraph.runtime.data.builtin``) draws document lengths
from this sample: 20,000 lengths drawn uniformly without replacement (numpy ``default_rng(SEED)``)
from the 1,000,000 real tokenized Wikipedia document lengths in ``../shared/data/wikipedia_lengths.txt``
(beside the repository). Run from a clone: ``python -m hgraph.tools.report.length_sample``; the output is
deterministic, so re-running it reproduces the shipped file byte for byte.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SEED = 20240611
SAMPLE_SIZE = 20_000
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "data" / "wikipedia_lengths.txt"
DEFAULT_OUTPUT = REPO_ROOT / "runtime" / "data" / "wikipedia_length_sample.txt"


def make_sample(source: Path, size: int = SAMPLE_SIZE, seed: int = SEED) -> np.ndarray:
    """``size`` lengths drawn without replacement from the file ``source`` (one integer per line)."""
    lengths = np.array(source.read_text(encoding="utf-8").split(), dtype=np.int64)
    rng = np.random.default_rng(seed)
    return lengths[rng.choice(len(lengths), size=size, replace=False)]


def write_sample(sample: np.ndarray, output: Path, source_name: str, seed: int) -> None:
    header = (f"# {len(sample)} document lengths (tokens) drawn without replacement, numpy default_rng({seed}),\n"
              f"# from {source_name} (1,000,000 tokenized Wikipedia documents; FlexSP's data set).\n"
              "# Produced by hgraph.tools.report.length_sample; one length per line.\n")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(header + "\n".join(str(int(v)) for v in sample) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--size", type=int, default=SAMPLE_SIZE)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    sample = make_sample(args.source, args.size, args.seed)
    write_sample(sample, args.output, args.source.name, args.seed)
    print(f"wrote {len(sample)} lengths to {args.output} (mean {sample.mean():.0f}, "
          f"p50 {np.median(sample):.0f}, p99 {np.percentile(sample, 99):.0f}, max {sample.max()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
