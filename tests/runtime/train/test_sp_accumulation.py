"""The sp-accumulation trainer mode (the Data-Centric Parallel paper's DCP-inter) as a pure plan:
per-batch SP size, every document once, balanced replicas."""
from dataclasses import dataclass

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.sp_accumulation import sp_accumulation_step, sp_size_for
from hgraph.runtime.train.step_modes import sp_accumulation_cost
from hgraph.strategy import Strategy


def time_ms(lengths, scheme):
    """A cost-model shaped micro-batch time: a l^2 + b l per document plus c, divided over CP."""
    return sum(2e-6 * l * l / scheme.cp + 1e-2 * l / scheme.cp for l in lengths) + 0.5


@dataclass(frozen=True)
class Doc:
    index: int
    n: int

    def __len__(self):
        return self.n


def test_sp_size_is_the_smallest_power_of_two_that_holds_the_longest_document():
    assert sp_size_for(8, 8, 8) == 1
    assert sp_size_for(9, 8, 8) == 2
    assert sp_size_for(33, 8, 8) == 8
    assert sp_size_for(9, 6, 8) == 2          # 2 divides 6; 4 would not
    with pytest.raises(HGraphError):
        sp_size_for(65, 8, 8)


def test_every_document_runs_once_and_the_replicas_are_balanced():
    lengths = [30000, 2000, 1500, 800, 700, 650, 600, 500, 400, 300, 250, 200, 100, 90, 80, 60]
    docs = [Doc(i, l) for i, l in enumerate(lengths)]
    step = sp_accumulation_step(docs, 8, 8192, time_ms)
    assert step.sp_size == 4 and str(step.strategy) == "2xTP1PP1CP4"
    got = sorted(d.index for pipe in step.plan for mb in pipe for d in mb)
    assert got == list(range(len(docs)))
    assert all(sum(len(d) for d in mb) <= 4 * 8192 for pipe in step.plan for mb in pipe)
    assert step.accumulation == [len(p) for p in step.plan]
    assert step.idle_fraction <= step.equal_count_idle_fraction
    # LPT: no replica could give its last micro-batch to another and lower the maximum
    assert max(step.est_ms) - min(step.est_ms) <= max(
        time_ms([len(d) for d in mb], step.strategy.pipelines[0]) for p in step.plan for mb in p)


def test_short_documents_keep_plain_data_parallelism():
    step = sp_accumulation_step([Doc(i, 1000 + i) for i in range(20)], 8, 2048, time_ms)
    assert (step.sp_size, str(step.strategy)) == (1, "8xTP1PP1")
    assert min(step.accumulation) >= 1            # 20 documents of ~1000 tokens: every replica works


def test_no_micro_batch_has_fewer_tokens_than_cp_ranks():
    docs = [Doc(0, 13), Doc(1, 9), Doc(2, 2)]          # CP4 with 6 tokens per rank: 13 + 9, then 2 alone
    step = sp_accumulation_step(docs, 4, 6, time_ms)
    assert step.sp_size == 4
    assert all(sum(len(d) for d in mb) >= 4 for pipe in step.plan for mb in pipe)
    assert sorted(d.index for pipe in step.plan for mb in pipe for d in mb) == [0, 1, 2]


@pytest.mark.parametrize("schedule", ["2xTP1PP1CP2", "2xTP1PP1UL2", "2xTP2PP1"])
def test_the_mode_takes_only_plain_data_parallelism(schedule):
    """It picks the sequence-splitting degree itself: a schedule that already splits (CP or Ulysses) or
    shards (TP) is one clear error."""
    config = TrainConfig.from_values(model="tiny", world_size=4, strategy_schedule=schedule,
                                     balance="sp-accumulation", steps=1, tokens_per_iter=64)
    with pytest.raises(HGraphError, match="runs homogeneous data parallelism: give --strategy-schedule 4xTP1PP1"):
        sp_accumulation_cost(config, [Strategy.parse(schedule)], None, 4)
