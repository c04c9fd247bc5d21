"""`SparkRunner(min_workers=...)`: checked up front, and how many workers a retry gets from Spark's slot count.

The run itself (an executor's host lost, the retry on the slots left, the weights of one process) is
tests/test_spark_elastic_hosts.py, on a real standalone cluster across two test hosts.
"""

from __future__ import annotations

import inspect

import pytest

from stratkit.errors import ConfigError
from stratkit.spark import MirroredStrategyRunner, SparkRunner, elastic


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"num_workers": 2, "min_workers": 3}, ["min_workers", "1..num_workers=2", "got 3"]),
    ({"num_workers": 2, "min_workers": 0}, ["min_workers", "got 0"]),
    ({"num_workers": 2, "min_workers": True}, ["min_workers", "got True"]),
    ({"num_workers": 2, "num_ps": 1, "min_workers": 1}, ["min_workers=1 with num_ps=1", "drop min_workers"]),
])
def test_a_bad_min_workers_is_refused_naming_it_and_the_fix(kwargs, words):
    with pytest.raises(ConfigError) as error:
        SparkRunner(**kwargs)
    for word in words:
        assert word in str(error.value)
    assert "Fix:" in str(error.value)


def test_mirrored_strategy_runner_keeps_its_signature():
    assert "min_workers" not in inspect.signature(MirroredStrategyRunner).parameters
    assert SparkRunner(num_workers=3, min_workers=2).min_workers == 2
    assert SparkRunner(num_workers=3).min_workers is None


class _Slots:
    """Spark's slot count over time: an executor removed a moment after the failure."""

    def __init__(self, counts: list[int | None]) -> None:
        self.counts = counts

    def __call__(self, spark_context) -> int | None:
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


@pytest.mark.parametrize(("counts", "workers"), [
    ([2, 2, 1, 1], 1),      # the lost executor leaves within the settle time: the smallest count
    ([4, 4], 2),            # more slots than num_workers: num_workers
    ([1, 0, 0], None),      # below min_workers=1: no retry
    ([None], 2),            # no count (e.g. Spark Connect): every worker, as before
])
def test_a_retry_gets_the_slots_left_between_min_and_num_workers(counts, workers, monkeypatch):
    monkeypatch.setattr(elastic.slots, "live_slots", _Slots(counts))
    assert elastic.workers_for_retry(2, 1, object(), settle=0.05, sleep=lambda s: None) == workers
