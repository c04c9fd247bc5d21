"""A hyperparameter search on Ray: `RayRunner(num_workers=N, tune=True).run(search_fn)`.

The driver side. `search_fn` builds a tuner and searches
(`stratkit.tune(keras_tuner.Hyperband(...)).search(...)`, docs/tuning.md);
one `run()`:

1. checks that the cluster has room for N tuners at once (`cpus_per_worker`,
   `gpus_per_worker` each): more tuners than that is a ConfigError before any
   trial (they would wait for each other at the search's start);
2. hosts the search service here (`stratkit.tuning.driver.DriverSearch`), on
   this node's address (loopback on a one-node Ray; `STRATKIT_TUNE_HOST` to
   choose; the search's token guards it);
3. places one bundle per tuner (a placement group, waited for at most
   `timeout`), one fresh `stratkit.ray.task.TaskActor` per bundle, and starts
   each tuner's process in its actor (`start_tuner`: no TF_CONFIG, its GPUs
   from Ray);
4. prints every tuner's lines as `[tuner:1] ...` and judges each end
   (`DriverSearch.judge`): a tuner that dies before the search started fails
   the run (`RayTrainingError`, the root-cause report); a dead actor or
   process after it is a lease that expires (its trial runs again on another
   tuner), and the run goes on; a tuner still running `STOP_GRACE` s after the
   search ended (hung) is stopped;
5. returns the lowest tuner's return value; the search's own failure (a
   ConfigError every tuner saw) is raised first.
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratkit import status
from stratkit.cluster.layout import Task
from stratkit.errors import ConfigError
from stratkit.process.payload import pickle_payload
from stratkit.ray import actors as actors_lib
from stratkit.ray import failures
from stratkit.ray.failures import RayTrainingError, TaskState
from stratkit.training.tracking import handoff
from stratkit.tuning import environment
from stratkit.tuning.driver import DriverSearch, lost_message
from stratkit.tuning.service import STOP_GRACE

log = status.logger(__name__)

ENGINE = "RayRunner(tune=True)"


@dataclass
class SearchReport:
    """What happened in the last search (`runner.last_run`): for logs, tests and post-mortems."""

    run_id: str
    tuners: list[str]
    seconds: float = 0.0
    succeeded: bool = False
    #: Per tuner: its exit code (None: its actor was lost), node, training process and actor ids.
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int | None] = field(default_factory=dict)
    actor_pids: dict[str, int] = field(default_factory=dict)
    #: Tuners lost after the search started (their trials ran again elsewhere), in the order seen.
    lost: list[str] = field(default_factory=list)
    #: The search service's address on the driver.
    service: tuple[str, int] | None = None


def check_room(ray: Any, runner: Any) -> None:
    """Refuse more tuners than the Ray cluster runs at once (CPUs, GPUs), before anything is placed."""
    have = ray.cluster_resources()
    n = runner.num_workers
    for resource, each in (("CPU", runner.cpus_per_worker), ("GPU", runner.gpus_per_worker)):
        need = n * each
        if each and need > have.get(resource, 0):
            flag = "cpus_per_worker" if resource == "CPU" else "gpus_per_worker"
            raise ConfigError(f"a search of {n} tuners with {flag}={each:g} needs {need:g} {resource}(s) at once, "
                              f"but the Ray cluster has {have.get(resource, 0):g} (ray.cluster_resources()): the "
                              f"tuners that find no room would start after the others, which wait for them at the "
                              f"search's start. Fix: num_workers={int(have.get(resource, 0) // each)} or fewer, "
                              f"a smaller {flag}, or more nodes")


def service_host(ray: Any) -> str:
    """Where the service listens: STRATKIT_TUNE_HOST, else this node's address as Ray knows it (the address
    the other nodes reach this one at; loopback on a one-node Ray started on loopback)."""
    named = os.environ.get(environment.HOST_VAR, "").strip()
    if named:
        return named
    try:
        here = ray.get_runtime_context().get_node_id()
        return next(str(node["NodeManagerAddress"]) for node in ray.nodes() if node["NodeID"] == here)
    except Exception:  # noqa: BLE001 - a driver without a node of its own (Ray Client): loopback
        return environment.DEFAULT_HOST


def run_search(runner: Any, ray: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, *,
               task_devices: Callable[..., list[str]]) -> Any:
    """`runner.run(fn, ...)` for a `RayRunner(tune=True)` (see the module's docstring); `task_devices` is the
    runner's rule for each task's GPUs (`stratkit.ray.runner.task_devices`)."""
    called = time.monotonic()
    check_room(ray, runner)
    payload = pickle_payload(fn, args, kwargs, where="the Ray actors")
    n = runner.num_workers
    labels = [f"tuner:{i}" for i in range(n)]
    report = SearchReport(run_id=f"stratkit-{uuid.uuid4().hex[:12]}", tuners=labels)
    runner.last_run = report
    deadline = None if runner.timeout is None else called + runner.timeout
    bundle = {"CPU": runner.cpus_per_worker, **({"GPU": runner.gpus_per_worker} if runner.gpus_per_worker else {})}
    search = DriverSearch(n, engine=ENGINE, host=service_host(ray))
    report.service = search.address
    group, actors = None, []

    def get(refs: list[Any]) -> list[Any]:
        return actors_lib.get_before(ray, refs, deadline, lambda: RayTrainingError(
            f"the tuners' actors did not start within timeout={runner.timeout}s; every tuner was stopped. Fix: "
            "raise timeout, or check that the Ray nodes can start workers (ray status)", attempt=1, timed_out=True))

    try:
        group, actors = actors_lib.place(
            ray, labels, [dict(bundle) for _ in range(n)], runner.placement_strategy,
            actors_lib.placement_wait(deadline), what=f"the {n} tuner(s) of this search",
            fix="fewer tuners (num_workers), smaller cpus_per_worker/gpus_per_worker, or placement_strategy=\"PACK\"")
        where = get([a.where.remote() for a in actors])
        states = [TaskState(label, rank, node, node_id=w["node_id"])
                  for rank, (label, w, node) in enumerate(zip(labels, where, actors_lib.node_addresses(ray, where)))]
        visible = task_devices([Task("worker", i) for i in range(n)], [w["gpus"] for w in where],
                               runner.gpus_per_worker)
        handed = handoff.hand_over()
        advertise = search.address[0]
        replies = get([a.start_tuner.remote(search.task_env(rank, advertise), payload, devices, handed)
                       for rank, (a, devices) in enumerate(zip(actors, visible))])
        for state, reply, w in zip(states, replies, where):
            state.pid = reply.get("pid")
            report.pids[state.label] = state.pid
            report.nodes[state.label] = state.node
            report.actor_pids[state.label] = w["pid"]
        refused = next((reply["error"] for reply in replies if "error" in reply), None)
        if refused is not None:
            raise ConfigError(refused)
        log.info("%s: a search of %d tuner(s) on %s, the service at %s", report.run_id, n,
                 ", ".join(sorted({s.node for s in states})), environment.format_address(*search.address))
        returned = _watch(ray, actors, states, search, report, deadline, runner.timeout)
        ended, rank = search.outcome(returned)
        if not ended or not returned:  # every tuner was lost: the searches' states are on their stores
            cause = failures.task_failed(next(s for s in states if s.exit_code != 0), states, 1, 1)
            raise RayTrainingError(f"no tuner ran its search function to its end (each was lost: "
                                   f"{', '.join(report.lost)}); a new run resumes the searches from their stores. "
                                   f"The first lost: {cause}", task=cause.task, rank=cause.rank,
                                   exit_code=cause.exit_code, node=cause.node, lines=cause.lines, attempt=1,
                                   lost=cause.lost)
        report.succeeded = True
        if rank is None:
            return None
        value = ray.get(actors[rank].result.remote())
        return None if value is None else pickle.loads(value)
    finally:
        actors_lib.release(ray, group, actors)
        search.close()
        report.seconds = time.monotonic() - called


def _watch(ray: Any, actors: Sequence[Any], states: Sequence[TaskState], search: DriverSearch,
           report: SearchReport, deadline: float | None, timeout: float | None) -> dict[int, int]:
    """Print every tuner's lines until all ended; {tuner: its rank} of those that returned. Raises on a tuner
    that fails before the search started (after stopping the others), and at the deadline."""
    from ray.exceptions import RayActorError

    cursors = [0] * len(actors)
    pending = {actors[i].poll.remote(0): i for i in range(len(actors))}
    returned: dict[int, int] = {}
    ended_at = None
    while pending:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise failures.timed_out(list(states), timeout, 1, 1)
        search.check()
        if search.ended and returned:  # (a tuner that returned ran the script's last search; see spark/tune.py)
            ended_at = ended_at or now
            if now - ended_at > STOP_GRACE:  # hung tuners: stop them (their poll then answers with the exit)
                for i in set(pending.values()):
                    log.warning("the search ended %g s ago and %s did not exit: stopped", STOP_GRACE,
                                states[i].label)
                    actors[i].stop.remote()
                ended_at = now
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
        for ref in ready:
            i = pending.pop(ref)
            state = states[i]
            try:
                reply = ray.get(ref)
            except RayActorError as exc:
                state.lost = actors_lib.lost_reason(exc)
                _ended(state, None, states, search, report)
                continue
            cursors[i] = reply["cursor"]
            if not actors_lib.follow(state, reply):
                pending[actors[i].poll.remote(cursors[i])] = i
                continue
            if _ended(state, state.exit_code, states, search, report) == "ok":
                returned[state.rank] = state.rank
    search.check()
    return returned


def _ended(state: TaskState, code: int | None, states: Sequence[TaskState], search: DriverSearch,
           report: SearchReport) -> str:
    """Judge one tuner's end: record it; raise for a failure before the search started."""
    report.exit_codes[state.label] = code
    verdict = search.judge(code)
    if verdict == "lost":
        report.lost.append(state.label)
        how = f"lost its actor ({state.lost})" if state.lost else f"exited with code {code}"
        log.warning("%s", lost_message(state.label, how))
    elif verdict == "failed":
        search.check()  # the search's own failure (the same on every tuner) first
        raise failures.task_failed(state, states, 1, 1)
    return verdict


__all__ = ["ENGINE", "SearchReport", "check_room", "run_search", "service_host"]
