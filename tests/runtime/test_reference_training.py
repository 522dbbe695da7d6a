"""The noise-aware comparison of trained parameters (``tests/runtime/reference_training.py``) accepts
what Adam does to rounding noise and rejects what a wrong gradient does."""
import pytest
import torch
from tests.runtime.reference_training import (NEGLIGIBLE_GRAD, OUTLIER_FRACTION, STEP_FRACTION, TIGHT,
                                              assert_losses_like, assert_params_like)

LR = 1e-3


def _adam(grads, steps=3):
    p = torch.zeros_like(grads[0], requires_grad=True)
    opt = torch.optim.Adam([p], lr=LR)
    for k in range(steps):
        p.grad = grads[k % len(grads)].clone()
        opt.step()
    return p.detach()


def _gradient(n=4000, near_zero=(7,)):
    g = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 1e-3
    g[list(near_zero)] = 1.06e-8            # pure cancellation: a first gradient next to Adam's eps
    return g


def test_an_ulp_of_a_near_zero_gradient_passes_the_tight_bound_and_is_accepted():
    """The element's gradient is a sum of terms of ~1e-2 that cancel: summed in another order it
    differs by an ulp of those terms (~1e-9), a tenth of itself."""
    g = _gradient()
    other = g.clone()
    term = torch.tensor(1e-2)
    other[7] += torch.nextafter(term, torch.tensor(1.0)) - term
    want, got = _adam([g]), _adam([other])
    diff = (got - want).abs()
    assert float(diff[7]) > TIGHT["atol"] and float(diff.max()) == float(diff[7])    # Adam amplified it
    assert_params_like({"w": want}, {"w": want}, lr=LR, first_grads={"w": g})
    assert_params_like({"w": got}, {"w": want}, lr=LR, first_grads={"w": g})
    assert_params_like({"w": got}, {"w": want}, lr=LR)                 # without gradients: one outlier


def test_an_element_with_a_real_gradient_is_held_to_the_tight_bound():
    g = _gradient()
    want = _adam([g])
    got = want.clone()
    got[100] += 3 * TIGHT["atol"]                           # a wrong update where the gradient is large
    assert abs(float(g[100])) >= NEGLIGIBLE_GRAD
    with pytest.raises(AssertionError, match=r"w: 1 element\(s\) with a first gradient"):
        assert_params_like({"w": got}, {"w": want}, lr=LR, first_grads={"w": g})


def test_more_outliers_than_the_allowed_fraction_fail_even_where_gradients_are_negligible():
    n = 4000
    allowed = int(OUTLIER_FRACTION * n)
    g = torch.zeros(n)                                      # every element negligible
    want = torch.zeros(n)
    got = want.clone()
    got[:allowed] = 2 * TIGHT["atol"]
    assert_params_like({"w": got}, {"w": want}, lr=LR, first_grads={"w": g})
    got[allowed] = 2 * TIGHT["atol"]
    with pytest.raises(AssertionError, match="beyond the tight bound"):
        assert_params_like({"w": got}, {"w": want}, lr=LR, first_grads={"w": g})


def test_no_element_may_move_a_fifth_of_an_adam_step():
    want = torch.zeros(4000)
    got = want.clone()
    got[0] = 1.01 * STEP_FRACTION * LR
    with pytest.raises(AssertionError, match="of one Adam step"):
        assert_params_like({"w": got}, {"w": want}, lr=LR)
    got[0] = float("nan")
    with pytest.raises(AssertionError):
        assert_params_like({"w": got}, {"w": want}, lr=LR)


def test_losses_agree_to_one_part_in_a_million():
    assert_losses_like([2.0, 3.0], [2.0 + 1.9e-6, 3.0])
    with pytest.raises(AssertionError, match="step 1"):
        assert_losses_like([2.0, 3.0], [2.0, 3.0 + 3.1e-6])
    with pytest.raises(AssertionError):
        assert_losses_like([2.0], [2.0, 3.0])
