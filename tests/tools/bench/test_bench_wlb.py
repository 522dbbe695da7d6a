"""The WLB bench's synthetic long tails (lengths the packer was not tuned on) and a tiny run."""
import json

import numpy as np
import pytest

from hgraph.tools.bench import wlb


@pytest.mark.parametrize("shape", ["pareto", "lognormal"])
def test_synthetic_lengths_are_seeded_long_tails(shape):
    a, b = wlb.synthetic_lengths(shape, 3, size=20_000), wlb.synthetic_lengths(shape, 3, size=20_000)
    assert np.array_equal(a, b) and a.min() >= 1
    assert np.percentile(a, 99) > 8 * np.median(a)       # a long tail


def test_wlb_bench_tiny_run_on_a_synthetic_shape(capsys):
    assert wlb.main(["--shape", "pareto", "--batches", "3", "--solver-batches", "1", "--solver-time-limit", "0.1",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows["wlb q=1 cap=memory"]["imbalance"] >= 1.0


def test_wlb_bench_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit) as exc:
        wlb.main(["--batches", "0"])
    assert exc.value.code == 2 and "must be positive" in capsys.readouterr().err
