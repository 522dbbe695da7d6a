"""The run's configuration: frozen sections filled by key, changed only by deriving a new config."""
import dataclasses
import pickle

import pytest

from hgraph.runtime.train.config import SECTION_OF, SECTIONS, TrainConfig


def test_keys_go_to_their_sections_and_unknown_keys_are_refused():
    config = TrainConfig.from_values({"lr": 0.01, "steps": 3}, world_size=2, docs=[[1, 2]], strategy_schedule="2xTP1PP1")
    assert config.optimizer.lr == 0.01 and config.data.steps == 3 and config.cluster.world_size == 2
    assert config.docs == [[1, 2]] and not config.planner_driven
    with pytest.raises(AttributeError, match=r"'lr'; the option is config\.optimizer\.lr"):
        config.lr                                                # an option is read through its section
    assert config.model.model == "llama:tiny"                    # "model" names the section
    with pytest.raises(TypeError, match="lrr"):
        TrainConfig.from_values(lrr=0.1)
    with pytest.raises(AttributeError):
        config.no_such_key


def test_a_config_is_never_changed_only_derived():
    config = TrainConfig.from_values(steps=3)
    later = config.with_values(steps=4, metrics="m.jsonl", resume_from="ck/step-00000002")
    assert (config.data.steps, config.logging.metrics, config.resume_from) == (3, None, None)
    assert (later.data.steps, later.logging.metrics, later.resume_from) == (4, "m.jsonl", "ck/step-00000002")
    assert later.optimizer is config.optimizer                   # untouched sections are shared
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.docs = [[1]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data.steps = 5


def test_values_cover_every_key_once_and_the_config_travels_to_the_ranks():
    config = TrainConfig.from_values(model_args={"num_layers": 2}, memory_budget=2.0 ** 20)
    values = config.values()
    assert set(values) == set(SECTION_OF) and len(SECTION_OF) == sum(len(dataclasses.fields(c))
                                                                        for c in SECTIONS.values())
    assert TrainConfig.from_values(values) == config
    assert pickle.loads(pickle.dumps(config)) == config


def test_an_option_is_a_field_carrying_its_default_and_how_it_is_given():
    from hgraph.runtime.train.option import Option, declared_options, default_of, option

    @dataclasses.dataclass(frozen=True)
    class Section:
        size: int = option(8, kind="int", minimum=1, metavar="N", help="how many")
        table: dict = option(default_factory=dict, kind="table", help="settings")
        derived: int = 0                                          # not an option: no metadata

    declared = {f.name: (default_of(f), opt) for f, opt in declared_options(Section)}
    assert declared == {"size": (8, Option("int", "how many", minimum=1, metavar="N")),
                        "table": ({}, Option("table", "settings"))}
    assert Section().table == {} and Section().table is not Section().table
    with pytest.raises(ValueError, match="option kind 'number'"):
        option(1, kind="number", help="x")
    with pytest.raises(ValueError, match="help"):
        option(1, kind="int", help="")
    # every option of a run is declared so, with its help
    assert all(opt.help for cls in SECTIONS.values() for _, opt in declared_options(cls))
