"""Hold a port for a task until its TensorFlow server listens on it, and tell when it does.

The race this closes: a launcher that picks a free port, closes it and hands
the number to a child leaves a window in which anything else on the machine
(another bind to port 0, an outgoing connection's ephemeral port) can take it.
So the port stays bound in the parent -- bound, never listening -- until the
child's server listens, and only then is the holder closed.

Why SO_REUSEADDR and nothing else (measured on Linux with TensorFlow 2.21,
re-checked by tests/process/test_ports.py against a real `tf.distribute.Server`):

- TensorFlow's gRPC server binds its port with SO_REUSEADDR and *without*
  SO_REUSEPORT (`TF_GRPC_REUSE_PORT` is off by default). Linux lets a second
  SO_REUSEADDR socket bind a port whose other sockets all have SO_REUSEADDR and
  none listens: so the server binds and listens next to our holder, and every
  connection goes to it (the holder does not listen). That holds whether the
  holder is bound to 127.0.0.1 or 0.0.0.0 (the server binds the wildcard).
- A plain bind (no socket option) by another program fails with EADDRINUSE,
  the kernel never hands the port out for bind(port 0), and outgoing
  connections never use it as their source port.
- SO_REUSEPORT on the holder adds nothing here (TensorFlow's server starts
  either way) and would let any other SO_REUSEPORT socket of the same user
  share the port and its connections, so it is not set.

Imports no TensorFlow.
"""

from __future__ import annotations

import socket


def address_family(host: str) -> int:
    """AF_INET or AF_INET6 for `host` (a name, an address, or a bracketed IPv6 literal).

    Raises:
        socket.gaierror: when `host` does not resolve.
    """
    return socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0][0]


def hold_port(host: str, port: int = 0, family: int | None = None) -> socket.socket:
    """A socket bound to `host`:`port` (0: a free port) that never listens; close it once the task listens.

    `socket.getsockname()[1]` is the port. See the module docstring for why
    the task's server can take the port over while it is held.

    Raises:
        OSError: when the address cannot be bound (in use, not an address of this machine).
    """
    if family is None:
        family = address_family(host)
    holder = socket.socket(family, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host.strip("[]"), port))
    except BaseException:
        holder.close()
        raise
    return holder


def listening_ports(proc_net: str = "/proc/net") -> set[int] | None:
    """TCP ports in LISTEN state in this network namespace (from /proc/net/tcp*), or None without /proc."""
    found: set[int] | None = None
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc_net}/{name}") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        found = found or set()
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "0A":  # 0A = TCP_LISTEN
                found.add(int(fields[1].rsplit(":", 1)[1], 16))
    return found


def is_listening(host: str, port: int, table: set[int] | None = None) -> bool:
    """True when something listens on `port`: looked up in `table` (from `listening_ports`) when given.

    Without a table (no /proc, e.g. macOS) it tries to connect: a held port
    refuses connections (the holder does not listen), only the task's server accepts.
    """
    if table is not None:
        return port in table
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=0.2):
            return True
    except OSError:
        return False
