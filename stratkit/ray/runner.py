"""`RayRunner`: run one training function as a TensorFlow cluster on Ray; return the chief's result on the driver.

The driver side of the Ray adapter. One `run()`:
  1. checks what can be checked before Ray places anything: the layout
     (`cluster.layout`, through `stratkit.detect`), Ray's version, and that the
     cluster has the GPUs asked for;
  2. per attempt, a placement group with one bundle per TF task, waited for at
     most `timeout` (a group Ray cannot place is a `ConfigError`, never a hang);
  3. one fresh `stratkit.ray.task.TaskActor` per task in it: the node's address,
     a held port, the TF_CONFIG checked in the actor before any TensorFlow
     import, then the training process (`stratkit.ray.child`);
  4. every task's output printed on the driver as `[worker:1] ...`; the first
     task that fails (exit code, or its actor lost with its node) stops the
     others and raises `RayTrainingError` with the root-cause report
     (`stratkit.ray.failures`); `max_retries` re-runs everything with fresh
     actors, with `min_workers` on the workers the cluster still has once Ray
     has judged the nodes whose tasks were lost (`stratkit.ray.elastic`);
  5. returns the chief's (rank 0's) return value.

Size: over 400 lines because the attempt (placement, actors, the watch of
every task, the wait for the others after a preemption) and the retry loop
around it read best together; the wording is `ray/failures.py`, the elastic
count `ray/elastic.py`, the actor `ray/task.py`.
"""

from __future__ import annotations

import pickle
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratkit import status
from stratkit.cluster import gpus
from stratkit.cluster import layout as cluster_layout
from stratkit.cluster.devices import count_gpus
from stratkit.cluster.layout import Task
from stratkit.errors import ConfigError
from stratkit.process import arguments
from stratkit.process.payload import pickle_payload
from stratkit.process.report import PREEMPTED_GRACE, is_preempted
from stratkit.ray import actors as actors_lib
from stratkit.ray import elastic, failures
from stratkit.ray import tune as ray_tune
from stratkit.ray.failures import RayTrainingError, TaskState
from stratkit.ray.task import FIX, LAUNCHER
from stratkit.ray.versions import import_ray
from stratkit.training.tracking import handoff

log = status.logger(__name__)

#: How the runner's arguments are written in layout messages (it adds the chief itself).
ARGUMENTS = cluster_layout.Spelling(workers="num_workers", ps="num_ps")
#: Seconds to wait for the placement group when `timeout` is None (kept here, where it used to live).
PLACEMENT_WAIT = actors_lib.PLACEMENT_WAIT
#: After a task fails, how long the other tasks' actors get to answer before their node counts as lost.
PROBE_SECONDS = 5.0
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RayRunReport:
    """What happened in the last `run()` (`runner.last_run`): for logs, tests and post-mortems."""

    run_id: str
    #: The last attempt's tasks (a retry with `min_workers` may run fewer than the first).
    tasks: list[str]
    attempts: int = 0
    #: Attempts that ended on a preemption notice (every task saved at one step and exited 75): retried without
    #: counting against max_retries.
    preempted: int = 0
    seconds: float = 0.0
    succeeded: bool = False
    #: Each attempt's number of training workers, in order.
    workers: list[int] = field(default_factory=list)
    #: Per task label of the last attempt: the node address it ran on, its training process id and the actor's.
    nodes: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int | None] = field(default_factory=dict)
    actor_pids: dict[str, int] = field(default_factory=dict)


class RayRunner:
    """Run `train_fn` on a Ray cluster as a TensorFlow cluster; return the chief's result on the driver.

    Args:
        num_workers: training tasks. Without `num_ps` they form a
            MultiWorkerMirroredStrategy cluster of `num_workers` "worker" tasks
            (worker 0 is the chief). With `num_ps`, a parameter-server cluster of
            one "chief" (the coordinator), `num_workers` "worker" and `num_ps` "ps" tasks.
        num_ps: parameter-server tasks (0: synchronous multi-worker training).
        use_gpu: give each training task GPUs from Ray (`gpus_per_worker`, default 1), as
            CUDA_VISIBLE_DEVICES; False hides every GPU (CUDA_VISIBLE_DEVICES="").
        gpus_per_worker: GPUs per training task (needs use_gpu=True).
        cpus_per_worker: Ray CPUs reserved per task (default 1).
        max_retries: re-run everything (fresh actors, a fresh placement group) this many times after a
            failure; train_fn using `trainer.fit(backup_dir=...)` on shared storage resumes. An attempt that
            was preempted (its tasks stopped on a preemption notice at one step, wrote their backups and
            exited 75) is re-run without counting: it resumes at that step.
        min_workers: elastic retries (no `num_ps`): a retry runs with as many workers as the live
            nodes fit, from `min_workers` to `num_workers`, counted once Ray has judged the nodes whose
            tasks were lost (`stratkit.ray.elastic`); `Trainer` keeps the global batch.
        timeout: seconds for the whole `run()`, retries included (and for placing each attempt's
            placement group; at most 300 s without it); then every task is stopped.
        placement_strategy: Ray's placement group strategy ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD").
        tune: a hyperparameter search (docs/tuning.md): `run(search_fn)` runs `num_workers` tuners of one
            search (search_fn wraps its tuner in `stratkit.tune(...)`), one actor each (`cpus_per_worker`,
            `gpus_per_worker`), with the search service on this driver; no TF_CONFIG; a dead actor or tuner
            after the search started is a lease that expires, its trial runs again on another tuner. `run`
            returns the lowest tuner's value (`stratkit.ray.tune`).

    `ray.init(...)` must have been called (to start a local Ray or join a cluster).
    Inside train_fn, `stratkit.detect()` / `stratkit.Trainer()` see the cluster
    (TF_CONFIG, `spec.source == "ray"`); train_fn runs in a fresh Python process
    per task, so it must import what it uses.
    """

    def __init__(self, num_workers: int = 2, *, num_ps: int = 0, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, cpus_per_worker: float = 1, max_retries: int = 0,
                 min_workers: int | None = None, timeout: float | None = None,
                 placement_strategy: str = "PACK", tune: bool = False) -> None:
        arguments.positive_int("num_workers", num_workers)
        self.tune = arguments.check_tune(tune, num_ps=num_ps, min_workers=min_workers, max_retries=max_retries)
        arguments.positive_int("num_ps", num_ps, minimum=0, example="1")
        self.tasks = _plan(num_workers, num_ps)
        cluster_layout.check_plan(self.tasks, launcher=LAUNCHER, fix=FIX, allow_preset=False)
        arguments.check_gpus(use_gpu, gpus_per_worker)
        arguments.positive_int("max_retries", max_retries, minimum=0, example="1")
        self.timeout = arguments.check_timeout(timeout)
        self.min_workers = arguments.check_min_workers(min_workers, num_workers, num_ps)
        if isinstance(cpus_per_worker, bool) or not isinstance(cpus_per_worker, (int, float)) or cpus_per_worker <= 0:
            raise ConfigError(f"cpus_per_worker must be a positive number: got {cpus_per_worker!r}. "
                              "Fix: e.g. cpus_per_worker=2")
        if placement_strategy not in _STRATEGIES:
            raise ConfigError(f"placement_strategy must be one of {', '.join(_STRATEGIES)}: got "
                              f"{placement_strategy!r}. Fix: e.g. placement_strategy=\"SPREAD\"")
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.cpus_per_worker = cpus_per_worker
        self.max_retries = max_retries
        self.placement_strategy = placement_strategy
        self.last_run: RayRunReport | ray_tune.SearchReport | None = None

    # -- public ---------------------------------------------------------------------------------
    def run(self, train_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `train_fn(*args, **kwargs)` on every task; return the chief's (rank 0's) return value.

        Raises:
            ConfigError: Ray is missing or too old, not initialised, the cluster lacks the GPUs, the
                placement group cannot be placed in time, or the arguments cannot be pickled.
            RayTrainingError: a task failed (after all retries), or `timeout` passed.
        """
        if not callable(train_fn):
            raise ConfigError(f"train_fn must be a function: got {type(train_fn).__name__}. "
                              "Fix: runner.run(train_fn, *args, **kwargs)")
        ray = import_ray("RayRunner")
        if not ray.is_initialized():
            raise ConfigError("RayRunner.run needs a Ray connection: ray.is_initialized() is False. Fix: call "
                              "ray.init(address=\"auto\") to join a running cluster, or ray.init(num_cpus=4, "
                              "include_dashboard=False) for a local one, before run()")
        if self.tune:
            return ray_tune.run_search(self, ray, train_fn, args, kwargs, task_devices=task_devices)
        self._check_gpus(ray)
        payload = pickle_payload(train_fn, args, kwargs, where="the Ray actors")
        report = RayRunReport(run_id=f"stratkit-{uuid.uuid4().hex[:12]}", tasks=[t.name for t in self.tasks])
        self.last_run = report
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        tasks = self.tasks
        failures_seen = 0
        try:
            while True:
                report.attempts += 1
                attempt = report.attempts
                try:
                    result = self._attempt(ray, tasks, payload, attempt, deadline, report)
                except RayTrainingError as error:
                    if error.timed_out:
                        raise
                    if error.preempted:
                        # Not a failure: every task saved at one step (stratkit launch does not count it either).
                        report.preempted += 1
                        log.warning("attempt %d was preempted (%s); re-running every task with fresh actors, "
                                    "which resume at the step of the preemption backup (a preemption is not "
                                    "counted against max_retries: %d of %d retries left)", attempt,
                                    str(error).splitlines()[0], self.max_retries - failures_seen,
                                    self.max_retries)
                    else:
                        failures_seen += 1
                        if failures_seen > self.max_retries:
                            raise
                        log.info("attempt %d of %d failed (%s); re-running every task with fresh actors", attempt,
                                 self.max_retries + 1 + report.preempted, str(error).splitlines()[0])
                    if self.min_workers is not None:
                        workers = elastic.workers_for_retry(
                            ray, error.lost_nodes, deadline, num_workers=self.num_workers,
                            min_workers=self.min_workers, cpus_per_worker=self.cpus_per_worker,
                            gpus_per_worker=self.gpus_per_worker, placement_strategy=self.placement_strategy)
                        if workers is None:
                            log.warning("the live Ray nodes fit fewer than min_workers=%d workers: not retried",
                                        self.min_workers)
                            raise
                        if workers != sum(t.role == "worker" for t in tasks):
                            log.warning("world size %d -> %d: the retry runs with the workers the live nodes fit "
                                        "(min_workers=%d, num_workers=%d)", len(tasks), workers, self.min_workers,
                                        self.num_workers)
                        tasks = _plan(workers, 0)
                    continue
                report.succeeded = True
                return result
        finally:
            report.seconds = time.monotonic() - started

    # -- steps ----------------------------------------------------------------------------------
    def _bundle(self, task: Task) -> dict[str, float]:
        bundle: dict[str, float] = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker and task.role != "ps":
            bundle["GPU"] = self.gpus_per_worker
        return bundle

    def _check_gpus(self, ray: Any) -> None:
        if not self.gpus_per_worker:
            return
        need = sum(self._bundle(t).get("GPU", 0) for t in self.tasks)
        have = ray.cluster_resources().get("GPU", 0)
        if need > have:
            raise ConfigError(f"use_gpu=True with gpus_per_worker={self.gpus_per_worker} needs {need:g} GPU(s) for "
                              f"{len(self.tasks) - self.num_ps} training task(s), but the Ray cluster has {have:g} "
                              "(ray.cluster_resources()). Fix: add GPU nodes, lower num_workers or gpus_per_worker, "
                              "or pass use_gpu=False")

    def _attempt(self, ray: Any, tasks: Sequence[Task], payload: bytes, attempt: int, deadline: float | None,
                 report: RayRunReport) -> Any:
        attempts = self.max_retries + 1 + report.preempted
        report.tasks = [t.name for t in tasks]
        report.workers.append(sum(t.role == "worker" for t in tasks))
        for record in (report.nodes, report.pids, report.actor_pids):
            record.clear()
        bundles = [self._bundle(t) for t in tasks]
        group, actors = None, []

        def get(refs: list[Any]) -> list[Any]:
            return actors_lib.get_before(ray, refs, deadline, lambda: RayTrainingError(
                f"the tasks' actors did not start within timeout={self.timeout}s (attempt {attempt} of "
                f"{self.max_retries + 1}); every task was stopped. Fix: raise timeout, or check that the Ray nodes "
                "can start workers (ray status)", attempt=attempt, timed_out=True))

        try:
            wait = actors_lib.placement_wait(deadline)
            group, actors = actors_lib.place(
                ray, [t.name for t in tasks], bundles, self.placement_strategy, wait,
                what=f"the {len(tasks)} task(s) of this run (timeout={self.timeout})",
                fix="lower num_workers, num_ps, cpus_per_worker or gpus_per_worker, add nodes, or use "
                    "placement_strategy=\"PACK\"")
            where = get([a.where.remote() for a in actors])
            hosts = actors_lib.node_addresses(ray, where)
            held = get([a.hold.remote(host) for a, host in zip(actors, hosts)])
            cluster = cluster_layout.build_cluster(
                tasks, [cluster_layout.format_address(h, p) for h, p in zip(hosts, held)])
            chief = cluster_layout.primary_task(tasks)
            states = [TaskState(task.name, rank, hosts[rank], node_id=where[rank]["node_id"])
                      for rank, task in enumerate(tasks)]
            for rank, task in enumerate(tasks):
                report.nodes[task.name] = hosts[rank]
                report.actor_pids[task.name] = where[rank]["pid"]
            visible = task_devices(tasks, [w["gpus"] for w in where], self.gpus_per_worker)
            handed = handoff.hand_over()  # the driver's MLflow run, continued by the chief (stratkit.tracking)
            replies = get([a.start.remote(cluster, t.role, t.index, (chief.role, chief.index), payload, t == chief,
                                          devices, handed) for a, t, devices in zip(actors, tasks, visible)])
            for state, reply in zip(states, replies):
                state.pid = reply.get("pid")
                report.pids[state.label] = state.pid
            refused = next((reply["error"] for reply in replies if "error" in reply), None)
            if refused is not None:
                raise ConfigError(refused)
            log.info("%s: attempt %d, %d task(s) (%s) on %s", report.run_id, attempt, len(tasks),
                     ", ".join(t.name for t in tasks), ", ".join(sorted(set(hosts))))
            self._watch(ray, actors, states, attempt, attempts, deadline)
            value = ray.get(actors[tasks.index(chief)].result.remote())
            return None if value is None else pickle.loads(value)
        finally:
            actors_lib.release(ray, group, actors)

    def _watch(self, ray: Any, actors: Sequence[Any], states: Sequence[TaskState], attempt: int, attempts: int,
               deadline: float | None) -> None:
        """Print every task's lines until all exited 0; raise on the first failure or at the deadline."""
        from ray.exceptions import RayActorError

        cursors = [0] * len(actors)
        pending = {actors[i].poll.remote(0): i for i in range(len(actors))}
        preempted: TaskState | None = None  # the first task that exited 75: the others stop at the same step
        grace = 0.0
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                raise failures.timed_out(states, self.timeout, attempt, attempts)
            if preempted is not None and time.monotonic() > grace:
                break  # the others had their time to write their backups
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                i = pending.pop(ref)
                state = states[i]
                try:
                    reply = ray.get(ref)
                except RayActorError as exc:
                    state.lost = actors_lib.lost_reason(exc)
                    raise failures.task_failed(state, states, attempt, attempts) from None
                cursors[i] = reply["cursor"]
                if not actors_lib.follow(state, reply):
                    pending[actors[i].poll.remote(cursors[i])] = i
                    continue
                if is_preempted(state.exit_code) and preempted is None:
                    preempted, grace = state, time.monotonic() + PREEMPTED_GRACE
                    continue
                if state.exit_code != 0 and preempted is None:
                    lost = self._unanswered(ray, actors, states, pending.values())
                    # A task whose peer's node died usually fails first (its collective breaks at once, while
                    # Ray takes its health check to declare the node dead): the lost node is the root cause.
                    raise failures.task_failed(lost[0] if lost else state, states, attempt, attempts)
        if preempted is not None:
            raise failures.task_failed(preempted, states, attempt, attempts)

    def _unanswered(self, ray: Any, actors: Sequence[Any], states: Sequence[TaskState],
                    running: Any) -> list[TaskState]:
        """The running tasks whose actors do not answer within PROBE_SECONDS (their node is likely lost)."""
        indices = sorted(set(running))
        if not indices:
            return []
        probes = {actors[i].where.remote(): i for i in indices}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=PROBE_SECONDS)
        lost = []
        for ref, i in probes.items():
            if ref in ready:
                try:
                    ray.get(ref)
                    continue
                except Exception as exc:  # noqa: BLE001 - RayActorError and kin: the actor is gone
                    states[i].lost = actors_lib.lost_reason(exc)
            else:
                states[i].lost = f"its actor did not answer within {PROBE_SECONDS:g} s"
            lost.append(states[i])
        return lost


def task_devices(tasks: Sequence[Task], assigned: Sequence[str | None], gpus_per_worker: int) -> list[str]:
    """Each task's training-process CUDA_VISIBLE_DEVICES, from the GPUs Ray assigned its actor; checked.

    A training task gets Ray's assignment (the actor's CUDA_VISIBLE_DEVICES); a ps task, and every task
    without `use_gpu`, gets none (""). Before any training process starts, the counts go through the
    rule every runner shares (`cluster.gpus.check_counts`: a mix of GPU and CPU-only workers, or
    different counts, is refused naming every task), then each must be the `gpus_per_worker` asked for.

    Args:
        tasks: the attempt's tasks, in rank order.
        assigned: per task, the CUDA_VISIBLE_DEVICES its actor reported (None: Ray set none).
        gpus_per_worker: GPUs asked per training task (0: use_gpu=False).
    """
    visible = ["" if not gpus_per_worker or task.role == "ps" else
               ",".join(d.strip() for d in (ids or "").split(",") if d.strip())
               for task, ids in zip(tasks, assigned)]
    training = [(task.name, count_gpus({"CUDA_VISIBLE_DEVICES": devices}))
                for task, devices in zip(tasks, visible) if task.role != "ps"]
    gpus.check_counts(training, tasks="Ray tasks",
                      fix="start every Ray node with its GPUs (ray start --num-gpus), do not set "
                      "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES on the nodes, or pass use_gpu=False")
    for (label, count), ids in zip(training, [a for t, a in zip(tasks, assigned) if t.role != "ps"]):
        if gpus_per_worker and count != gpus_per_worker:
            raise ConfigError(f"task {label} was given CUDA_VISIBLE_DEVICES={ids!r} by Ray, not "
                              f"{gpus_per_worker} GPU(s). Fix: do not set RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_"
                              "DEVICES on the nodes, and start them with their GPUs (ray start --num-gpus)")
    return visible


def _plan(num_workers: int, num_ps: int) -> list[Task]:
    return cluster_layout.plan_tasks(num_workers, chief=num_ps > 0, ps=num_ps, spelling=ARGUMENTS)
