"""The analytic prior ``model_cost_model`` builds for a model's shape keeps its Ulysses schemes when the
model has attention dropout, which trains under Ulysses (``test_ulysses``)."""
from hgraph.frontends.zoo import llama
from hgraph.runtime.planner.service.iteration import model_cost_model


def test_ulysses_schemes_follow_the_heads_with_and_without_attention_dropout():
    plain = model_cost_model("analytic", llama.build("tiny"), 4)
    dropout = model_cost_model("analytic", llama.build("tiny", attention_dropout=0.1), 4)
    assert {s.ul for s in plain.schemes} - {1}, "the tiny model's heads allow Ulysses"
    assert [str(s) for s in dropout.schemes] == [str(s) for s in plain.schemes]
