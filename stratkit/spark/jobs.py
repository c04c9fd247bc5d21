"""The Spark jobs a run submits: tagged, so the driver can cancel them (classic Spark and Spark Connect).

`SparkRunner`'s barrier stage and a search's tuner tasks (`stratkit.spark.tune`)
run inside `job_tag`; `cancel` stops every job with the tag (job tags; job groups
before Spark 3.5; `interruptTag` over Spark Connect, which has no SparkContext).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stratkit import status

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


__all__ = ["cancel", "job_tag"]
