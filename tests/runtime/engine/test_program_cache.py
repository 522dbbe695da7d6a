"""The run's one cache of per-strategy Programs and this rank's state for each."""
import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.engine.program_cache import ProgramCache
from hgraph.strategy import Cluster, Strategy


def test_a_strategy_is_built_once_and_its_state_kept_with_it():
    compiled = hgraph.compile(llama.build("tiny", num_layers=2))
    cache = ProgramCache(compiled, Cluster(2))
    a, b = Strategy.parse("2xTP1PP1"), Strategy.parse("1xTP2PP1")
    prog = cache.get(a)
    assert cache.get(a) is prog and cache.get(b) is not prog
    assert (cache.hits, cache.misses) == (1, 2)
    assert cache.get(a) is not compiled.instantiate(a, Cluster(2))   # not the compiled module's cache
    assert cache.state(prog) is None
    cache.keep_state(prog, "state of a")
    assert cache.state(prog) == "state of a" and cache.states() == {a: "state of a"}
    info = cache.info()
    assert set(info) == {"hits", "misses", "programs", "max_hit_switch_ms", "compile_s"}
    assert info["programs"] == 2 and info["hits"] == 2


def test_a_program_built_elsewhere_is_kept_under_its_strategy_without_counting():
    compiled = hgraph.compile(llama.build("tiny", num_layers=2))
    cache = ProgramCache(compiled, Cluster(2))
    mine = cache.get(Strategy.parse("2xTP1PP1"))
    other = compiled.instantiate("2xTP1PP1", Cluster(2))
    assert cache.state(other) is None
    cache.keep_state(other, "state of other")
    assert cache.state(other) == "state of other" and cache.state(mine) is None
    assert (cache.hits, cache.misses) == (0, 1)
