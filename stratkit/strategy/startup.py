"""Before a MultiWorkerMirroredStrategy starts on a task that is not the coordination leader: wait for the leader.

TensorFlow's MultiWorkerMirroredStrategy starts a coordination service on
one task, the leader (`chief:0` when the cluster has a chief, else
`worker:0`), and every other task registers with it while the strategy is
created. A task that tries before the leader's server listens gets a refused
connection, and gRPC retries only after its reconnect backoff: 1 s, then
1.6 s, 2.6 s, ... (each +-20%). Measured (TF 2.21, 2 workers on one host, the
leader starting 0.5 s after the other): both strategies were ready 1.0-1.2 s
after the first started; waiting for the leader's port first, 0.6 s -- 0.1 s
after the leader started. On Spark and under `stratkit launch` the tasks
finish importing TensorFlow at nearly the same moment, so which one comes
first is chance: the wait took about 1 s off half the cold Spark runs.

The wait is a TCP connect to the leader's address, retried every 10 ms; it
never replaces TensorFlow's own handling: after `MAX_WAIT_SECONDS` (or when
the address cannot be parsed) the strategy is created as before, and
TensorFlow reports what it finds. A status line says what is awaited when
the wait is long.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping

from stratkit import status

#: After this long, create the strategy anyway (TensorFlow then waits and reports on its own).
MAX_WAIT_SECONDS = 600.0
#: Say what the task waits for after this long.
REPORT_AFTER_SECONDS = 10.0
POLL_SECONDS = 0.01

log = status.logger(__name__)


def coordination_leader(cluster: Mapping[str, list[str]]) -> tuple[str, int] | None:
    """The task that hosts MultiWorkerMirroredStrategy's coordination service: chief 0, else worker 0."""
    for role in ("chief", "worker"):
        if cluster.get(role):
            return role, 0
    return None


def split_address(address: str) -> tuple[str, int] | None:
    """("host", port) from "host:port" or "[v6]:port"; None if it is not that shape."""
    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def accepts_connection(address: str, timeout: float = 1.0) -> bool:
    """True when "host:port" accepts a TCP connection within `timeout` seconds (False also if it is not host:port).

    A held port (`stratkit.process.ports.hold_port`) refuses: only a task's running server accepts.
    """
    target = split_address(address)
    if target is None:
        return False
    try:
        socket.create_connection(target, timeout=timeout).close()
        return True
    except OSError:
        return False


def wait_for_leader(cluster: Mapping[str, list[str]], task_type: str | None, task_index: int | None, *,
                    max_wait: float = MAX_WAIT_SECONDS, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> float | None:
    """On a task other than the leader, return once the leader's address accepts a connection.

    Returns the seconds waited, or None when there is nothing to wait for
    (no cluster, this task is the leader, or its address is not host:port).
    """
    leader = coordination_leader(cluster)
    if leader is None or (task_type, task_index) == leader:
        return None
    role, index = leader
    if split_address(cluster[role][index]) is None:
        return None
    started = clock()
    reported = False
    while True:
        if accepts_connection(cluster[role][index]):
            return clock() - started
        waited = clock() - started
        if waited >= max_wait:
            log.warning(f"the coordination leader {role}:{index} at {cluster[role][index]} did not accept a "
                        f"connection in {waited:.0f} s; creating the strategy anyway (TensorFlow reports what "
                        "it finds)")
            return waited
        if not reported and waited >= REPORT_AFTER_SECONDS:
            log.info(f"waiting for {role}:{index} at {cluster[role][index]} (the coordination leader) to start "
                     f"its server: {waited:.0f} s so far")
            reported = True
        sleep(POLL_SECONDS)
