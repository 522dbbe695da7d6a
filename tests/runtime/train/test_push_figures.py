"""The step's push over all ranks (``metrics.step_push_figures``): what the step pays for its push is
counted from the backward that ended last, not from a rank that finished early and waited."""
import math

from hgraph.runtime.train.metrics import step_push_figures


def test_exposed_push_counts_from_the_last_backward():
    # (first issue, backward end, push end), seconds: rank 1's backward ends last, at 10.0
    rows = [[9.0, 9.5, 10.2, 0.0], [9.8, 10.0, 10.1, 0.0]]
    figures = step_push_figures(rows)
    assert math.isclose(figures["step_push_ms"], 400.0)           # rank 1's first issue -> the last end
    assert math.isclose(figures["step_push_exposed_ms"], 200.0)   # 10.0 -> 10.2, not rank 0's 700 ms


def test_a_push_issued_after_the_last_backward_is_all_exposed_and_missing_times_give_none():
    rows = [[10.5, 10.0, 11.0], [10.6, 9.0, 10.9]]
    figures = step_push_figures(rows)
    assert math.isclose(figures["step_push_ms"], 500.0)
    assert math.isclose(figures["step_push_exposed_ms"], figures["step_push_ms"])
    nan = float("nan")
    assert step_push_figures([[nan, nan, nan]]) == {"step_push_ms": None, "step_push_exposed_ms": None}
