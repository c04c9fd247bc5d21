"""The driver's log server against hostile and unlucky clients, with real sockets (no Spark, no TensorFlow).

What must hold: one client cannot stop the server, grow the driver's memory,
pin a thread, or raise inside it; a task with the token is served through all
of it; and when the server really cannot go on, it says so at once (`on_fatal`)
instead of leaving the run waiting for logs that never come.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from stratkit.process import listener
from stratkit.spark import logserver
from stratkit.spark.logserver import MAX_LINE, LogClient, LogServer


class Sink:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, text):
        self.lines.append(text)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(self.lines)


def wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")  # pragma: no cover


class PeakRss:
    """Samples this process's resident memory every 5 ms while the block runs."""

    def __enter__(self):
        self.baseline = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.baseline) / 2**20


def send_long_line(port: int, prefix: bytes, megabytes: int, end: bytes = b"") -> int:
    """Send `prefix` then `megabytes` MiB of "x" (from one reused 1 MiB buffer); returns bytes sent."""
    chunk = b"x" * 2**20
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        try:
            sock.sendall(prefix)
            for _ in range(megabytes):
                sock.sendall(chunk)
                sent += len(chunk)
            sock.sendall(end)
        except OSError:  # the server cut us off: the expected outcome before authentication
            pass
    return sent


@pytest.fixture
def server():
    sink = Sink()
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # an exception in a server thread fails
    server = LogServer("127.0.0.1", stream=sink)
    server.sink = sink
    yield server
    server.shutdown()
    threading.excepthook = previous
    assert errors == [], f"the server raised in a thread: {errors!r}"


def assert_still_serves(server: LogServer, rank: int = 0) -> None:
    client = LogClient("127.0.0.1", server.port, server.token, rank, f"worker:{rank}")
    try:
        assert client.connected, client.error
        client.line(f"alive {rank}")
        assert wait_for(lambda: f"[worker:{rank}] alive {rank}\n" in server.sink.text)
    finally:
        client.close()


# -- before authentication ----------------------------------------------------------------------------

def test_a_100_mb_hello_without_newline_is_cut_off_and_the_driver_memory_stays_flat(server):
    with PeakRss() as rss:
        sent = send_long_line(server.port, b"HELLO ", 100)
    assert rss.growth_mb < 30, f"driver memory grew by {rss.growth_mb:.0f} MiB during a 100 MB HELLO"
    assert sent < 50 * 2**20, f"the server read {sent / 2**20:.0f} MiB of a HELLO instead of cutting it off"
    assert wait_for(lambda: server.rejected == 1)
    assert_still_serves(server)


@pytest.mark.parametrize("hello", [
    b"HELLO " + b"0" * 32 + b" 0 worker:0\n",                 # wrong token
    "HELLO tökén-ünïcode 0 worker:0\n".encode(),              # non-ASCII token (a TypeError in hmac once)
    b"HELLO \xff\xfe\x80 0 worker:0\n",                       # not UTF-8 at all
    "HELLO tökén 0 worker:0\n".encode("utf-16"),              # another encoding
    b"HELLO {token} x worker:0\n",                            # right token, rank not a number
    "HELLO {token} \u0661 worker:0\n".encode(),               # right token, a non-ASCII digit as rank
    b"HELLO {token} 99999999999999999999999 worker:0\n",      # right token, absurd rank
    b"HELLO {token} 7 worker:7\n",                            # right token, rank beyond the run's tasks
    b"HELLO {token}\n",                                        # too few fields
    b"\n",                                                     # empty line
    b"L injected line\nX 1\n",                                 # no HELLO at all
    b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01x\x94.\n",  # a pickle: never unpickled
])
def test_a_malformed_hello_is_a_rejected_client_and_nothing_else(hello):
    sink, errors = Sink(), []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    server = LogServer("127.0.0.1", stream=sink, max_tasks=2)
    server.sink = sink
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(hello.replace(b"{token}", server.token.encode()))
            sock.settimeout(5)
            assert sock.recv(100) == b"", "a rejected client is closed without a word"
        assert wait_for(lambda: server.rejected == 1), server.rejected
        assert sink.text == "" and server.tasks == {} and server.failure is None
        assert_still_serves(server)
    finally:
        server.shutdown()
        threading.excepthook = previous
    assert errors == [], f"the server raised in a thread: {errors!r}"


def test_idle_connections_pin_no_thread_and_are_dropped_after_the_hello_timeout(server, monkeypatch):
    monkeypatch.setattr(listener, "HELLO_TIMEOUT", 1.0)
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(40)]
    try:
        assert wait_for(lambda: server.pending == 40), server.pending
        assert threading.active_count() <= threads_before + 2, "an idle connection got a thread of its own"
        assert_still_serves(server)  # the task with the token is served while they wait
        started = time.monotonic()
        for sock in idle:
            assert sock.recv(10) == b""  # closed by the server
        assert time.monotonic() - started < 3
        assert server.pending == 0 and server.rejected == 40
    finally:
        for sock in idle:
            sock.close()


def test_a_flood_of_connections_is_bounded_and_tasks_still_get_in(server):
    """Far more connections than MAX_PENDING: the oldest waiting ones are dropped (with BUSY), tasks retry."""
    flood = []
    for _ in range(3 * logserver.MAX_PENDING):
        flood.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
    try:
        assert wait_for(lambda: server.rejected >= 2 * logserver.MAX_PENDING)
        assert server.pending <= logserver.MAX_PENDING
        assert flood[0].recv(10) == b"BUSY\n"
        for rank in range(2):
            assert_still_serves(server, rank)
    finally:
        for sock in flood:
            sock.close()


def test_a_trickled_hello_gets_no_more_time_than_a_whole_one(server, monkeypatch):
    monkeypatch.setattr(listener, "HELLO_TIMEOUT", 1.0)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        try:
            for byte in b"HELLO " + b"0" * 40:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass
        assert wait_for(lambda: server.rejected == 1)
    assert time.monotonic() - started < 2.5


# -- after authentication ------------------------------------------------------------------------------

def test_an_authenticated_100_mb_line_is_truncated_and_memory_stays_flat(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(f"HELLO {server.token} 0 worker:0\n".encode())
        assert sock.recv(3) == b"OK\n"
        chunk = b"x" * 2**20
        with PeakRss() as rss:
            sock.sendall(b"L ")
            for _ in range(100):
                sock.sendall(chunk)
            sock.sendall(b"\nL the next line\n")
            assert wait_for(lambda: "[worker:0] the next line\n" in server.sink.text, 20)
    assert rss.growth_mb < 30, f"driver memory grew by {rss.growth_mb:.0f} MiB for one 100 MB line"
    long_line = server.sink.lines[0]
    assert long_line.startswith("[worker:0] xxxx") and long_line.endswith(" ...(truncated)\n")
    assert len(long_line) < MAX_LINE + 100
    assert list(server.tasks[0].tail) == [long_line[len("[worker:0] "):-1], "the next line"]


def test_finished_connection_threads_are_dropped(server):
    for rank in range(20):
        assert_still_serves(server, rank)
    assert wait_for(lambda: server.threads == 0), server.threads
    assert sorted(server.tasks) == list(range(20))


def test_connections_per_run_are_capped():
    server = LogServer("127.0.0.1", stream=Sink(), max_tasks=2)
    clients = []
    try:
        for _ in range(4):  # 2 x max_tasks: room for a task that reconnects
            clients.append(LogClient("127.0.0.1", server.port, server.token, 1, "worker:1", timeout=1))
            assert clients[-1].connected, clients[-1].error
        extra = LogClient("127.0.0.1", server.port, server.token, 1, "worker:1", timeout=0.5)
        assert not extra.connected and "busy" in extra.error
    finally:
        for client in clients:
            client.close()
        server.shutdown()


# -- when accepting fails -------------------------------------------------------------------------------

def test_a_closed_listening_socket_is_reported_at_once_and_new_tasks_are_refused():
    fatal: list[str] = []
    server = LogServer("127.0.0.1", stream=Sink(), on_fatal=fatal.append)
    try:
        server._sock.close()  # the fault: something closed the server's socket under it
        assert wait_for(lambda: fatal, 3), "the server died silently"
        assert "log server" in fatal[0] and "stopped accepting" in fatal[0] and "Fix:" in fatal[0]
        assert server.failure == fatal[0]
        started = time.monotonic()
        client = LogClient("127.0.0.1", server.port, server.token, 0, "worker:0", timeout=5)
        assert not client.connected and time.monotonic() - started < 2
    finally:
        server.shutdown()
    assert len(fatal) == 1


CHILD = textwrap.dedent("""
    import json, os, resource, sys, time
    from stratkit.spark.logserver import LogServer
    fatal = []
    server = LogServer("127.0.0.1", stream=sys.stdout, on_fatal=fatal.append, accept_give_up=float(sys.argv[1]))
    print(json.dumps({"port": server.port, "token": server.token}), flush=True)
    sys.stdin.readline()  # the test is about to connect
    lowest_free = os.dup(0)
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor: accept() fails
    print("limited", flush=True)
    time.sleep(float(sys.argv[2]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(json.dumps({"accept_errors": server.accept_errors, "fatal": fatal}), flush=True)
    sys.stdin.readline()
    server.shutdown()
""")


def start_limited_server(give_up: float, limited_seconds: float) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(give_up), str(limited_seconds)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = json.loads(child.stdout.readline())
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline() == "limited\n"
    return child, address


def test_out_of_file_descriptors_the_server_keeps_accepting_once_they_come_back():
    child, address = start_limited_server(give_up=60, limited_seconds=1.5)
    try:
        client = LogClient("127.0.0.1", address["port"], address["token"], 0, "worker:0", timeout=10)
        assert client.connected, client.error
        client.line("got in after the descriptors came back")
        state = json.loads(child.stdout.readline())
        assert state["accept_errors"] >= 1 and state["fatal"] == [], state
        assert child.stdout.readline() == "[worker:0] got in after the descriptors came back\n"
        client.close()
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_accept_failing_for_longer_than_the_give_up_time_is_fatal_with_the_reason():
    child, address = start_limited_server(give_up=1.0, limited_seconds=3.0)
    try:
        with socket.create_connection(("127.0.0.1", address["port"]), timeout=5) as sock:
            sock.sendall(f"HELLO {address['token']} 0 worker:0\n".encode())
            state = json.loads(child.stdout.readline())
            assert len(state["fatal"]) == 1, state
            assert "Too many open files" in state["fatal"][0] and "ulimit -n" in state["fatal"][0]
            sock.settimeout(5)  # a timeout here is the failure: the task left waiting in a dead backlog
            try:
                data = sock.recv(10)
            except ConnectionResetError:
                data = b""
            assert data == b""
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_shutdown_returns_at_once_instead_of_waiting_out_the_poll_interval():
    """run() returns right after the stage: the server's selector is woken, not left to time out (0.2 s)."""
    took = []
    for _ in range(5):
        server = LogServer("127.0.0.1")
        time.sleep(0.05)  # the acceptor is inside its select()
        started = time.monotonic()
        server.shutdown()
        took.append(time.monotonic() - started)
    assert sum(took) < 0.15, f"5 shutdowns took {[round(t, 3) for t in took]} s"
