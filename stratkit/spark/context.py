"""`pyspark.BarrierTaskContext.get()` inside train_fn, though train_fn runs in its own process.

spark-tensorflow-distributor runs train_fn inside Spark's Python worker, so
its users call `BarrierTaskContext.get()` there (`allGather`, `barrier`,
`partitionId`, `getTaskInfos`). stratkit runs train_fn in a fresh process
(see `stratkit.spark.process`), where Spark set no task context. So:

  * the task (`ContextServer`) serves its real context on a loopback port;
  * the training process installs a `BarrierTaskContext` whose methods
    forward to it (`install_proxy`), so `BarrierTaskContext.get()` and
    `TaskContext.get()` return it.

The channel: 127.0.0.1 only; the first line must be the task's random token
(compared in constant time, at most 64 bytes read before it), then one JSON
request per line and one JSON reply per line. Nothing is ever unpickled.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import threading
from typing import Any

from stratkit.errors import StratkitError

#: "port:token" of the task's context server, in the training process's environment.
CONTEXT_VAR = "STRATKIT_SPARK_CONTEXT"
_TOKEN_BYTES = 64
_HELLO_TIMEOUT = 10.0
_MAX_REQUEST = 16 << 20  # an allGather message can be large, but not unbounded
#: The `BarrierTaskContext` methods the training process can call (`_call` answers them).
FORWARDED = ("partitionId", "attemptNumber", "stageId", "stageAttemptNumber", "taskAttemptId", "cpus",
             "getLocalProperty", "resources", "allGather", "barrier", "getTaskInfos")


class TaskContextError(StratkitError, RuntimeError):
    """A `BarrierTaskContext` call in the training process that its Spark task could not answer."""


class ContextServer:
    """The task's end: answers the training process's context calls with the task's real `BarrierTaskContext`."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.token = secrets.token_hex(16)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._calls = threading.Lock()  # barrier/allGather are collective: one at a time per task
        self._closed = False
        threading.Thread(target=self._accept_loop, name="stratkit-context", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.port}:{self.token}"

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="stratkit-context-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_HELLO_TIMEOUT)
            reader = conn.makefile("rb")
            try:
                token = reader.readline(_TOKEN_BYTES + 1).rstrip(b"\n")
            except OSError:
                return
            if not hmac.compare_digest(token, self.token.encode()):
                return
            conn.settimeout(None)
            try:
                while True:
                    raw = reader.readline(_MAX_REQUEST)
                    if not raw:
                        return
                    conn.sendall((json.dumps(self._answer(raw)) + "\n").encode())
            except OSError:
                return

    def _answer(self, raw: bytes) -> dict[str, Any]:
        try:
            request = json.loads(raw)
            method, args = request["method"], request.get("args", [])
            with self._calls:
                return {"value": _call(self._context, method, args)}
        except Exception as exc:  # noqa: BLE001 - the error is re-raised in the training process
            return {"error": f"{type(exc).__name__}: {exc}"}

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


def _call(context: Any, method: str, args: list) -> Any:
    """Run one call on the real context; the value as JSON-able data."""
    if method == "getTaskInfos":
        return [info.address for info in context.getTaskInfos()]
    if method == "resources":
        return {name: [resource.name, list(resource.addresses)] for name, resource in context.resources().items()}
    if method == "allGather":
        return list(context.allGather(str(args[0]) if args else ""))
    if method == "barrier":
        context.barrier()
        return None
    if method == "getLocalProperty":
        return context.getLocalProperty(str(args[0]))
    if method in FORWARDED:
        return getattr(context, method)()
    raise ValueError(f"BarrierTaskContext.{method} is not available inside stratkit's training process "
                     f"(available: {', '.join(FORWARDED)})")


# -- the training process's end ---------------------------------------------------------------

class _Channel:
    def __init__(self, address: str) -> None:
        port, _, token = address.partition(":")
        self._sock = socket.create_connection(("127.0.0.1", int(port)))
        self._sock.sendall(token.encode() + b"\n")
        self._reader = self._sock.makefile("rb")
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            self._sock.sendall((json.dumps({"method": method, "args": list(args)}) + "\n").encode())
            raw = self._reader.readline()
        if not raw:
            raise TaskContextError(f"BarrierTaskContext.{method}: the Spark task's context channel closed, so the "
                                   "task is ending (another task failed, or the run was stopped or timed out). Fix: "
                                   "see the driver's SparkTrainingError for why; call BarrierTaskContext only "
                                   "while train_fn runs")
        reply = json.loads(raw)
        if "error" in reply:
            raise TaskContextError(f"BarrierTaskContext.{method} failed in the Spark task: {reply['error']}. Fix: "
                                   "check the call's arguments (e.g. allGather takes one str, and every task must "
                                   "make the same barrier/allGather calls in the same order)")
        return reply["value"]


def install_proxy(environ: Any = os.environ) -> bool:
    """In the training process: make `BarrierTaskContext.get()` return a proxy of the task's context.

    Returns False when there is no task (local mode) or pyspark is not importable.
    """
    address = environ.get(CONTEXT_VAR)
    if not address:
        return False
    try:
        from pyspark.resource import ResourceInformation
        from pyspark.taskcontext import BarrierTaskContext, BarrierTaskInfo, TaskContext
    except ImportError:
        return False
    channel: list[_Channel] = []  # connected on first use: most train_fns never call it

    def call(method: str, *args: Any) -> Any:
        if not channel:
            channel.append(_Channel(address))
        return channel[0].call(method, *args)

    class ProxyBarrierTaskContext(BarrierTaskContext):
        """The Spark task's `BarrierTaskContext`, seen from stratkit's training process."""

        def __init__(self) -> None:  # pyspark's __init__ is not meant to be called
            self._localProperties = None
            self._resources = None

        def partitionId(self) -> int:
            return call("partitionId")

        def attemptNumber(self) -> int:
            return call("attemptNumber")

        def stageId(self) -> int:
            return call("stageId")

        def stageAttemptNumber(self) -> int:
            return call("stageAttemptNumber")

        def taskAttemptId(self) -> int:
            return call("taskAttemptId")

        def cpus(self) -> int:
            return call("cpus")

        def getLocalProperty(self, key: str) -> str | None:
            return call("getLocalProperty", key)

        def resources(self) -> dict:
            return {name: ResourceInformation(info[0], info[1]) for name, info in call("resources").items()}

        def allGather(self, message: str = "") -> list[str]:
            if not isinstance(message, str):
                raise TypeError(f"Argument `message` should be of type str, got {type(message).__name__}")
            return call("allGather", message)

        def barrier(self) -> None:
            call("barrier")

        def getTaskInfos(self) -> list:
            return [BarrierTaskInfo(address) for address in call("getTaskInfos")]

    proxy = ProxyBarrierTaskContext()
    # The attribute pyspark's own worker sets when a barrier task starts (BarrierTaskContext._initialize).
    BarrierTaskContext._taskContext = proxy
    TaskContext._taskContext = proxy
    return True
