"""`model.fit(x, y)` on arrays with Keras's default shuffle=True, on 2 real workers and no seed set:
every epoch the workers split one order between them (each row once), and the order still changes
from epoch to epoch and from run to run (stratkit/strategy/keras_compat/array_shuffle.py).

The weights side (one process's numbers) is the "shuffled" case of test_global_gradient.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from procs import describe, free_ports, run_cluster, worker_tf_configs

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

SCRIPT = Path(__file__).with_name("shuffle_order.py")


def _orders() -> list[list[list[int]]]:
    results = run_cluster(str(SCRIPT), worker_tf_configs(free_ports(2)), timeout=180, grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    return [json.loads(next(line for line in r.stdout.splitlines() if line.startswith("ORDER "))[6:])
            for r in results]


def test_each_epoch_the_workers_split_one_shuffled_order_that_changes():
    runs = [_orders(), _orders()]
    for chief, worker in runs:
        assert len(chief) == len(worker) == 3
        for epoch, (mine, theirs) in enumerate(zip(chief, worker)):
            assert sorted(mine + theirs) == list(range(8)), f"epoch {epoch}: rows {mine} + {theirs}"
        # shuffled at all, and anew each epoch: 3 epochs in one order have odds (1/70)^2 with 8 rows in 2 halves
        assert len({tuple(sorted(epoch)) for epoch in chief}) > 1, chief
    assert runs[0][0] != runs[1][0], "two runs drew the same orders: the chief's seed is not random"
