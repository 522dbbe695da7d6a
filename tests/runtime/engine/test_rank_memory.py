"""Issue 14's bound on every rank's measured memory, at a size CI can run: a 36M-parameter Llama on
4 CPU ranks, fp32, the four-strategy schedule of the issue, one step per strategy.

Each step's peak resident memory (``VmHWM`` reset every step) is compared with the same step of the
same schedule run just before in the same process on a model of the same depth 60x smaller (the
framework, graphs, plans and process groups: the issue's "1 GB"). The difference must stay within
the difference of ``16 B x parameters / N + 3 x the rank's working layout in that step's strategy
(fp32) + the activations hgraph memory predicts``, plus ``SLACK``. A rank holding the whole model
(133 MB in fp32, 533 MB with Adam's states), or the working layouts of the strategies it ran
before, is over it.
The 168M model of the issue is measured by ``python -m hgraph.tools.bench.memory``.

The same processes then run each strategy of the schedule alone on the larger model, one step of
the same mini-batch, and the schedule's peak must stay within ``SCHEDULE_RATIO`` of the largest of
those: a strategy built, or prepared ahead, while another one runs holds no working memory, and a
finished run leaves nothing behind (its states and optimizer freed) for the next one in the process.
"""
import gc

import pytest
import torch

import hgraph
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.engine import host_heap
from hgraph.runtime.engine.peak_memory import PeakMemory
from hgraph.runtime.engine.model_states import rank_states
from hgraph.runtime.planner.cost.memory_estimate import estimate_memory
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer
from hgraph.strategy import Cluster, Strategy
from hgraph.tools.bench.memory import Run, documents, run_config

MODEL_ARGS = {"vocab_size": 16000, "hidden_size": 512, "intermediate_size": 1408, "num_layers": 6, "num_heads": 8}
SMALL_ARGS = dict(MODEL_ARGS, vocab_size=256, hidden_size=64, intermediate_size=176)   # the framework
SCHEDULE = "1xTP2PP2;2xTP2PP1;1xTP1PP2+1xTP2PP1;1xTP2PP2"
TOKENS = 256
MiB = 2 ** 20
# allocator and buffer overheads the formula does not count: measured up to 76 MiB at this size; a rank
# holding the whole model in fp32 (133 MB) on top of its share is over it
SLACK = 96 * MiB
SCHEDULE_RATIO = 1.10     # the schedule's peak over its largest strategy's run alone (issue 39)
ALONE = list(dict.fromkeys(SCHEDULE.split(";")))


def _config(model_args, world, schedule=SCHEDULE, steps=4):
    docs = documents(TOKENS, steps, model_args["vocab_size"])    # 96, 64, 32 and 64 tokens a step
    return run_config(Run(schedule, world, schedule), "llama:tiny", model_args, steps, TOKENS, docs)


def _worker(rank, world):
    """The schedule on the small model; each strategy alone, one step, then the schedule, on the large
    one (each run's peaks counted from its start)."""
    out = []
    runs = [(SMALL_ARGS, SCHEDULE, 4)] + [(MODEL_ARGS, s, 1) for s in ALONE] + [(MODEL_ARGS, SCHEDULE, 4)]
    for args, schedule, steps in runs:
        gc.collect()
        host_heap.trim()
        PeakMemory(torch.device("cpu")).read()
        summary = Trainer(_config(args, world, schedule, steps), rank, world).run()
        out.append([(str(s.strategy), s.process_peak_bytes) for s in summary.steps])
        del summary
    return {"small": out[0], "alone": out[1:-1], "large": out[-1]}


@pytest.fixture(scope="module")
def measured():
    try:
        open("/proc/self/status").close()
    except OSError:
        pytest.skip("no /proc: resident memory is not measurable here")
    return spawn(_worker, 4, timeout_s=600)


def _bounds(model_args):
    """Per step and rank: ``16 B x parameters / N + 3 x working layout + predicted activations``."""
    with torch.device("meta"):
        model = resolve_model_spec("llama:tiny", model_args)
    compiled = hgraph.compile(model, dtype="fp32")
    params = sum(p.numel() for p in model.parameters())
    cluster = Cluster(4)
    out = []
    for text in SCHEDULE.split(";"):
        strategy = Strategy.parse(text)
        states = rank_states(compiled, strategy, cluster, torch.float32)
        estimate = estimate_memory(compiled, strategy, cluster, TOKENS)
        out.append([16 * params / 4 + 3 * states[r].working_params + (estimate.ranks[r].activations or 0)
                    for r in range(4)])
    return out


def test_every_rank_stays_within_its_share_of_the_model(measured):
    small, large = _bounds(SMALL_ARGS), _bounds(MODEL_ARGS)
    for rank, runs in enumerate(measured):
        small_steps, large_steps = runs["small"], runs["large"]
        assert [s for s, _ in large_steps] == SCHEDULE.split(";")
        for index, ((text, a), (_, b)) in enumerate(zip(small_steps, large_steps)):
            if index == 0:
                continue                    # the first step's peak holds the set-up
            bound = large[index][rank] - small[index][rank] + SLACK
            assert b - a <= bound, (f"rank {rank} step {index} ({text}): {(b - a) / MiB:.0f} MiB more than the "
                                    f"small model's, bound {bound / MiB:.0f} MiB")


def test_a_schedule_peaks_within_its_largest_strategy_run_alone(measured):
    """Several strategies in one run cost no memory past the largest of them run alone (the same
    mini-batch, peak resident memory, set-up included in both)."""
    for rank, runs in enumerate(measured):
        assert [[s for s, _ in run] for run in runs["alone"]] == [[s] for s in ALONE]
        alone = max(peak for run in runs["alone"] for _, peak in run)
        schedule = max(peak for _, peak in runs["large"])
        assert schedule <= SCHEDULE_RATIO * alone, (f"rank {rank}: the schedule peaked at {schedule / MiB:.0f} MiB, "
                                                    f"{schedule / alone:.3f}x its largest strategy alone")
