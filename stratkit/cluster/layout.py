"""From a list of tasks and their addresses to each task's validated ClusterSpec.

The launcher and the Spark runner both start clusters: they place tasks and
find addresses in their own ways, then call these two functions, so TF_CONFIG
is written in one place and decided by `detect()` in one place.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping, Sequence

from stratkit.cluster.detect import LAUNCHER_VAR, detect
from stratkit.cluster.spec import ClusterSpec


def group_by_role(roles: Iterable[str], addresses: Sequence[str]) -> dict[str, list[str]]:
    """The TF_CONFIG "cluster": addresses grouped by role, each role in the given order."""
    cluster: dict[str, list[str]] = {}
    for role, address in zip(roles, addresses):
        cluster.setdefault(role, []).append(address)
    return cluster


def tf_config_json(cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int) -> str:
    """The TF_CONFIG string for one task of `cluster`."""
    return json.dumps({"cluster": {r: list(a) for r, a in cluster.items()},
                       "task": {"type": task_type, "index": task_index}}, sort_keys=True)


def detect_task(cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int, *, launcher: str,
                environ: Mapping[str, str] | None = None) -> ClusterSpec:
    """What `detect()` will decide inside that task, given the rest of its environment."""
    env = dict(environ or {})
    env["TF_CONFIG"] = tf_config_json(cluster, task_type, task_index)
    env[LAUNCHER_VAR] = launcher
    return detect(env)
