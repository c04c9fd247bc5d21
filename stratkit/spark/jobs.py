"""The Spark jobs a run submits: tagged, so the driver can cancel them (classic Spark and Spark Connect).

`SparkRunner`'s barrier stage and a search's tuner tasks (`stratkit.spark.tune`)
run as `collect_rows` inside `job_tag`; `cancel` stops every job with the tag (job
tags; job groups before Spark 3.5; `interruptTag` over Spark Connect, which has no
SparkContext).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stratkit import status
from stratkit.spark.task import ROWS

log = status.logger(__name__)


@contextmanager
def job_tag(spark: Any, sc: Any, tag: str, description: str) -> Iterator[None]:
    """Tag this thread's Spark jobs so they can be cancelled (job tags; job groups before Spark 3.5)."""
    if sc is None:
        spark.addTag(tag)
        try:
            yield
        finally:
            spark.removeTag(tag)
        return
    previous = {key: sc.getLocalProperty(key) for key in ("spark.job.interruptOnCancel", "spark.job.description")}
    sc.setLocalProperty("spark.job.interruptOnCancel", "true")
    sc.setLocalProperty("spark.job.description", description)
    tags = hasattr(sc, "addJobTag")
    if tags:
        sc.addJobTag(tag)
    else:  # pragma: no cover - Spark < 3.5
        sc.setJobGroup(tag, description, interruptOnCancel=True)
    try:
        yield
    finally:
        if tags:
            sc.removeJobTag(tag)
        else:  # pragma: no cover
            sc.setLocalProperty("spark.jobGroup.id", None)
        for key, value in previous.items():
            sc.setLocalProperty(key, value)


def cancel(spark: Any, sc: Any, tag: str) -> None:
    """Cancel every job tagged `tag` (best effort: a stopping context is told nothing)."""
    try:
        if sc is None:
            spark.interruptTag(tag)
        elif hasattr(sc, "cancelJobsWithTag"):
            sc.cancelJobsWithTag(tag)
        else:  # pragma: no cover - Spark < 3.5
            sc.cancelJobGroup(tag)
    except Exception as exc:  # noqa: BLE001 - the context may be stopping; the tasks were told to stop anyway
        log.debug("could not cancel Spark jobs tagged %s: %s", tag, exc)


def collect_rows(spark: Any, sc: Any, stage: str, tasks: int, arrow_function: Any, rdd_function: Any, *,
                 barrier: bool) -> list[tuple[int, int, bytes]]:
    """Run one task per partition of `tasks` and collect their `(rank, seq, chunk)` rows (`task.ROWS`): through
    `DataFrame.mapInArrow` (stage "mapInArrow"; Spark Connect has only it) or an RDD's `mapPartitions`, as a
    barrier stage (a training cluster) or not (a search's tuners)."""
    if stage == "mapInArrow":
        frame = spark.range(0, tasks, 1, tasks)
        frame = frame.mapInArrow(arrow_function, ROWS, barrier=True) if barrier else \
            frame.mapInArrow(arrow_function, ROWS)
        return [(row["rank"], row["seq"], bytes(row["chunk"])) for row in frame.collect()]
    rdd = sc.parallelize(range(tasks), tasks)
    return list((rdd.barrier() if barrier else rdd).mapPartitions(rdd_function).collect())


__all__ = ["cancel", "collect_rows", "job_tag"]
