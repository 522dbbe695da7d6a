"""Relief (recomputation, offload) lengthens a scheme's MaxLen by what the activation model says, a
micro-batch past the plain MaxLen carries the relief's time, and the planner weighs "a narrow scheme
and its relief" against "a wider scheme"."""
import math

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.cost_model import load_cost_model, with_activation_budget, with_offload
from hgraph.runtime.planner.schedule.offload import layer_roles, with_host_link
from hgraph.runtime.planner.schedule.recompute import recompute_extra_ms, stage_activation_model
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.strategy import Scheme, Strategy

TP4 = Scheme(4, 1, 1)


@pytest.fixture(scope="module")
def cost():
    return load_cost_model("llama-7b", 8)


def _room(cost, scheme):
    return cost.memory.activation_room(cost.model, scheme, cost.world_size)


def test_recomputation_lengthens_maxlen_by_the_checkpoints(cost):
    room = _room(cost, TP4)
    plain = cost.max_len(TP4)
    assert plain == int(room // cost.memory.activation_bytes_per_token(cost.model, TP4))
    rec = with_activation_budget(cost, room)          # the engine recomputes under the device's room
    m, L = stage_activation_model(cost, TP4), cost.model.layers
    # the least peak per token: L - 1 checkpoints and one stash (recomputing the last layer too
    # frees nothing: its replay stashes it again beside the L checkpoints)
    per_token = min(m.peak((1, 0), L, r) for r in range(L + 1))
    assert per_token == (L - 1) * m.checkpoint_per_token + m.layer_per_token
    longest = rec.max_len(TP4)
    assert abs(longest - room / per_token) <= 1 and longest > 4 * plain
    assert rec.plain_max_len(TP4) == plain
    # the micro-batch at the new MaxLen recomputes L - 1 layers and pays their forward
    a, b, c = cost.coeffs(TP4)
    compute = a * longest ** 2 + b * longest
    assert rec.microbatch_time([longest], TP4) == pytest.approx(compute + c + (L - 1) * compute / L / 3)
    assert recompute_extra_ms(rec, [longest], TP4, room) == (pytest.approx((L - 1) * compute / L / 3), L - 1)
    # one micro-batch under the plain MaxLen is not relieved and pays nothing more
    assert rec.microbatch_time([plain // 2], TP4) == pytest.approx(cost.microbatch_time([plain // 2], TP4))


def test_offload_lengthens_maxlen_within_the_host_budget(cost):
    room, plain = _room(cost, TP4), cost.max_len(TP4)
    auto = with_offload(cost, "auto", math.inf)
    m, L = stage_activation_model(cost, TP4), cost.model.layers
    # layers offloaded (nothing kept on the device) down to the two stashes backward holds anyway
    # (the one brought back and the one prefetched below it)
    longest = auto.max_len(TP4)
    assert abs(longest - room / (m.other_per_token + 2 * m.layer_per_token)) <= 1
    roles, _ = layer_roles(auto, [longest], TP4, room, offload="auto")
    assert roles.fits and (roles.recompute, roles.offload) == (0, L - 2) and roles.predicted_peak <= room
    # the host holds the offloaded stashes: a host budget of half of them halves what offload reaches
    host = m.host((longest, 0), L) / 2
    bounded = with_offload(cost, "auto", host)
    assert plain < bounded.max_len(TP4) < longest
    roles, _ = layer_roles(bounded, [bounded.max_len(TP4)], TP4, room, offload="auto", host_budget_bytes=host)
    assert roles.fits and roles.host_bytes <= host
    # past the plain MaxLen the micro-batch time carries the relief, priced as layer_roles prices it
    slow = with_host_link(auto, {"bytes_per_s": 2e9, "source": "test"})
    l = 3 * plain
    roles, _ = layer_roles(slow, [l], TP4, room, offload="auto")
    assert roles.extra_ms > 0 and slow.relief_ms([l], TP4) == pytest.approx(roles.extra_ms)
    assert slow.microbatch_time([l], TP4) == pytest.approx(cost.microbatch_time([l], TP4) + roles.extra_ms)
    assert slow.relief_ms([plain // 2], TP4) == 0.0


def test_a_long_document_goes_to_the_narrow_scheme_with_relief_unless_the_host_link_is_slow(cost):
    narrow, wide = Strategy.parse("2xTP4PP1"), Strategy.parse("1xTP8PP1")
    lengths = np.array([200_000] + [4000] * 16)
    # past TP4's plain MaxLen, and past what recomputation alone reaches there: only offload holds it
    assert cost.max_len(TP4) < with_activation_budget(cost, _room(cost, TP4)).max_len(TP4) < 200_000
    with pytest.raises(HGraphError, match="no candidate strategy holds the longest document"):
        plan_iteration(lengths, [narrow, wide], cost)       # without relief no scheme holds it
    fast = with_offload(with_host_link(cost, {"bytes_per_s": 100e9, "source": "test"}), "auto", math.inf)
    plan = plan_iteration(lengths, [narrow, wide], fast)
    assert plan.strategy == narrow
    holder = next(p for p in plan.pipelines if any(0 in mb for mb in p.microbatches))
    assert holder.scheme == TP4 and [0] in holder.microbatches      # alone in its micro-batch
    slow = with_offload(with_host_link(cost, {"bytes_per_s": 2e9, "source": "test"}), "auto", math.inf)
    assert slow.microbatch_time([200_000], TP4) > fast.microbatch_time([200_000], TP4)
    assert plan_iteration(lengths, [narrow, wide], slow).strategy == wide


def test_the_engine_relieves_under_the_budget_the_planner_priced(cost):
    """``--offload auto`` without ``--memory-budget``: the engine's budget for a scheme is the
    planner's relief budget (the device's room), so a micro-batch placed past the plain MaxLen is
    relieved to fit; ``--memory-budget`` is the one budget of both."""
    from types import SimpleNamespace

    from hgraph.runtime.train.step_modes import engine_memory_budget

    planner = SimpleNamespace(cost=with_offload(cost, "auto", math.inf))
    budget = engine_memory_budget(SimpleNamespace(planner=SimpleNamespace(memory_budget=None, offload="auto")), planner)
    assert budget(TP4) == planner.cost.relief_budget(TP4) == _room(cost, TP4)
    assert budget(Scheme(64, 1, 1)) is None                      # a scheme the cost model does not price
    m = stage_activation_model(cost, TP4)
    l = planner.cost.max_len(TP4)
    assert m.peak((l, 0), cost.model.layers, 0) > budget(TP4)   # past the plain MaxLen: relief needed
    roles, _ = layer_roles(planner.cost, [l], TP4, budget(TP4), offload="auto")
    assert roles.fits and roles.predicted_peak <= budget(TP4)
    given = SimpleNamespace(planner=SimpleNamespace(memory_budget=5e9, offload="auto"))
    assert engine_memory_budget(given, planner) == 5e9
    assert engine_memory_budget(SimpleNamespace(planner=SimpleNamespace(memory_budget=None, offload="on")),
                                planner) is None
