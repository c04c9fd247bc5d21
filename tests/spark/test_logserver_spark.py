"""The log server of a real 2-executor SparkRunner run under attack, and when it dies (local-cluster[2,1,1024]).

The attacker knows the port (anyone on the network can find it) but not the
token: idle connections, 100 MB lines without a newline, wrong and non-ASCII
tokens, other encodings and a churn of connections go on while the run trains.
The run must return its result with every task's lines, the driver's memory
must stay flat, and if the server itself cannot go on the run fails at once
with a message that says so.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import cloudpickle
import pytest
from spark_helpers import processes_of_run, shared_session
from test_logserver import PeakRss, send_long_line

from stratkit.spark import SparkRunner, SparkTrainingError
from stratkit.spark import runner as runner_module
from stratkit.spark.logserver import LogServer

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BAD_HELLOS = [
    b"HELLO " + b"0" * 32 + b" 0 worker:0\n",
    "HELLO tökén 0 worker:0\n".encode(),
    b"HELLO \xff\xfe\x80 1 worker:1\n",
    "HELLO tökén 0 worker:0\n".encode("utf-16"),
    b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01x\x94.\n",
    b"L injected\nX 1\n",
]


@pytest.fixture(scope="module")
def spark():
    # The same session as tests/spark/test_spark_runner.py (shared_session: the executors start once).
    session = shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})
    # The first run of a session starts the executors' Python workers (measured: 50 s on a loaded
    # 2-core machine, 6 s after): pay that here, so the tests time what they test.
    SparkRunner(num_workers=2).run(print_steps, 1, 0)
    return session


class Servers(list):
    """The LogServers run() creates, in order; `on_created` hooks run on each as it starts listening."""

    def __init__(self):
        super().__init__()
        self.on_created: list = []


@pytest.fixture
def servers(monkeypatch):
    """The LogServer each run() creates (the port an attacker would find by scanning).

    A hook in `servers.on_created` runs in the driver's thread right after the server binds, before the
    barrier stage is submitted: an attack started there is on before any task can connect, however long
    the driver took to get there (waiting for executors to register, say)."""
    created = Servers()

    class Recorded(LogServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)
            for hook in created.on_created:
                hook(self)

    monkeypatch.setattr(runner_module, "LogServer", Recorded)
    return created


def print_steps(steps, pause):
    import os
    import time

    rank = os.environ["STRATKIT_SPARK_RANK"]
    for step in range(steps):
        print(f"step {step} on rank {rank}", flush=True)
        time.sleep(pause)
    return "trained"


def wait_for_file(path, seconds):
    import os
    import time

    print("waiting", flush=True)
    deadline = time.time() + seconds
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.1)
    return "finished"


class Flood:
    """Everything an attacker without the token can throw at the port, from a few threads, until stopped."""

    def __init__(self, port: int):
        self.port = port
        self.stop = threading.Event()
        self.idle: list[socket.socket] = []
        self.connections = 0
        self.long_line_growth_mb: list[float] = []
        self.threads = [threading.Thread(target=target, daemon=True)
                        for target in (self._idle, self._bad_hellos, self._churn, self._long_lines)]
        for thread in self.threads:
            thread.start()

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        except OSError:
            return None
        self.connections += 1
        return sock

    def _idle(self):
        while not self.stop.is_set():
            if len(self.idle) < 100:
                sock = self._connect()
                if sock is not None:
                    self.idle.append(sock)
            else:  # keep 100 open: replace those the server dropped
                self.idle.pop(0).close()
            time.sleep(0.005)

    def _bad_hellos(self):
        while not self.stop.is_set():
            for hello in BAD_HELLOS:
                sock = self._connect()
                if sock is not None:
                    try:
                        sock.sendall(hello)
                    except OSError:
                        pass
                    sock.close()
                time.sleep(0.005)

    def _churn(self):
        while not self.stop.is_set():
            sock = self._connect()
            if sock is not None:
                sock.close()
            time.sleep(0.005)

    def _long_lines(self):
        while not self.stop.is_set() and len(self.long_line_growth_mb) < 3:
            with PeakRss() as rss:
                send_long_line(self.port, b"HELLO ", 100)
                time.sleep(0.5)
            self.long_line_growth_mb.append(rss.growth_mb)
            self.stop.wait(2)

    def close(self):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
        for sock in self.idle:
            sock.close()


def test_a_flooded_log_server_still_brings_back_the_result_and_every_tasks_lines(spark, servers, capsys):
    floods: list[Flood] = []
    tasks_at_start: list[int] = []

    def attack(server):
        tasks_at_start.append(len(server.tasks))
        floods.append(Flood(server.port))

    servers.on_created.append(attack)
    runner = SparkRunner(num_workers=2)
    started = time.monotonic()
    try:
        result = runner.run(print_steps, 10, 0.3)
    finally:
        for flood in floods:
            flood.close()
    seconds = time.monotonic() - started
    out = capsys.readouterr().out
    flood, server = floods[0], servers[0]
    print(f"flooded run took {seconds:.1f}s; {flood.connections} attacking connections, {server.rejected} rejected; "
          f"driver RSS growth during each 100 MB line: {[round(g, 1) for g in flood.long_line_growth_mb]} MiB\n"
          f"{runner.last_run.format_timeline()}", file=sys.__stderr__)
    assert len(flood.long_line_growth_mb) >= 1 and max(flood.long_line_growth_mb) < 30, flood.long_line_growth_mb
    assert tasks_at_start == [0], "the flood must be on before the tasks connect"
    assert result == "trained"
    assert runner.last_run.exit_codes == {"worker:0": 0, "worker:1": 0}
    for rank in (0, 1):
        assert f"[worker:{rank}] step 9 on rank {rank}" in out
        assert runner.last_run.tails[f"worker:{rank}"][-1] == f"step 9 on rank {rank}"
    assert "injected" not in out
    assert server.failure is None and server.rejected > 100


def test_a_log_server_that_stops_accepting_fails_the_run_at_once_with_the_reason(spark, servers, tmp_path):
    run_over = threading.Event()
    closed_at: list[float] = []

    def close_when_both_tasks_connected():
        # However long the stage takes to start: until both tasks are in, or the run has ended without them.
        while not run_over.is_set():
            if servers and len(servers[0].tasks) == 2:
                servers[0]._sock.close()  # the fault: the listening socket is gone under the server
                closed_at.append(time.monotonic())
                return
            run_over.wait(0.02)

    threading.Thread(target=close_when_both_tasks_connected, daemon=True).start()
    runner = SparkRunner(num_workers=2)
    try:
        with pytest.raises(SparkTrainingError) as info:
            runner.run(wait_for_file, str(tmp_path / "never"), 45)
    finally:
        run_over.set()
    failed_at = time.monotonic()
    assert closed_at, "both tasks never connected"
    message = str(info.value)
    assert "log server" in message and "stopped accepting" in message and "Fix:" in message, message
    # The tasks would wait 45 s for the file: failing well before that is failing at once.
    assert failed_at - closed_at[0] < 30, f"took {failed_at - closed_at[0]:.1f}s after the close to fail"
    deadline = time.monotonic() + 10
    while processes_of_run(runner.last_run.run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of_run(runner.last_run.run_id) == []
