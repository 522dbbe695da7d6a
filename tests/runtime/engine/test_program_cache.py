"""The executor's one cache of per-strategy Programs and this rank's state for each."""
import threading
import time

import pytest

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.engine.program_cache import ProgramCache
from hgraph.runtime.train.model_setup import build_model, make_optimizer
from hgraph.runtime.train.config import TrainConfig
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
    assert set(info) == {"hits", "misses", "programs", "ahead", "max_hit_switch_ms", "build_s", "max_build_s"}
    assert info["programs"] == 2 and info["hits"] == 2 and info["ahead"] == 0 and info["build_s"] > 0


def test_a_strategy_built_ahead_is_built_on_the_background_thread_and_found_as_a_hit():
    """``build_ahead`` builds the Program and prepares the state off the calling thread; the lookup
    takes the result (a hit, timed apart from the build). A failing build raises at its lookup."""
    compiled = hgraph.compile(llama.build("tiny", num_layers=2))
    cache = ProgramCache(compiled, Cluster(2))
    a = Strategy.parse("1xTP2PP1")
    threads = []

    def prepare(program):
        threads.append(threading.current_thread())
        return f"state of {program.strategy}"
    assert cache.build_ahead(a, prepare)
    assert not cache.build_ahead(a, prepare)           # already being built: not twice
    entry, hit = cache.find(a)
    assert hit and entry.ahead and entry.build.ahead and entry.state == "state of 1xTP2PP1"
    assert threads and threads[0] is not threading.main_thread()
    assert entry.build.build_s > 0 and entry.build.started_at < time.perf_counter()
    assert not cache.build_ahead(a, prepare)           # built
    assert (cache.hits, cache.misses) == (1, 0) and cache.info()["ahead"] == 1
    # a Program built before any step (``Executor.prepare``): only the state is prepared ahead
    b = Strategy.parse("2xTP1PP1")
    program = cache.find(b, count=False)[0].program
    assert cache.build_ahead(b, prepare)
    deadline = time.monotonic() + 60
    while b not in cache.states() and time.monotonic() < deadline:     # a finished build's state is listed
        time.sleep(0.01)
    assert cache.states()[b] == "state of 2xTP1PP1"
    entry, hit = cache.find(b)
    assert hit and entry.ahead and entry.program is program and entry.state == "state of 2xTP1PP1"
    bad = Strategy.parse("1xTP2PP1CP2")      # 4 ranks on a cluster of 2
    cache.build_ahead(bad, prepare)
    with pytest.raises(Exception):
        cache.find(bad)
    cache.close()


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


def test_a_program_given_to_the_executor_keeps_the_compilers_graph(one_rank):
    """The executor sets its working parameters on its own copy of a rank's graph: a Program built
    elsewhere (the compiled module caches it) is left as the compiler made it."""
    cfg = TrainConfig.from_values(model="tiny", model_args={"num_layers": 1}, world_size=1,
                                  strategy_schedule="1xTP1PP1", steps=1, tokens_per_iter=64, lr=1e-4)
    compiled = hgraph.compile(build_model(cfg))
    program = compiled.instantiate("1xTP1PP1")
    gm = program.rank(0).graph_module
    before = dict(gm.named_parameters())
    ex = Executor(compiled, make_optimizer(cfg, compiled, 0, 1), 0, 1, GroupCache(0, 1))
    docs = [list(d) for d in synthetic_documents(4, 256, 32, seed=1)]
    ex.step(program, [[MicroBatch.pack(docs)]], sum(len(d) - 1 for d in docs))
    after = dict(gm.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
