"""`RayRunner(num_workers=N, min_workers=M)`: how many workers a retry runs after a task's node was lost.

When a node dies, the tasks on the other nodes fail first: their collectives
break at once (the lost node refuses connections) or TensorFlow's coordination
heartbeat times out (it is silent). Ray itself lists the node as alive until
its GCS health check has failed `health_check_failure_threshold` (5) times in
a row: about 15 s when the node's processes are gone but its address refuses
connections, about 65 s with Ray's defaults when it is silent (a power loss:
each check waits `health_check_timeout_ms`, 10 s, then `health_check_period_ms`,
3 s). Counting the live nodes before that counts the lost one: the retry asked
for N workers, Ray could not place them, and the run waited out its whole
timeout (measured on two test hosts: a `ConfigError` after 536 s).

So before it counts, the runner waits for Ray's verdict on each node whose task
was lost: dead (Ray marks it so), or alive (a probe task pinned to it ran: only
the actor's process died). Then the retry runs
`stratkit.process.arguments.workers_within` of what the live nodes fit: each
node's CPUs (and GPUs) per worker, at most one worker per node with
STRICT_SPREAD (which places no two bundles on one node).

Imports no TensorFlow; the caller passes Ray in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from stratkit import status
from stratkit.process import arguments

log = status.logger(__name__)

#: The longest wait for Ray's verdict on a lost node when the run has no timeout (seconds).
VERDICT_WAIT = 300.0


def _answer() -> str:
    """The probe task: it runs only on a node that is alive."""
    return "alive"


def judge_nodes(ray: Any, node_ids: Iterable[str], deadline: float | None) -> dict[str, str]:
    """Wait until Ray has judged each node: "dead" (marked so) or "alive" (a probe pinned to it ran).

    A node still undecided at `deadline` (at most `VERDICT_WAIT` s from now) is "unjudged".
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = time.monotonic()
    end = started + VERDICT_WAIT if deadline is None else min(started + VERDICT_WAIT, deadline)
    probe = ray.remote(num_cpus=0, max_retries=0)(_answer)

    def send(node_id: str) -> Any:
        return probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()

    def alive() -> set[str]:
        return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}

    # No probe to a node Ray has already judged: its error would only be logged as unhandled.
    listed = alive()
    verdicts = {node_id: "dead" for node_id in set(node_ids) if node_id not in listed}
    pending = {send(node_id): node_id for node_id in set(node_ids) if node_id in listed}
    while pending:
        listed = alive()
        for ref, node_id in list(pending.items()):
            if node_id not in listed:
                verdicts[node_id] = "dead"
                del pending[ref]
                _cancel(ray, ref)
        if not pending or time.monotonic() >= end:
            break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(min(1.0, end - time.monotonic()), 0.01))
        for ref in ready:
            node_id = pending.pop(ref)
            try:
                ray.get(ref)
                verdicts[node_id] = "alive"
            except Exception:  # noqa: BLE001 - the probe could not run there: ask again until Ray decides
                time.sleep(0.5)
                pending[send(node_id)] = node_id
    for ref, node_id in pending.items():
        verdicts[node_id] = "unjudged"
        _cancel(ray, ref)
    return verdicts


def _cancel(ray: Any, ref: Any) -> None:
    """Drop a probe that is no longer waited for."""
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - a probe on a node that is going away may not be cancellable
        pass


def room_for_workers(nodes: Iterable[dict[str, Any]], cpus_per_worker: float, gpus_per_worker: int,
                     placement_strategy: str) -> int:
    """How many one-bundle workers the alive nodes of `ray.nodes()` fit (STRICT_SPREAD: one per node)."""
    room = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        count = int(resources.get("CPU", 0) // cpus_per_worker)
        if gpus_per_worker:
            count = min(count, int(resources.get("GPU", 0) // gpus_per_worker))
        if placement_strategy == "STRICT_SPREAD":
            count = min(count, 1)
        room += count
    return room


def workers_for_retry(ray: Any, lost_nodes: Iterable[str], deadline: float | None, *, num_workers: int,
                      min_workers: int, cpus_per_worker: float, gpus_per_worker: int,
                      placement_strategy: str) -> int | None:
    """The workers the next attempt runs once Ray has judged the nodes in `lost_nodes` (Ray node ids);
    None below `min_workers`."""
    lost = sorted(set(lost_nodes))
    if lost:
        addresses = {node["NodeID"]: node.get("NodeManagerAddress", "?") for node in ray.nodes()}
        started = time.monotonic()
        log.info("waiting for Ray's verdict on node(s) %s, whose task was lost",
                 ", ".join(addresses.get(n, n[:12]) for n in lost))
        verdicts = judge_nodes(ray, lost, deadline)
        log.info("Ray's verdict after %.1f s: %s", time.monotonic() - started,
                 ", ".join(f"{addresses.get(n, n[:12])} {verdicts[n]}" for n in lost))
    room = room_for_workers(ray.nodes(), cpus_per_worker, gpus_per_worker, placement_strategy)
    return arguments.workers_within(room, num_workers, min_workers)
