"""Which TF task each Spark barrier task becomes, and which GPUs it sees.

Pure Python (no pyspark, no TensorFlow), so every rule here is unit-tested
without a JVM. The role -> strategy rule itself is not re-derived here: the
TF_CONFIG built for each task is handed to `stratkit.detect`, the one place
that maps a TF_CONFIG to a `ClusterSpec`.

The roles, the TF_CONFIG and the checks are `stratkit.cluster.layout`'s, as
for `stratkit launch`; what is the Spark runner's own is the rank (the
barrier task's partition id) and which tasks read a data shard (`trains`).

Rank order (the position in `cluster.layout.plan_tasks`'s TF_CONFIG order):
  * synchronous (num_ps == 0): every task is a "worker"; worker 0 (rank 0) is
    the chief by TensorFlow's rule, so no separate chief task is needed.
  * parameter server (num_ps > 0): rank 0 is the "chief" (the coordinator),
    ranks 1..num_workers are "worker", the last num_ps ranks are "ps".
Rank 0 is always the chief, and its return value is the one `run()` returns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stratkit.cluster import ClusterSpec, gpus
from stratkit.cluster import layout as cluster_layout
from stratkit.cluster.layout import Task, tf_config_json
from stratkit.errors import ConfigError
from stratkit.process.arguments import positive_int as _positive_int

#: Value of STRATKIT_LAUNCHER that makes `detect()` report source "spark".
LAUNCHER = "spark"
#: How the Spark runner's arguments are written in layout messages (it adds the chief itself).
ARGUMENTS = cluster_layout.Spelling(workers="num_workers", ps="num_ps")
#: What to change when a task would not see its place: its environment comes from the executor's.
_FIX = "do not set STRATKIT_STRATEGY or STRATKIT_CLUSTER_ENV on the executors; the Spark runner decides them"

# Spark GPU addresses must be plain CUDA ordinals: "0", "1", ..., no padding ("01" is another device to CUDA).
_GPU_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class TaskRole:
    """The TF task (`stratkit.cluster.layout.Task`) one barrier task (its `rank`) becomes."""

    rank: int
    task_type: str
    task_index: int

    @property
    def task(self) -> Task:
        return Task(self.task_type, self.task_index)

    @property
    def label(self) -> str:
        """`worker:1`, `ps:0`, ...: the prefix of this task's log lines on the driver."""
        return self.task.name

    @property
    def trains(self) -> bool:
        """True for tasks that compute steps on data (chief/worker of a synchronous cluster, PS workers)."""
        return self.task_type == "worker"


def plan_roles(num_workers: int, num_ps: int = 0) -> list[TaskRole]:
    """One `TaskRole` per barrier task, in rank order (see the module docstring)."""
    _positive_int("num_workers", num_workers)
    _positive_int("num_ps", num_ps, minimum=0, example="1")
    tasks = cluster_layout.plan_tasks(num_workers, chief=num_ps > 0, ps=num_ps, spelling=ARGUMENTS)
    return [TaskRole(rank, task.role, task.index) for rank, task in enumerate(tasks)]


def cluster_of(roles: Sequence[TaskRole], addresses: Sequence[str]) -> dict[str, list[str]]:
    """The TF_CONFIG "cluster" for `roles`, given each rank's "host:port" (indexed by rank)."""
    if len(addresses) != len(roles):
        raise ConfigError(f"got {len(addresses)} task address(es) for {len(roles)} task(s). "
                          "Fix: every barrier task must report exactly one address")
    return cluster_layout.build_cluster([r.task for r in roles], [addresses[r.rank] for r in roles])


def tf_config(roles: Sequence[TaskRole], addresses: Sequence[str], rank: int) -> str:
    """The TF_CONFIG JSON of the task with `rank`."""
    role = roles[rank]
    return tf_config_json(cluster_of(roles, addresses), role.task_type, role.task_index)


def validate(roles: Sequence[TaskRole], addresses: Sequence[str], rank: int,
             environ: Mapping[str, str] | None = None) -> ClusterSpec:
    """Run `stratkit.detect` on exactly the environment the task's process will get.

    Returns the `ClusterSpec` the training process will see; raises
    `ConfigError` when detection disagrees with the layout (e.g. a preset
    STRATKIT_STRATEGY that contradicts the cluster), so the task fails before
    TensorFlow starts. The runner decides the strategy: a preset on the
    executors may not change it (`stratkit launch` lets a user's explicit
    choice win).
    """
    tasks = [r.task for r in roles]
    return cluster_layout.check_task(cluster_of(roles, addresses), roles[rank].task, launcher=LAUNCHER, fix=_FIX,
                                     environ=environ, chief=cluster_layout.primary_task(tasks),
                                     allow_preset=False)


def check_layout(roles: Sequence[TaskRole]) -> None:
    """Validate the layout on the driver, before any Spark job, with placeholder addresses."""
    cluster_layout.check_plan([r.task for r in roles], launcher=LAUNCHER, fix=_FIX, allow_preset=False)


# -- GPUs ---------------------------------------------------------------------------------------

def check_gpu_addresses(addresses: Sequence[str], resource_name: str = "gpu") -> list[str]:
    """Spark's GPU addresses for a task, checked to be CUDA ordinals and sorted numerically."""
    bad = [a for a in addresses if not _GPU_ADDRESS.match(str(a))]
    if bad:
        raise ConfigError(f"Spark resource {resource_name!r} has addresses {list(addresses)}; {bad} are not CUDA "
                          "device ordinals. Fix: make the GPU discovery script print integer addresses without "
                          'zero padding, e.g. {"name": "gpu", "addresses": ["0", "1"]}')
    return sorted((str(a) for a in addresses), key=int)


def remap_visible(addresses: Sequence[str], preset: str | None, where: str = "the executor") -> list[str]:
    """Translate Spark's GPU addresses through a CUDA_VISIBLE_DEVICES already set in the process.

    Spark's addresses count the devices *visible* to the executor; when the
    executor itself runs with CUDA_VISIBLE_DEVICES="10,11,12,13", address "2"
    is physical device "12", and the child process (which gets its own
    CUDA_VISIBLE_DEVICES) must be given "12" (`stratkit.cluster.gpus.translate`,
    the launcher's rule too).
    """
    return gpus.translate(addresses, preset, what="Spark assigned GPU address", where=where,
                          fix="make the discovery script report indices into CUDA_VISIBLE_DEVICES (0..N-1), or "
                              "unset CUDA_VISIBLE_DEVICES there")


#: Kept importable from here (`stratkit.cluster.gpus` owns it).
split_evenly = gpus.split_evenly


def visible_devices(role: TaskRole, *, use_gpu: bool, owned: Sequence[str] | None, count: int | None,
                    preset: str | None, resource_name: str = "gpu") -> str:
    """The CUDA_VISIBLE_DEVICES value for one task's training process.

    Args:
        role: the task; "ps" tasks never get GPUs (they only hold variables).
        use_gpu: False hides every GPU ("").
        owned: the task's Spark resource addresses (None when Spark gave none).
        count: how many of them to use (None: all).
        preset: CUDA_VISIBLE_DEVICES already set in the executor, or None.
    """
    if not use_gpu or role.task_type == "ps":
        return ""
    if owned is None:
        raise ConfigError(f"task {role.label} got no {resource_name!r} resource from Spark, though use_gpu=True. "
                          f"Fix: set spark.task.resource.{resource_name}.amount, "
                          f"spark.executor.resource.{resource_name}.amount and a discovery script "
                          f"(spark.executor.resource.{resource_name}.discoveryScript, or "
                          f"spark.worker.resource.{resource_name}.* on standalone), or pass use_gpu=False")
    addresses = check_gpu_addresses(owned, resource_name)
    if count is not None:
        if count > len(addresses):
            raise ConfigError(f"task {role.label} should use {count} GPU(s) but Spark gave it {len(addresses)} "
                              f"({addresses}). Fix: raise spark.task.resource.{resource_name}.amount to {count} "
                              "or ask for fewer GPUs per task")
        addresses = addresses[:count]
    return ",".join(remap_visible(addresses, preset))


def gpu_count(visible: str) -> int:
    """GPUs a CUDA_VISIBLE_DEVICES value shows ("" shows none)."""
    return gpus.Assignment(visible).count or 0


def check_gpu_counts(roles: Sequence[TaskRole], counts: Sequence[int]) -> None:
    """Refuse a cluster whose training tasks see different numbers of GPUs (every task runs this on the same list).

    Each barrier task reports its count with its address; the rule is `cluster.gpus.check_counts`, shared
    with the Ray runner.
    """
    gpus.check_counts([(r.label, counts[r.rank]) for r in roles if r.task_type != "ps"], tasks="Spark tasks",
                      fix="give every executor the same GPU resources (spark.executor.resource.gpu.amount and "
                      "spark.task.resource.gpu.amount), set gpus_per_worker, or pass use_gpu=False to train on CPU")
