"""Cost and memory model: profiles, coefficients, MaxLen, fitting, analytic prior, round trip."""
import json
import math

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.analytic_prior import analytic_cost_model
from hgraph.runtime.planner.cost.cost_model import fit_coefficients, load_cost_model
from hgraph.runtime.planner.cost.profiles import builtin_profile_names, builtin_profiles
from hgraph.strategy import Scheme


def test_builtin_names_and_coefficients_match_file():
    assert builtin_profile_names() == ["llama-13b", "llama-32b", "llama-7b"]
    cm = load_cost_model("llama-7b", world_size=64, gpus_per_node=8)
    entry = builtin_profiles()["llama-7b"]
    for s in entry["schemes"]:
        scheme = Scheme(s["tp"], s["pp"])
        if s["tp"] <= 8:
            assert cm.coeffs(scheme) == (s["a"], s["b"], s["c"])
    assert cm.model.hidden == 4096 and cm.model.layers == 32 and cm.model.vocab == 30592


def test_scheme_filter_world_size_and_node():
    cm = load_cost_model("llama-7b", world_size=4, gpus_per_node=8)
    assert all(s.num_ranks <= 4 for s in cm.schemes)
    assert Scheme(2, 2) in cm.schemes and Scheme(8, 1) not in cm.schemes
    cm16 = load_cost_model("llama-7b", world_size=64, gpus_per_node=8)
    assert Scheme(16, 1) not in cm16.schemes  # TP group would cross a node
    assert Scheme(16, 1) in load_cost_model("llama-7b", world_size=64, gpus_per_node=16).schemes


def test_unknown_profile_names_the_builtins():
    with pytest.raises(HGraphError, match="llama-13b.*llama-32b.*llama-7b"):
        load_cost_model("gpt-9", world_size=8)


def test_unknown_scheme_error_lists_available():
    cm = load_cost_model("llama-7b", world_size=8)
    with pytest.raises(HGraphError, match="TP3PP1 is not available"):
        cm.coeffs(Scheme(3, 1))


def test_time_functions():
    cm = load_cost_model("llama-13b", world_size=16)
    s = Scheme(2, 2)
    a, b, c = cm.coeffs(s)
    assert cm.seq_time(1000, s) == pytest.approx(a * 1e6 + b * 1000)
    arr = cm.seq_time(np.array([10, 1000]), s)
    assert arr.shape == (2,) and arr[1] == pytest.approx(a * 1e6 + b * 1000)
    assert cm.microbatch_time([10, 1000], s) == pytest.approx(a * (100 + 1e6) + b * 1010 + c)
    assert cm.pipeline_time([3.0, 5.0, 4.0], s) == pytest.approx((2 - 1 + 3) * 5.0)
    assert cm.pipeline_time([], s) == 0.0


def test_max_len_matches_memory_model_by_hand():
    cm = load_cost_model("llama-32b", world_size=64)
    H, layers, V = 6656, 60, 30592
    s = Scheme(8, 2)
    states = layers * H * H / 64 * 201 * 0.75 + layers / 2 * H * H / 8 * 201 * 0.25
    emb = H * V / 64 * 16 * 0.75 + H * V / 8 * 16 * 0.25
    free = 85198897152 - 10737418240 - 5242880000 - states - emb
    assert cm.max_len(s) == math.floor(free / (layers * H / 8 * 42))
    # CP divides the activation term: twice the tokens fit.
    assert abs(cm.max_len(Scheme(8, 2, 2)) - 2 * cm.max_len(s)) <= 2
    assert cm.util_len(Scheme(8, 2, 2)) == 2 * cm.util_len(s) == 2048


def test_cp_coefficients_derived():
    cm = load_cost_model("llama-7b", world_size=64)
    a, b, c = cm.coeffs(Scheme(4, 2))
    a2, b2, c2 = cm.coeffs(Scheme(4, 2, 2))
    assert a2 == pytest.approx(a / 2) and b2 == pytest.approx(b / (2 * cm.cp_efficiency)) and c2 == c
    assert load_cost_model("llama-7b", world_size=64, max_cp=1).schemes == [
        s for s in cm.schemes if s.cp == 1]


def test_path_and_path_name(tmp_path):
    data = {"_about": "x", "m1": builtin_profiles()["llama-7b"], "m2": builtin_profiles()["llama-13b"]}
    multi = tmp_path / "multi.json"
    multi.write_text(json.dumps(data))
    with pytest.raises(HGraphError, match="several models"):
        load_cost_model(str(multi), world_size=8)
    cm = load_cost_model(f"{multi}:m2", world_size=8)
    assert cm.name == "m2" and cm.model.hidden == 5120
    with pytest.raises(HGraphError, match="no model 'm3'"):
        load_cost_model(f"{multi}:m3", world_size=8)
    single = tmp_path / "single.json"
    single.write_text(json.dumps({"only": builtin_profiles()["llama-13b"]}))
    assert load_cost_model(str(single), world_size=8).name == "only"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HGraphError, match="not valid JSON"):
        load_cost_model(str(bad), world_size=8)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"m": {"model": {}}}))
    with pytest.raises(HGraphError, match="lacks"):
        load_cost_model(str(broken), world_size=8)


def test_profile_dict_round_trip(tmp_path):
    cm = load_cost_model("llama-32b", world_size=64, cp_efficiency=0.8)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(cm.to_profile_dict()))
    back = load_cost_model(str(path), world_size=64)
    assert back.schemes == cm.schemes and back.cp_efficiency == 0.8
    for s in cm.schemes:
        assert back.coeffs(s) == cm.coeffs(s) and back.max_len(s) == cm.max_len(s)
        assert back.util_len(s) == cm.util_len(s)


def test_fit_coefficients_recovers_quadratic():
    a, b, c = 2e-6, 0.05, 12.0
    pts = [(l, a * l * l + b * l + c) for l in (128, 512, 1024, 4096, 8192)]
    fa, fb, fc = fit_coefficients(pts)
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6) and fc == pytest.approx(c, rel=1e-6)


def test_fit_coefficients_drops_negative_quadratic():
    pts = [(128, 10.0), (256, 20.5), (512, 40.0), (1024, 80.0)]
    a, b, c = fit_coefficients(pts)
    assert a == 0.0 and b > 0
    with pytest.raises(HGraphError, match="3 distinct lengths"):
        fit_coefficients([(1, 1.0), (2, 2.0), (2, 2.0)])


def test_analytic_prior_shapes():
    cm = analytic_cost_model("x", hidden=4096, layers=32, vocab=32000, world_size=64)
    assert dict(cm.memory.activation_coeff)[1] == pytest.approx(34.0)
    a1, b1, c1 = cm.coeffs(Scheme(1, 2))
    a2, b2, c2 = cm.coeffs(Scheme(2, 2))
    assert a2 == pytest.approx(a1 / 2) and b2 > b1 / 2  # TP communication adds to the linear term
    a4, _, c4 = cm.coeffs(Scheme(1, 4))
    assert a4 == pytest.approx(a1 / 2) and c4 == pytest.approx(c1 / 2)
    # Same ballpark as the profiled A800 figures (within 2x) for the 7B model.
    prof = load_cost_model("llama-7b", world_size=64)
    for s in (Scheme(2, 1), Scheme(4, 2), Scheme(8, 1)):
        assert 0.5 < cm.coeffs(s)[1] / prof.coeffs(s)[1] < 2
        assert 0.5 < cm.max_len(s) / prof.max_len(s) < 2
    with pytest.raises(HGraphError):
        analytic_cost_model(hidden=0, layers=1, vocab=1, world_size=1)


def test_ulysses_divides_the_activation_memory_like_cp_but_is_never_priced_or_proposed_yet():
    cm = load_cost_model("llama-32b", world_size=64)
    memory, s = cm.memory, Scheme(8, 2)
    assert memory.max_len(cm.model, Scheme(8, 2, ul=2), 64) == memory.max_len(cm.model, Scheme(8, 2, 2), 64)
    assert abs(memory.max_len(cm.model, Scheme(8, 2, ul=2), 64) - 2 * cm.max_len(s)) <= 2
    assert all(p.ul == 1 for p in cm.schemes)      # the planner's candidates: no Ulysses scheme yet
    assert not cm.has(Scheme(8, 2, ul=2))
    with pytest.raises(HGraphError, match="TP8PP2UL2 is not available"):
        cm.coeffs(Scheme(8, 2, ul=2))
