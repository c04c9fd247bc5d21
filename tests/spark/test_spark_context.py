"""The task context channel (stratkit.spark.context): loopback only, token first, JSON only.

The server is exercised with a stand-in for pyspark's BarrierTaskContext (the Spark side is tested for real in
test_spark_runs.py); what is under test here is the channel.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest

from stratkit.errors import StratkitError
from stratkit.spark.context import CONTEXT_VAR, ContextServer, TaskContextError, install_proxy


class RecordingContext:
    def __init__(self):
        self.calls = []

    def partitionId(self):
        self.calls.append("partitionId")
        return 1

    def allGather(self, message=""):
        self.calls.append(("allGather", message))
        return [message, "other"]


def _ask(port, first_line, request):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(first_line + b"\n" + json.dumps(request).encode() + b"\n")
        return conn.makefile("rb").readline()


def test_the_channel_listens_on_loopback_only():
    server = ContextServer(RecordingContext())
    try:
        assert server._sock.getsockname()[0] == "127.0.0.1"
    finally:
        server.close()


def test_a_wrong_token_is_disconnected_before_any_call():
    context = RecordingContext()
    server = ContextServer(context)
    try:
        assert _ask(server.port, b"0" * 32, {"method": "partitionId"}) == b""
        assert _ask(server.port, b"x" * 5000, {"method": "partitionId"}) == b""  # no unbounded read either
        assert context.calls == []
    finally:
        server.close()


def test_calls_with_the_token_reach_the_context():
    context = RecordingContext()
    server = ContextServer(context)
    try:
        token = server.token.encode()
        reply = json.loads(_ask(server.port, token, {"method": "allGather", "args": ["hi"]}))
        assert reply == {"value": ["hi", "other"]}
        assert "not available" in json.loads(_ask(server.port, token, {"method": "__reduce__"}))["error"]
    finally:
        server.close()


class BarrierTimesOut(RecordingContext):
    def barrier(self):
        raise RuntimeError("Barrier epoch timed out")


@pytest.fixture
def proxy_context(monkeypatch):
    """Install the training process's proxy for `address`; pyspark's own context is restored afterwards."""
    from pyspark.taskcontext import BarrierTaskContext, TaskContext

    monkeypatch.setattr(BarrierTaskContext, "_taskContext", None)
    monkeypatch.setattr(TaskContext, "_taskContext", None)

    def install(address):
        assert install_proxy({CONTEXT_VAR: address})
        return BarrierTaskContext.get()

    return install


def test_a_call_the_task_cannot_answer_raises_a_stratkit_error_with_the_fix(proxy_context):
    server = ContextServer(BarrierTimesOut())
    try:
        context = proxy_context(server.address)
        assert context.partitionId() == 1
        with pytest.raises(TaskContextError, match=r"barrier failed in the Spark task: RuntimeError: Barrier epoch "
                                                    r"timed out\. Fix: ") as info:
            context.barrier()
        assert isinstance(info.value, StratkitError) and isinstance(info.value, RuntimeError)  # old catches work
    finally:
        server.close()


def test_a_closed_channel_raises_a_stratkit_error_saying_the_task_is_ending(proxy_context):
    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up():
        conn, _ = listener.accept()
        conn.makefile("rb").readline()  # the token
        conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        context = proxy_context(f"{listener.getsockname()[1]}:token")
        with pytest.raises(TaskContextError, match=r"partitionId: the Spark task's context channel closed.*Fix: "):
            context.partitionId()
    finally:
        listener.close()
