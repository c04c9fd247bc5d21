"""`SparkRunner(num_workers=N, min_workers=M)`: how many tasks a retry runs when executors were lost.

A barrier stage needs all its tasks at once. When an attempt fails because an
executor (its host) is gone, a retry with N tasks would wait for slots that no
longer exist (Spark retries a barrier stage short of slots for about ten
minutes). With `min_workers`, each retry runs with the slots Spark counts
then, at most N and at least M: fewer when executors were lost, more again
when they came back. The training function resumes from its backup_dir, and
`stratkit.Trainer` keeps the global batch, so the math is one process's.

Spark removes a killed executor within a second or two of its connection
closing (a silent host takes spark.network.timeout); the count is read for
`SETTLE_SECONDS` after a failure and its smallest value is used.

Imports no TensorFlow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stratkit.process import arguments
from stratkit.spark import slots

#: Seconds the slot count is watched after a failed attempt (a lost executor is removed meanwhile).
SETTLE_SECONDS = 5.0


def workers_for_retry(num_workers: int, min_workers: int, spark_context: Any,
                      settle: float = SETTLE_SECONDS, sleep: Callable[[float], None] = time.sleep) -> int | None:
    """Workers the next attempt runs: min(num_workers, slots Spark counts), or None below `min_workers`.

    When the count cannot be read (e.g. Spark Connect), all `num_workers`.
    """
    deadline = time.monotonic() + settle
    seen = slots.live_slots(spark_context)
    while seen is not None and time.monotonic() < deadline:
        sleep(0.25)
        now = slots.live_slots(spark_context)
        seen = seen if now is None else min(seen, now)
    if seen is None:
        return num_workers
    return arguments.workers_within(seen, num_workers, min_workers)
