"""The arguments every cluster runner takes (`SparkRunner`, `RayRunner`), checked one way.

A runner's own arguments (a SparkSession, a placement strategy) stay in the
runner; what both take -- counts, `use_gpu`/`gpus_per_worker`, `max_retries`,
`timeout`, `min_workers` -- is checked here, so a bad value gets the same
`ConfigError` (the name, the value, the fix) from either front door; and so is
what `min_workers` means for a retry (`workers_within`), whatever each engine
counts as room for a worker.

Pure Python: imports no TensorFlow and no engine.
"""

from __future__ import annotations

from stratkit.errors import ConfigError


def positive_int(name: str, value: object, minimum: int = 1, example: str = "2") -> int:
    """`value` when it is an integer >= `minimum` (a bool is not); a ConfigError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}: got {value!r}. Fix: e.g. {name}={example}")
    return value


def check_gpus(use_gpu: object, gpus_per_worker: object) -> None:
    """`use_gpu` is a bool; `gpus_per_worker` is None or a positive integer, and only with use_gpu=True."""
    if not isinstance(use_gpu, bool):
        raise ConfigError(f"use_gpu must be True or False: got {use_gpu!r}")
    if gpus_per_worker is not None:
        positive_int("gpus_per_worker", gpus_per_worker, example="1")
        if not use_gpu:
            raise ConfigError(f"gpus_per_worker={gpus_per_worker} needs use_gpu=True. Fix: pass use_gpu=True, "
                              "or drop gpus_per_worker")


def check_timeout(timeout: object) -> float | None:
    """`timeout` when it is None or a positive number of seconds; a ConfigError otherwise."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"timeout must be a positive number of seconds or None: got {timeout!r}. "
                          "Fix: e.g. timeout=3600")
    return timeout


def check_min_workers(min_workers: int | None, num_workers: int, num_ps: int) -> int | None:
    """`min_workers` checked against the layout (None: not elastic); a ConfigError naming it otherwise."""
    if min_workers is None:
        return None
    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or not 1 <= min_workers <= num_workers:
        raise ConfigError(f"min_workers must be an integer in 1..num_workers={num_workers}: got {min_workers!r}. "
                          f"Fix: e.g. min_workers=1 (a retry may then run with 1 to {num_workers} workers)")
    if num_ps:
        raise ConfigError(f"min_workers={min_workers} with num_ps={num_ps}: only a synchronous (MultiWorkerMirrored) "
                          "cluster can shrink between retries here. Fix: drop min_workers, or num_ps")
    return min_workers


def workers_within(room: int, num_workers: int, min_workers: int) -> int | None:
    """How many workers an elastic retry runs when the cluster has `room` for that many: min(num_workers, room),
    or None when that is below `min_workers` (the run is not retried)."""
    workers = min(num_workers, max(room, 0))
    return workers if workers >= min_workers else None


def check_tune(tune: object, *, num_ps: int = 0, min_workers: int | None = None, max_retries: int = 0) -> bool:
    """`tune` is a bool, and a search's runner (`tune=True`) gets no argument that has no meaning for tuners:
    each trains its trials alone, and a lost one's trial runs again on another (docs/tuning.md)."""
    if not isinstance(tune, bool):
        raise ConfigError(f"tune must be True or False: got {tune!r}")
    if not tune:
        return False
    for name, value, why in (
            ("num_ps", num_ps, "a search's tuners each train their trials alone"),
            ("min_workers", min_workers, "a lost tuner is a lease that expires: its trial runs again on another "
                                         "tuner, and the search goes on with the others"),
            ("max_retries", max_retries, "a lost tuner's trial runs again on another tuner; a search that stopped "
                                         "resumes from its store when it is run again")):
        if value:
            raise ConfigError(f"{name}={value} does not go with tune=True: {why}. Fix: drop {name}")
    return True
