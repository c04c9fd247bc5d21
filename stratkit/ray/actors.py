"""The actors of one Ray attempt: placed one per bundle of a placement group, asked in time, stopped.

Shared by `RayRunner`'s training attempt (`stratkit.ray.runner`) and its
search (`stratkit.ray.tune`): both place one fresh `stratkit.ray.task.TaskActor`
per task in a placement group waited for at most the run's time (a group Ray
cannot place is a `ConfigError`, never a hang), ask them within the run's
deadline (`get_before`), and stop them and remove the group whatever happened
(`release`), and follow each one's output and exit (`follow`).

Imports Ray only through the `ray` module the caller hands in (and its
placement group helpers, on use); no TensorFlow.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.process.pump import prefixed
from stratkit.ray.task import TaskActor

log = status.logger(__name__)

#: Seconds to wait for the placement group when the run has no timeout (a run never waits forever for resources).
PLACEMENT_WAIT = 300.0


def placement_wait(deadline: float | None) -> float:
    """How long the placement group may take: until the run's deadline, else `PLACEMENT_WAIT`."""
    return PLACEMENT_WAIT if deadline is None else max(deadline - time.monotonic(), 0.0)


def place(ray: Any, labels: Sequence[str], bundles: Sequence[dict[str, float]], strategy: str, wait: float, *,
          what: str, fix: str) -> tuple[Any, list[Any]]:
    """A placement group of `bundles` and one fresh actor per bundle (its label from `labels`).

    Raises:
        ConfigError: Ray could not place the group within `wait` seconds (it is removed): `what` could not be
            placed, the bundles, the cluster's resources, and `fix`.
    """
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(list(bundles), strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=wait)
    if not ready:
        remove_placement_group(group)
        raise ConfigError(f"Ray could not place {what} (one bundle each: {describe(bundles)}, placement_strategy="
                          f"{strategy!r}) within {wait:g} s; the cluster has {resources(ray.cluster_resources())}, "
                          f"free now {resources(ray.available_resources())}. Fix: {fix}")
    remote = ray.remote(TaskActor)
    actors = [remote.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
                             max_task_retries=0,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(
                                 group, placement_group_bundle_index=rank)).remote(label)
              for rank, (label, bundle) in enumerate(zip(labels, bundles))]
    return group, actors


def get_before(ray: Any, refs: list[Any], deadline: float | None, timed_out: Callable[[], Exception]) -> list[Any]:
    """`ray.get(refs)` within the run's deadline; `timed_out()` is raised when it passes (actors Ray cannot start
    in time end the run, never hang it)."""
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=None if deadline is None else max(deadline - time.monotonic(), 0.1))
    except GetTimeoutError:
        raise timed_out() from None


def node_addresses(ray: Any, where: Sequence[dict[str, Any]]) -> list[str]:
    """Each actor's node address, from the node ids its `where()` reported."""
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}
    return [addresses.get(w["node_id"], "?") for w in where]


def lost_reason(exc: BaseException) -> str:
    """Why an actor is gone, in a line (Ray's error's first)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def follow(state: Any, reply: dict[str, Any]) -> bool:
    """Take one `TaskActor.poll` reply into the task's `state`: print its lines with the task's prefix, keep the
    last 50, and record its exit code and exception once it exited; True then."""
    for text in reply["lines"]:
        print(prefixed(state.label, text), file=sys.stdout, flush=True)
    state.lines = (state.lines + reply["lines"])[-50:]
    if reply["exit"] is None:
        return False
    state.exit_code = reply["exit"]
    state.exception = tuple(reply["exception"])
    return True


def release(ray: Any, group: Any, actors: Sequence[Any]) -> None:
    """Stop every actor (its training process, its port, its workdir), kill it, and remove the group."""
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=15)
        except Exception as exc:  # noqa: BLE001 - a lost actor cannot stop; its process died with it
            log.debug("could not stop an actor: %s", exc)
        ray.kill(actor)
    if group is not None:
        remove_placement_group(group)


def describe(bundles: Sequence[dict[str, float]]) -> str:
    """`2 x {CPU: 1}`: the bundles, counted by kind."""
    kinds: dict[str, int] = {}
    for bundle in bundles:
        key = resources(bundle)
        kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{count} x {key}" for key, count in kinds.items())


def resources(amounts: dict[str, float]) -> str:
    """`{CPU: 4, GPU: 0}`: the CPUs and GPUs of a resource mapping."""
    shown = {k: v for k, v in amounts.items() if k in ("CPU", "GPU")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


__all__ = ["PLACEMENT_WAIT", "describe", "follow", "get_before", "lost_reason", "node_addresses", "place",
           "placement_wait", "release", "resources"]
