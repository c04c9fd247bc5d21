"""A private, loopback-only network for the tasks of a local launch.

Why: TensorFlow's gRPC server listens on 0.0.0.0 whatever address TF_CONFIG
names (`grpc_server_lib.cc` builds "0.0.0.0:<port>"; there is no setting to
change it), has no authentication or TLS, and runs any graph a client sends.
A local cluster started with `--host 127.0.0.1` would otherwise let anyone who
reaches the machine run code as the user. Binding cannot come from TF, so the
tasks run where "all interfaces" means loopback only: a network namespace of
their own.

How: one tiny holder process per launch creates the namespace -- a network
namespace, inside a new user namespace when we lack CAP_SYS_ADMIN (the usual,
unprivileged case) -- brings `lo` up, and sends the launcher descriptors of its
namespaces over a Unix socket (SCM_RIGHTS). Every task enters them between fork
and exec (setns), so all tasks share one loopback and no other interface. The
uid map is the user's own uid onto itself: a script sees the same uid, files
and permissions as outside. The holder also binds the launcher's held ports
inside the namespace (a socket belongs to the namespace it was created in);
which ports listen there, the launcher reads in /proc/<holder>/net. It exits when the launcher's end of the
socket closes, however the launcher ended; the namespace goes with the last task.

Price: the tasks cannot reach the network either (no DNS, no remote data, no
experiment tracker, no service on the machine's own 127.0.0.1). See docs/security.md.

Linux only. Imports no TensorFlow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any, Callable

from stratkit.errors import ConfigError
from stratkit.process.ports import listening_ports

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
#: The kernel passes at most 253 descriptors per message (SCM_MAX_FD): ports are reserved in batches.
_BATCH = 250
#: How long the holder may take to create the namespace (an unloaded machine needs ~50 ms).
_START_TIMEOUT = 30.0

# The holder, run as `python -I -S -c HOLDER <fd>`: a fresh single-threaded process, which
# unshare(CLONE_NEWUSER) requires. It answers one JSON request per SOCK_SEQPACKET message.
_HOLDER = r"""
import ctypes, fcntl, json, os, signal, socket, struct, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we go: it closes our socket
chan = socket.socket(fileno=int(sys.argv[1]))

def reply(message, fds=()):
    socket.send_fds(chan, [json.dumps(message).encode()], list(fds))

libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
user = False
if libc.unshare(0x40000000) != 0:               # CLONE_NEWNET alone: needs CAP_SYS_ADMIN (root)
    if libc.unshare(0x10000000 | 0x40000000) != 0:  # else a user namespace of our own grants it
        err = ctypes.get_errno()
        reply({"error": "unshare(CLONE_NEWUSER | CLONE_NEWNET)", "errno": err, "strerror": os.strerror(err)})
        sys.exit(1)
    user = True
    try:  # the same uid and gid inside as outside (an unprivileged user may map exactly its own)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
    except OSError as exc:
        reply({"error": f"writing /proc/self/{name}", "errno": exc.errno, "strerror": exc.strerror})
        sys.exit(1)
try:  # a new namespace's lo is down: SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        flags = struct.unpack("16sh22x", fcntl.ioctl(probe, 0x8913, struct.pack("16sh22x", b"lo", 0)))[1]
        fcntl.ioctl(probe, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))
except OSError as exc:
    reply({"error": "bringing up lo", "errno": exc.errno, "strerror": exc.strerror})
    sys.exit(1)
names = (["user"] if user else []) + ["net"]
reply({"ready": True, "namespaces": names}, [os.open(f"/proc/self/ns/{n}", os.O_RDONLY) for n in names])

while True:
    data = chan.recv(65536)
    if not data:
        break
    request = json.loads(data)
    try:
        if request["op"] == "reserve":
            held = []
            try:
                for port in request["ports"]:
                    sock = socket.socket(request["family"], socket.SOCK_STREAM)
                    held.append(sock)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as stratkit.process.ports.hold_port
                    sock.bind((request["host"], port))
                reply({"ports": [s.getsockname()[1] for s in held]}, [s.fileno() for s in held])
            finally:
                for sock in held:
                    sock.close()
        elif request["op"] == "listen":              # a listener inside, for a service of the machine's loopback
            sock = socket.socket(request["family"], socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((request["host"], request["port"]))
                sock.listen(64)
                reply({"port": sock.getsockname()[1]}, [sock.fileno()])
            finally:
                sock.close()
    except OSError as exc:
        reply({"error": request["op"], "errno": exc.errno, "strerror": exc.strerror})
"""


class PrivateNetworkUnavailable(ConfigError):
    """This machine (kernel, security policy, container) does not let stratkit create the namespace.

    `why` says what failed and the likely cause, in one sentence.
    """

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(
            f"--private-network: the tasks cannot get a private network here: {why}. Fix: allow unprivileged user "
            "namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 where it exists, "
            "on Ubuntu 24.04+ kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for this "
            "Python; in a container a seccomp profile that permits unshare), or run with --no-private-network "
            "behind a firewall that blocks the task ports from other machines")


def _why(error: dict[str, Any]) -> str:
    """The holder's error, with the setting that usually causes it."""
    text = f"{error['error']} failed: [Errno {error['errno']}] {error['strerror']}"
    causes = []
    for path, bad, cause in (
            ("/proc/sys/user/max_user_namespaces", "0", "user.max_user_namespaces is 0"),
            ("/proc/sys/kernel/unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone is 0"),
            ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
             "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1)")):
        try:
            with open(path) as handle:
                if handle.read().strip() == bad:
                    causes.append(cause)
        except OSError:
            continue
    if causes:
        return text + " (" + "; ".join(causes) + ")"
    return text + " (user namespaces are refused to this process: a container's seccomp profile, a security " \
                  "module, or a user namespace without a uid mapping)"


class PrivateNetwork:
    """A loopback-only network namespace for one launch, kept by a holder process.

    `start()` creates it or raises `PrivateNetworkUnavailable`; `enter` is the
    step a task runs between fork and exec; `reserve_ports` and
    `listening_ports` work inside it; `close()` lets the holder go.
    """

    def __init__(self, proc: subprocess.Popen[bytes], chan: socket.socket, fds: list[int],
                 namespaces: list[str]) -> None:
        self._proc = proc
        self._chan = chan
        self._fds = fds
        self.namespaces = namespaces
        self._setns = _load_setns()

    @property
    def pid(self) -> int:
        """The holder's pid (the namespace's first process)."""
        return self._proc.pid

    @property
    def user_namespace(self) -> bool:
        """True when the namespace sits in a user namespace of its own (the unprivileged way)."""
        return "user" in self.namespaces

    @classmethod
    def start(cls) -> PrivateNetwork:
        """Create the namespace. Raises PrivateNetworkUnavailable saying why, when the machine refuses it."""
        if not sys.platform.startswith("linux"):
            raise PrivateNetworkUnavailable(f"network namespaces are a Linux feature, and this is {sys.platform}")
        if _load_setns() is None:
            raise PrivateNetworkUnavailable("this C library has no setns()")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _HOLDER, str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            ours.close()
            raise PrivateNetworkUnavailable(f"could not start {sys.executable}: {exc}") from None
        finally:
            theirs.close()
        ours.settimeout(_START_TIMEOUT)
        try:
            data, fds, _, _ = socket.recv_fds(ours, 65536, 2)
        except OSError as exc:
            data, fds = b"", []
            problem = str(exc)
        else:
            problem = ""
        ours.settimeout(None)
        message = json.loads(data) if data else {}
        if not message.get("ready"):
            ours.close()
            for fd in fds:
                os.close(fd)
            try:
                stderr = proc.communicate(timeout=5)[1]
            except subprocess.TimeoutExpired:
                proc.kill()
                stderr = proc.communicate()[1]
            if "error" in message:
                raise PrivateNetworkUnavailable(_why(message))
            said = problem or stderr.decode(errors="replace").strip()[-300:]
            raise PrivateNetworkUnavailable(f"the namespace holder ended without a word ({said})")
        if proc.stderr is not None:
            proc.stderr.close()
        return cls(proc, ours, fds, message["namespaces"])

    # -- inside the namespace ---------------------------------------------------------------------
    def enter(self) -> None:
        """In a forked child, before exec: join the namespace (user first: it grants the right to join net).

        Runs between fork and exec, so it only calls C. On failure it says why on the task's
        stderr and ends the child with 126, which the launcher reports as the task's failure.
        """
        setns = self._setns
        assert setns is not None
        for fd, kind in zip(self._fds, self.namespaces):
            if setns(fd, _CLONE_NEWUSER if kind == "user" else _CLONE_NEWNET) != 0:
                os.write(2, f"stratkit launch: could not join the private {kind} namespace (setns failed)\n".encode())
                os._exit(126)

    def reserve_ports(self, host: str, family: int, count: int, base_port: int | None = None) -> list[socket.socket]:
        """`count` sockets bound inside the namespace on `host` (consecutive from `base_port`, else free ones).

        Held by the launcher exactly as `stratkit.process.ports.hold_port` holds them outside
        (bound, not listening, SO_REUSEADDR only), so TF's server can take the port over and
        nothing else in the namespace (a task's outgoing connection) gets it first. The holder
        process binds them (a socket belongs to the namespace it was made in) with the same
        options, in its own code: it runs as `python -I -S` and cannot import stratkit.
        """
        wanted = [0 if base_port is None else base_port + i for i in range(count)]
        held: list[socket.socket] = []
        try:
            for start in range(0, count, _BATCH):
                reply, fds = self._ask({"op": "reserve", "host": host, "family": int(family),
                                        "ports": wanted[start:start + _BATCH]}, _BATCH)
                held += [socket.socket(fileno=fd) for fd in fds]
                if "error" in reply:
                    raise ConfigError(f"could not reserve {count} port(s) on --host {host!r} in the private network: "
                                      f"[Errno {reply['errno']}] {reply['strerror']}. Fix: "
                                      + ("another --base-port, or omit it" if base_port is not None
                                         else "use --host 127.0.0.1"))
        except BaseException:
            for sock in held:
                sock.close()
            raise
        return held

    def listen(self, host: str, port: int) -> socket.socket:
        """A socket listening on `host`:`port` inside the namespace (for `stratkit.launch.forward`).

        Raises:
            OSError: when the port cannot be bound there.
        """
        reply, fds = self._ask({"op": "listen", "host": host, "port": port,
                                "family": int(socket.AF_INET6 if ":" in host else socket.AF_INET)}, 1)
        if "error" in reply:
            raise OSError(reply["errno"], reply["strerror"])
        return socket.socket(fileno=fds[0])

    def listening_ports(self) -> set[int]:
        """TCP ports in LISTEN inside the namespace: /proc/<holder>/net shows the holder's network namespace.

        Empty when that cannot be read (a /proc mounted with hidepid): the held ports are then
        released only as their tasks exit, which TF's servers do not need (see `hold_port`).
        """
        return listening_ports(f"/proc/{self.pid}/net") or set()

    def _ask(self, request: dict[str, Any], max_fds: int) -> tuple[dict[str, Any], list[int]]:
        self._chan.sendall(json.dumps(request).encode())
        data, fds, _, _ = socket.recv_fds(self._chan, 1 << 20, max(max_fds, 1))
        if not data:
            raise ConfigError(f"the private network's holder (pid {self.pid}) has ended. Fix: run the launch again; "
                              "if it recurs, report it (or run with --no-private-network behind a firewall)")
        return json.loads(data), list(fds)

    def close(self) -> None:
        """Let the holder go (it exits on EOF); the namespace lives on only while a task still runs in it."""
        self._chan.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - it only waits on its socket
            self._proc.kill()
            self._proc.wait()


def _load_setns() -> Callable[[int, int], int] | None:
    """libc's setns, resolved in the parent so the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return getattr(ctypes.CDLL(None, use_errno=True), "setns", None)
    except OSError:  # pragma: no cover
        return None


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
