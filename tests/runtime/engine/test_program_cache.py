"""The executor's one cache of per-strategy Programs and this rank's state for each."""
import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.engine.program_cache import ProgramCache
from hgraph.strategy import Cluster, Strategy


def test_a_strategy_is_built_once_and_its_state_kept_with_it():
    compiled = hgraph.compile(llama.build("tiny", num_layers=2))
    cache = ProgramCache(compiled, Cluster(2))
    a, b = Strategy.parse("2xTP1PP1"), Strategy.parse("1xTP2PP1")
    entry, hit = cache.find(a)
    prog = entry.program
    assert not hit and cache.find(a) == (entry, True) and cache.find(b)[0].program is not prog
    assert (cache.hits, cache.misses) == (1, 2)
    assert cache.find(a)[0].program is not compiled.instantiate(a, Cluster(2))   # not the compiled module's cache
    assert entry.state is None
    entry.state = "state of a"
    assert cache.find(a, count=False)[0].state == "state of a" and cache.states() == {a: "state of a"}
    info = cache.info()
    assert set(info) == {"hits", "misses", "programs", "max_hit_switch_ms", "compile_s"}
    assert info["programs"] == 2 and info["hits"] == 2


def test_a_program_built_elsewhere_is_kept_under_its_strategy_without_counting():
    compiled = hgraph.compile(llama.build("tiny", num_layers=2))
    cache = ProgramCache(compiled, Cluster(2))
    mine, _ = cache.find(Strategy.parse("2xTP1PP1"))
    other = compiled.instantiate("2xTP1PP1", Cluster(2))
    adopted = cache.adopt(other)
    assert adopted.program is other and adopted.state is None
    adopted.state = "state of other"
    assert cache.adopt(other).state == "state of other" and mine.state is None
    assert (cache.hits, cache.misses) == (0, 1)
