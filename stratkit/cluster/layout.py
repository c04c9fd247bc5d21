"""The tasks of a launched cluster, their TF_CONFIG, and the check that every task will see its place.

Both front doors start clusters -- `stratkit launch` (local processes) and the
Spark runner (barrier tasks). They find hosts and addresses in their own ways,
but what a cluster *is* is decided here, once:

- `plan_tasks`: the roles and indices, in TF_CONFIG order (chief, workers, ps,
  evaluator), and the rules a layout must meet to train;
- `Task.serves` and `build_cluster`: which tasks hold a port and are listed in
  the TF_CONFIG "cluster" (not the evaluator);
- `primary_task`: the chief, by TensorFlow's rule (`cluster.rules.is_chief`);
- `tf_config_json` / `detect_task`: each task's TF_CONFIG, and what
  `stratkit.detect()` decides from it -- the rule every task applies to itself;
- `trial_group` / `group_cluster`: a search's multi-worker trial groups
  (K workers each, a cluster of their own);
- `check_task` / `check_plan`: the launched task would see exactly the planned
  role, index, cluster and chief, so a layout the tasks would reject
  fails in the front door, once, before anything starts.

Each front door keeps only what is its own: the launcher's flags and log file
names (`stratkit.launch.plan`), Spark's ranks and which tasks read data
(`stratkit.spark.layout`).

Pure Python: imports no TensorFlow.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from stratkit.cluster.detect import LAUNCHER_VAR, detect
from stratkit.cluster.rules import is_chief, spec_for_cluster
from stratkit.cluster.spec import ClusterSpec
from stratkit.errors import ConfigError


@dataclass(frozen=True)
class Task:
    """One task of the cluster: a TF_CONFIG role and index."""

    role: str
    index: int

    @property
    def name(self) -> str:
        """`worker:1`: how the task is named in prefixes, messages and reports."""
        return f"{self.role}:{self.index}"

    @property
    def serves(self) -> bool:
        """True when the task runs a gRPC server and so needs a port in the cluster.

        The evaluator is left out of `cluster` (as TensorFlow's estimator rule
        and Google AI Platform do): it only reads checkpoints, and no training
        task ever waits for it or dials it.
        """
        return self.role != "evaluator"


@dataclass(frozen=True)
class Spelling:
    """How a front door's user writes the layout settings, so a layout error names them as typed.

    `chief` is None when the front door adds the chief itself (the Spark runner).
    `assign` joins a setting and its value: " " for flags (`--ps 1`), "=" for arguments (`num_ps=1`).
    """

    workers: str
    ps: str
    chief: str | None = None
    assign: str = "="

    def set(self, setting: str, value: object) -> str:
        return f"{getattr(self, setting)}{self.assign}{value}"


def plan_tasks(workers: int, chief: bool = False, ps: int = 0, evaluator: bool = False, *,
               spelling: Spelling = Spelling("workers", "ps", "chief=True")) -> list[Task]:
    """The tasks of a layout, in TF_CONFIG order: chief, workers, ps, evaluator.

    The counts must already be whole numbers >= 0 (each front door checks its
    own arguments); the rules here are those of TensorFlow training itself.

    Raises:
        ConfigError: naming the settings as `spelling` writes them, when the layout cannot train.
    """
    if workers == 0 and not chief:
        add = f" (or add {spelling.chief})" if spelling.chief else ""
        raise ConfigError(f"{spelling.set('workers', 0)} without {spelling.chief or 'a chief'} leaves no task to "
                          f"train. Fix: {spelling.set('workers', 1)} or more{add}")
    if ps and not chief:
        add_chief = (f"add {spelling.chief} (e.g. {spelling.chief} {spelling.set('workers', 2)} "
                     f"{spelling.set('ps', 1)}), or " if spelling.chief else "")
        raise ConfigError(f"{spelling.set('ps', ps)} needs a coordinator: parameter-server training is driven from a "
                          f"chief. Fix: {add_chief}drop {spelling.ps} for synchronous multi-worker training")
    if ps and workers == 0:
        raise ConfigError(f"{spelling.set('ps', ps)} with {spelling.set('workers', 0)} leaves no worker to run the "
                          f"steps. Fix: {spelling.set('workers', 1)} or more")
    tasks = [Task("chief", 0)] if chief else []
    tasks += [Task("worker", i) for i in range(workers)]
    tasks += [Task("ps", i) for i in range(ps)]
    if evaluator:
        tasks.append(Task("evaluator", 0))
    return tasks


def node_tasks(nnodes: int, workers_per_node: int, chief: bool = False, ps: int = 0) -> list[list[Task]]:
    """Which tasks each node of a multi-node launch runs, node 0 (the rendezvous' node) first.

    Node r runs workers r*K .. r*K+K-1; node 0 also runs the chief; ps task j
    runs on node (j + 1) mod N, so with two or more nodes the first ps task is
    not on the chief's machine (the chief and the ps tasks both carry the
    parameter traffic). Each node's list is in TF_CONFIG order.
    """
    nodes: list[list[Task]] = [[] for _ in range(nnodes)]
    if chief:
        nodes[0].append(Task("chief", 0))
    for rank in range(nnodes):
        nodes[rank] += [Task("worker", rank * workers_per_node + i) for i in range(workers_per_node)]
    for index in range(ps):
        nodes[(index + 1) % nnodes].append(Task("ps", index))
    return nodes


def trial_group(task: Task, per_trial: int) -> tuple[int, Task]:
    """A search's worker `task` in its multi-worker trial group (`stratkit launch --tune --workers-per-trial K`):
    (the group's number, the task it is in the group's own cluster).

    Workers K*g .. K*g+K-1 form group g; each group is a synchronous cluster of its own, `plan_tasks(K)`
    (its chief: the group's first worker), so a group's TF_CONFIG is any launched cluster's.
    """
    if task.role != "worker":
        raise ValueError(f"{task.name} is not a worker: only workers form trial groups")
    return task.index // per_trial, plan_tasks(per_trial)[task.index % per_trial]


def group_cluster(addresses: Sequence[str], group: int, per_trial: int) -> dict[str, list[str]]:
    """The TF_CONFIG cluster of trial group `group`, from every worker's address (in worker order)."""
    return build_cluster(plan_tasks(per_trial), addresses[group * per_trial:(group + 1) * per_trial])


def primary_task(tasks: Sequence[Task]) -> Task:
    """The task whose success ends training: the chief, else worker 0 (TensorFlow's rule, `rules.is_chief`)."""
    roles = {t.role for t in tasks}
    for task in tasks:
        if is_chief(dict.fromkeys(roles, []), task.role, task.index):
            return task
    return Task("worker", 0)


def format_address(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed as TF_CONFIG needs."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def group_by_role(roles: Iterable[str], addresses: Sequence[str]) -> dict[str, list[str]]:
    """The TF_CONFIG "cluster": addresses grouped by role, each role in the given order."""
    cluster: dict[str, list[str]] = {}
    for role, address in zip(roles, addresses):
        cluster.setdefault(role, []).append(address)
    return cluster


def build_cluster(tasks: Sequence[Task], addresses: Sequence[str]) -> dict[str, list[str]]:
    """The TF_CONFIG `cluster` dict: one address per serving task, in task order.

    Raises:
        ValueError: when the count of addresses is not the count of serving tasks (a front door's bug).
    """
    serving = [t for t in tasks if t.serves]
    if len(serving) != len(addresses):
        raise ValueError(f"{len(serving)} serving tasks but {len(addresses)} addresses")
    return group_by_role((t.role for t in serving), addresses)


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


def check_task(cluster: Mapping[str, Sequence[str]], task: Task, *, launcher: str, fix: str,
               environ: Mapping[str, str] | None = None, chief: Task | None = None,
               allow_preset: bool = True) -> ClusterSpec:
    """The `ClusterSpec` the launched `task` will see, checked to be the planned one (role, index, cluster, chief).

    Runs `detect()` on exactly the environment the task gets (`environ` plus
    its TF_CONFIG and the launcher's name), so a contradiction such as
    `STRATKIT_STRATEGY=mirrored` with 2 workers fails now, in the front door,
    instead of in every task.

    Args:
        cluster: the TF_CONFIG "cluster".
        task: the task to check.
        launcher: the front door's STRATKIT_LAUNCHER value ("launch", "spark", "ray"), set in the task's environment.
        fix: what the user should change when detection does not see the plan (the front door
            knows where its tasks' environment comes from).
        environ: the task's environment without TF_CONFIG (default: empty).
        chief: the planned chief (`primary_task`), checked when given.
        allow_preset: True accepts the strategy detection decides, a user's explicit choice
            (STRATKIT_STRATEGY) included; False requires the strategy the cluster itself means
            (`rules.spec_for_cluster`), for a front door that decides the strategy (Spark).

    Raises:
        ConfigError: when detection rejects the layout or would place the task elsewhere.
    """
    spec = detect_task(cluster, task.role, task.index, launcher=launcher, environ=environ)
    strategy = None if allow_preset else spec_for_cluster(cluster, task.role, task.index, launcher, 0, ()).strategy
    # Role, index and cluster prove detection read the TF_CONFIG written here. The source is only a label:
    # SageMaker's variables make it "sagemaker", and a launch inside a SageMaker job is still ours.
    seen = (spec.task_type, spec.task_index, dict(spec.cluster))
    if seen != (task.role, task.index, dict(cluster)) or strategy not in (None, spec.strategy):
        expected = f" ({strategy})" if strategy else ""
        raise ConfigError(f"stratkit.detect() read task {spec.task_type}:{spec.task_index} ({spec.strategy}, source "
                          f"{spec.source!r}: {'; '.join(spec.reasons)}) from the TF_CONFIG written for "
                          f"{task.name}{expected}. Fix: {fix}")
    planned_chief = chief is not None and task.name == chief.name
    if chief is not None and spec.is_chief != planned_chief:
        raise ConfigError(f"{task.name} would{' not' if planned_chief else ''} be the chief, but the plan's chief is "
                          f"{chief.name}. This is a stratkit bug: please report it")
    return spec


def check_plan(tasks: Sequence[Task], *, launcher: str, fix: str, environ: Mapping[str, str] | None = None,
               host: str = "127.0.0.1", allow_preset: bool = True) -> None:
    """`check_task` for every task, with placeholder ports on `host` (ports do not change what detection decides).

    Raises:
        ConfigError: as `check_task`, for the first task that would not see its place.
    """
    serving = [t for t in tasks if t.serves]
    cluster = build_cluster(tasks, [format_address(host, 20000 + i) for i in range(len(serving))])
    chief = primary_task(tasks)
    for task in tasks:
        check_task(cluster, task, launcher=launcher, fix=fix, environ=environ, chief=chief, allow_preset=allow_preset)
