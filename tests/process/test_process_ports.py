"""`stratkit.process.ports`: a held port keeps everyone out but the task's own TensorFlow server.

The slow test is the proof the module docstring cites: a real `tf.distribute.Server`
(TF's gRPC server, `TF_GRPC_REUSE_PORT` unset) starts on ports held by `hold_port`
-- bound to 127.0.0.1 and to 0.0.0.0 -- and on one held with SO_REUSEPORT as well,
and takes their connections.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import textwrap

import pytest

from procs import child_env

from stratkit.process.ports import hold_port, is_listening, listening_ports


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_held_port_refuses_a_plain_bind_and_is_not_listening(host):
    held = hold_port(host)
    port = held.getsockname()[1]
    try:
        assert port > 0
        assert not held.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)  # only SO_REUSEADDR
        with socket.socket() as plain, pytest.raises(OSError) as info:
            plain.bind(("127.0.0.1", port))
        assert info.value.errno == errno.EADDRINUSE
        assert not is_listening("127.0.0.1", port, listening_ports())
        assert not is_listening("127.0.0.1", port)  # the connect probe: nobody accepts yet
    finally:
        held.close()


def test_a_host_that_is_not_ours_cannot_be_held():
    with pytest.raises(OSError):
        hold_port("192.0.2.1")  # TEST-NET-1: no interface of this machine has it


# The task: one tf.distribute.Server per port, each a one-worker cluster; says "ready" and waits for stdin.
_SERVERS = textwrap.dedent("""
    import sys
    import tensorflow as tf
    servers = [tf.distribute.Server(tf.train.ClusterSpec({"worker": [f"localhost:{port}"]}), job_name="worker",
                                    task_index=0, protocol="grpc", start=True) for port in sys.argv[1:]]
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.mark.slow
def test_a_real_tensorflow_server_starts_on_held_ports_and_takes_their_connections():
    loopback, wildcard = hold_port("127.0.0.1"), hold_port("0.0.0.0")
    both = socket.socket()  # what spark/task.py's comment said would make the server fail
    both.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    both.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    both.bind(("127.0.0.1", 0))
    holders = [loopback, wildcard, both]
    ports = [h.getsockname()[1] for h in holders]
    env = child_env(None, {"TF_GRPC_REUSE_PORT": None, "TF_CPP_MIN_LOG_LEVEL": "2"})
    proc = subprocess.Popen([sys.executable, "-c", _SERVERS, *map(str, ports)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.poll() is not None else line
        table = listening_ports()
        for port in ports:
            assert is_listening("127.0.0.1", port, table), port
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # accepted: by the server, since the holders do not listen
            with socket.socket() as plain, pytest.raises(OSError):
                plain.bind(("127.0.0.1", port))  # still nobody else's
        assert proc.poll() is None
    finally:
        for holder in holders:
            holder.close()
        proc.kill()
        proc.communicate()
