"""How many barrier tasks the cluster can run at once, checked BEFORE submitting.

A barrier stage that needs more slots than the cluster has does not fail in
Spark: the scheduler logs "Barrier stage in job 0 requires 4 slots, but only
2 are available. Will retry up to 40 more times" every 15 s, for about ten
minutes (spark-tensorflow-distributor #161). Here the same question is
answered up front, with an error that says what to change.

Two sources, used together:
  * `static_slots` -- from the confs alone (master string, executor cores,
    spark.task.cpus, task/executor GPU amounts). Exact for `local[N]` and
    `local-cluster[n,c,m]`; for YARN/Kubernetes it needs
    spark.executor.instances; otherwise unknown (None).
  * `live_slots` -- Spark's own count for the registered executors (the number
    the barrier scheduler compares with). Executors register a few seconds
    after the session starts, so a too-small live count is waited on, unless
    the static count already shows it can never be enough.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from stratkit.errors import ConfigError

#: Seconds to wait for executors to register before giving up (conf spark.stratkit.slotWaitSeconds).
DEFAULT_WAIT_SECONDS = 60.0
WAIT_CONF = "spark.stratkit.slotWaitSeconds"

_LOCAL = re.compile(r"^local(?:\[(?P<threads>\*|\d+)(?:\s*,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(?P<n>\d+)\s*,\s*(?P<cores>\d+)\s*,\s*(?P<mem>\d+)\s*\]$")


def _int_conf(conf: Mapping[str, str], key: str, default: int | None) -> int | None:
    value = conf.get(key)
    if value is None or str(value).strip() == "":
        return default
    try:
        return int(float(str(value).strip()))
    except ValueError:
        raise ConfigError(f"Spark conf {key}={value!r} is not a number. Fix: set it to an integer") from None


def per_executor_slots(conf: Mapping[str, str], cores: int) -> int:
    """Tasks one executor with `cores` cores runs at once, limited by CPUs and by any task GPU amount."""
    task_cpus = _int_conf(conf, "spark.task.cpus", 1) or 1
    slots = cores // task_cpus
    for key, value in conf.items():
        match = re.fullmatch(r"spark\.task\.resource\.(?P<name>[^.]+)\.amount", key)
        if not match:
            continue
        task_amount = float(value)
        executor_amount = _int_conf(conf, f"spark.executor.resource.{match['name']}.amount", None)
        if task_amount > 0 and executor_amount is not None:
            # Fractional amounts (0.5) let several tasks share one resource.
            slots = min(slots, math.floor(executor_amount / task_amount + 1e-9))
    return max(slots, 0)


def static_slots(conf: Mapping[str, str], cpu_count: int | None = None) -> int | None:
    """Concurrent task slots implied by the Spark confs, or None when the confs alone cannot tell.

    `conf` must contain spark.master. Resource amounts count only where
    Spark enforces them (cluster managers; local mode ignores task resources).
    """
    master = str(conf.get("spark.master", "")).strip()
    cpu_count = cpu_count or os.cpu_count() or 1
    task_cpus = _int_conf(conf, "spark.task.cpus", 1) or 1
    match = _LOCAL.match(master)
    if match:
        threads = match["threads"]
        total = 1 if threads is None else (cpu_count if threads == "*" else int(threads))
        return total // task_cpus
    match = _LOCAL_CLUSTER.match(master)
    if match:
        return int(match["n"]) * per_executor_slots(conf, int(match["cores"]))
    instances = _int_conf(conf, "spark.executor.instances", None)
    cores = _int_conf(conf, "spark.executor.cores", None)
    dynamic = str(conf.get("spark.dynamicAllocation.enabled", "false")).lower() == "true"
    if instances is not None and not dynamic and (master.startswith(("yarn", "k8s://"))):
        # YARN and Kubernetes default to 1 executor core.
        return instances * per_executor_slots(conf, cores or 1)
    return None


def live_slots(spark_context: Any) -> int | None:
    """Spark's own count of concurrent task slots on the registered executors (None if unavailable).

    Uses `SparkContext.maxNumConcurrentTasks`, the number the barrier
    scheduler itself checks (private API: any failure means "unknown").
    """
    if spark_context is None:
        return None
    try:
        jsc = spark_context._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # noqa: BLE001 - Spark Connect, older Spark, a changed private API
        return None


def _fix(needed: int, conf: Mapping[str, str], tasks: str = "barrier tasks") -> str:
    master = conf.get("spark.master", "")
    gpu = [k for k in conf if k.startswith("spark.task.resource.") and k.endswith(".amount")]
    hints = [f"ask for fewer tasks (num_workers/num_ps/num_slots: {needed} {tasks} are needed now)"]
    if str(master).startswith("local-cluster"):
        hints.append("start more executors or cores: --master \"local-cluster[N,CORES,MEM]\" with N x CORES >= "
                     f"{needed} x spark.task.cpus")
    elif str(master).startswith("local"):
        hints.append(f"use --master \"local[{needed}]\" or more threads")
    else:
        hints.append("add executors (spark.executor.instances) or cores per executor (spark.executor.cores)")
    if _int_conf(conf, "spark.task.cpus", 1) != 1:
        hints.append(f"lower spark.task.cpus (now {conf['spark.task.cpus']})")
    if gpu:
        hints.append("check " + ", ".join(f"{k}={conf[k]}" for k in gpu) + " against the executors' GPU amounts")
    return "; or ".join(hints)


def check_slots(needed: int, conf: Mapping[str, str], spark_context: Any = None,
                wait_seconds: float | None = None, sleep: Callable[[float], None] = time.sleep, *,
                what: str = "the barrier stage", tasks: str = "barrier tasks",
                otherwise: str = "Spark would retry for about 10 minutes, then fail") -> int | None:
    """Raise `ConfigError` unless the cluster can run `needed` tasks at once.

    Returns the slot count that was checked (None when it cannot be known,
    e.g. on Spark Connect against an unknown cluster manager). `what`, `tasks`
    and `otherwise` word the error for the caller (a search's tuners are not a
    barrier stage: they would wait for each other at the search's start).
    """
    expected = static_slots(conf)
    if expected is not None and expected < needed:
        raise ConfigError(f"{what} needs {needed} concurrent task slots but spark.master="
                          f"{conf.get('spark.master')!r} with spark.task.cpus={conf.get('spark.task.cpus', '1')} "
                          f"gives only {expected} ({otherwise}). Fix: {_fix(needed, conf, tasks)}")
    live = live_slots(spark_context)
    if live is None or live >= needed:
        return live if live is not None else expected
    if wait_seconds is None:
        wait_seconds = float(conf.get(WAIT_CONF, DEFAULT_WAIT_SECONDS))
    deadline = time.monotonic() + wait_seconds
    while live is not None and live < needed and time.monotonic() < deadline:
        sleep(0.5)  # executors are still registering
        live = live_slots(spark_context)
    if live is not None and live < needed:
        raise ConfigError(f"{what} needs {needed} concurrent task slots but the registered executors "
                          f"offer {live} (waited {wait_seconds:.0f}s for more to register; {WAIT_CONF} sets the "
                          f"wait). Fix: {_fix(needed, conf, tasks)}")
    return live
