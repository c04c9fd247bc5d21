"""Test hosts: a few "machines" on one Linux box, for tests that need a real cluster.

``make_hosts(n)`` makes ``n`` network namespaces ``h1``..``hn`` with addresses
198.18.0.1..n/24 (RFC 2544's benchmarking range: never a real network), joined by
a bridge that lives in a namespace of its own (the "switch"), so the root
namespace gets no interface, no route and no firewall rule: nothing on a test
host can reach this machine's network or the outside, and the root namespace's
bridge netfilter settings never see the hosts' traffic.

With ``names=True`` (the default) each host also gets its own UTS and mount
namespace, held by a small ``sleep`` process: its hostname is ``hN`` and an
``/etc/hosts`` listing every host is bind-mounted over its own, so ``h1``,
``h2``, ... resolve on every host as on a real cluster (Slurm's slurmctld
insists on running on the host its slurm.conf names).

With ``private_disks=True`` each host also gets a disk of its own, as machines without a shared
file system have: a tmpfs over /tmp and /var/tmp, and the user's home as an overlay (the machine
image's files readable, every write kept on the host's tmpfs), all in the host's own mount
namespace, so no other host and not the root namespace sees what it writes there, and all gone
with the host. The repository and the virtualenv stay shared: they are the machine image. Each
directory in ``shared`` (e.g. a test's results directory) is bind-mounted at its own path on every
host, the one way files cross between hosts and the test; a process on a private-disk host starts
in the home directory (`Host.home`) unless given a `cwd`::

    with make_hosts(2, private_disks=True, shared=[results]) as (h1, h2):
        h1.run(["sh", "-c", "echo x > /tmp/mine"], timeout=10)   # h2 has no /tmp/mine; nor has this machine

Commands run "on" a host through ``nsenter`` (never ``ip netns exec``, which
remounts /sys and hides the cgroup mount Slurm needs)::

    with make_hosts(2) as (h1, h2):
        server = h2.popen([sys.executable, "-m", "http.server", "8000"])
        h1.run(["curl", "http://h2:8000/"], timeout=30)

Leaving the block (also on an exception or a test failure) SIGKILLs every
process left in each host's network namespace and deletes the namespaces;
namespaces left by a test run that was itself SIGKILLed are swept at the next
``make_hosts``. Names in the root namespace carry the pid of the test run
(``stratkit-<pid>-<n>-h1``), so parallel runs never collide.

Needs root and ``ip``, ``nsenter``, ``unshare``; :func:`unavailable_reason` says
what is missing (tests marked ``hosts`` skip with it, or fail when
``STRATKIT_REQUIRE_HOSTS=1``: see tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NETWORK = "198.18.0"
PREFIX = "stratkit-"
REQUIRE_VARIABLE = "STRATKIT_REQUIRE_HOSTS"
TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname")
#: The suite's network guard log (tests/netguard/): every private-disk host writes its refusals to the same file.
GUARD_LOG_VARIABLE = "TESTS_NETGUARD_LOG"
#: What a private disk covers with a tmpfs of its own (the user's home gets an overlay: see `make_hosts`).
PRIVATE_PATHS = ("/tmp", "/var/tmp")
#: The most a private disk's tmpfs may hold (tmpfs takes memory only for what is written).
DISK_SIZE = "2g"
_CLONE_NEWNET = 0x40000000
_SEQUENCE = itertools.count()
_PROBED: str | None | bool = False   # False: not probed yet


class HostsUnavailable(RuntimeError):
    """Test hosts cannot be made on this machine (the message says why)."""


@dataclass
class Host:
    """One test host: a network namespace (plus, with names, its own hostname and /etc/hosts)."""

    name: str
    address: str
    netns: str
    holder: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    switch: str = ""  # the namespace of the bridge this host's cable plugs into
    started: list[subprocess.Popen] = field(default_factory=list, repr=False)
    #: With a private disk: the home directory its processes start in (the run's working directory).
    home: str | None = None

    def argv(self, argv: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """`argv` prefixed so that it runs on this host (in `cwd`, default: the caller's, or with a private
        disk the host's home)."""
        wd = os.fspath(cwd) if cwd is not None else (self.home or os.getcwd())
        if self.holder is not None:
            return ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--uts",
                    f"--wd={wd}", "--", *argv]
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        """Start `argv` on this host (`subprocess.Popen`'s keywords; env default: ours)."""
        cwd = kw.pop("cwd", None)
        command = self.argv(argv, cwd)
        if self.holder is None and cwd is not None:
            kw["cwd"] = cwd
        proc = subprocess.Popen(command, env=dict(env) if env is not None else None, **kw)
        # Killed at teardown by pid too: until nsenter has joined the namespace, `ip netns pids` misses it.
        self.started.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            check: bool = False, **kw: Any) -> subprocess.CompletedProcess:
        """Run `argv` on this host to the end, output captured as text (stderr into stdout unless
        given). Past `timeout` its process group is killed and `subprocess.TimeoutExpired` raised."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.STDOUT)
        kw.setdefault("text", True)
        kw.setdefault("start_new_session", True)
        proc = self.popen(argv, env=env, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def pids(self) -> list[int]:
        """Every process in this host's network namespace (its name holder included)."""
        return netns_pids(self.netns)

    def kill_all(self, rounds: int = 1) -> None:
        """The host dies: SIGKILL every process on it but its name holder (which stays, as an empty machine
        would), again up to `rounds` times while any is left (one may fork meanwhile)."""
        _kill_until_gone(lambda: [p for p in self.pids() if self.holder is None or p != self.holder.pid], rounds)

    def socket(self, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket in this host's network namespace, for the test's own process (which has no route to the
        hosts): made by a thread that joined the namespace; a socket stays in the namespace it was made in."""
        made: list[Any] = []

        def make() -> None:
            try:
                with open(f"/run/netns/{self.netns}") as handle:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
                made.append(socket.socket(family, kind))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                made.append(exc)

        thread = threading.Thread(target=make, name=f"netns-{self.name}")  # it ends in the namespace: it is only
        thread.start()                                                     # this thread's, and it is gone
        thread.join()
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    def connect(self, address: tuple[str, int], timeout: float) -> socket.socket:
        """A TCP connection to `address` made from this host (as `socket.create_connection`)."""
        sock = self.socket()
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
        return sock

    def unplug(self) -> None:
        """Pull the host's cable: its port on the switch goes down, and from then on every packet to or from
        it is dropped without a reply (no reset, no ICMP), as when a machine loses power."""
        _ip("-n", self.switch, "link", "set", self.name, "down")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def netns_pids(netns: str) -> list[int]:
    result = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def our_namespaces() -> list[str]:
    """Names of the network namespaces test hosts made (this run's and any left behind)."""
    result = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here, or None (probed once: one namespace made and deleted)."""
    global _PROBED
    if _PROBED is not False:
        return _PROBED  # type: ignore[return-value]
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        _PROBED = "test hosts need root (network, mount and UTS namespaces)"
    elif missing:
        _PROBED = f"test hosts need {', '.join(missing)} (iproute2, util-linux)"
    else:
        probe = f"{PREFIX}{os.getpid()}-probe"
        made = _ip("netns", "add", probe, check=False)
        _ip("netns", "del", probe, check=False)
        _PROBED = None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"
    return _PROBED  # type: ignore[return-value]


def gate(reason: str | None = None) -> None:
    """Skip the running test where test hosts (or what `reason` names) are missing; with
    STRATKIT_REQUIRE_HOSTS=1 (CI) fail it instead, so CI cannot pass by skipping."""
    import pytest

    reason = reason or unavailable_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{REQUIRE_VARIABLE}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_until_gone(listed: Callable[[], list[int]], rounds: int | None = None, deadline: float = math.inf) -> None:
    """SIGKILL the pids `listed()` gives, again (0.05 s apart) until it gives none, `rounds` rounds have run, or
    `deadline` seconds have passed: one shared loop for a namespace's teardown and a host that dies."""
    end = time.monotonic() + deadline
    for done in itertools.count(1):
        pids = listed()
        if not pids or time.monotonic() > end:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if done == rounds:
            return
        time.sleep(0.05)


def kill_namespace(netns: str, deadline: float = 10.0) -> None:
    """SIGKILL every process in `netns` (again, until none is left: one may fork), then delete it."""
    _kill_until_gone(lambda: [p for p in netns_pids(netns) if p != os.getpid()], deadline=deadline)
    _ip("netns", "del", netns, check=False)


def sweep_stale() -> None:
    """Delete namespaces a test run left behind when it was SIGKILLed (its pid is gone)."""
    for name in our_namespaces():
        match = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
        if match and not _pid_alive(int(match.group(1))):
            kill_namespace(name)


def hosts_file(hosts: Sequence[Host]) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{h.address}\t{h.name}" for h in hosts]
    return "\n".join(lines) + "\n"


#: The name holder: in the host's own mount and UTS namespaces (private propagation), it puts `hosts` on
#: /etc/hosts and sets the hostname; with private disks it mounts them (the home's overlay layers on a tmpfs
#: that is then detached, so no path reaches them) and binds each shared directory at its own path, through a
#: descriptor opened before the tmpfs covered it (mount(8) would resolve a path to the new disk). Then it sleeps
#: as long as the host lives.
_HOLDER = r"""
import json, os, subprocess, sys
etc_hosts, name, private, home, shared, size = sys.argv[1:7]
private, shared = json.loads(private), json.loads(shared)

def mount(*args):
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mount {' '.join(args)}: {done.stderr.strip()}")

mount("--bind", etc_hosts, "/etc/hosts")
subprocess.run(["hostname", name], check=True)
opened = [(os.open(path, os.O_PATH), path) for path in shared]
for path in private:
    mode = oct(os.stat(path).st_mode & 0o7777)[2:]
    mount("-t", "tmpfs", "-o", f"mode={mode},size={size}", f"disk-{name}", path)
if home:
    layers = private[0]  # a tmpfs there first, for the overlay's layers only: detached once the overlay holds them
    mount("-t", "tmpfs", "-o", f"mode=700,size={size}", f"home-{name}", layers)
    for part in ("upper", "work"):
        os.mkdir(os.path.join(layers, part))
    mount("-t", "overlay", "-o", f"lowerdir={home},upperdir={layers}/upper,workdir={layers}/work", f"home-{name}", home)
    subprocess.run(["umount", "--lazy", layers], check=True)
for fd, path in opened:
    if os.path.isdir(f"/proc/{os.getpid()}/fd/{fd}"):
        os.makedirs(path, exist_ok=True)
    else:  # a file: bound over an empty one
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    mount("--no-canonicalize", "--bind", f"/proc/{os.getpid()}/fd/{fd}", path)  # (not the path it now names)
    os.close(fd)
print("ready", flush=True)
os.execvp("sleep", ["sleep", "infinity"])
"""


def _hold_names(host: Host, etc_hosts: Path, private_disks: bool = False,
                shared: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """A process in the host's network namespace with its own mount and UTS namespaces: hostname
    `host.name`, `etc_hosts` bind-mounted on /etc/hosts (private propagation: the root namespace's
    /etc/hosts is untouched), and with `private_disks` its own disk (see `make_hosts`). Commands join its
    namespaces with nsenter --target."""
    private = list(PRIVATE_PATHS) if private_disks else []
    home = os.path.expanduser("~") if private_disks else ""
    holder = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{host.netns}", "--", "unshare", "--mount", "--uts",
         "--propagation", "private", "--", sys.executable, "-I", "-c", _HOLDER, str(etc_hosts), host.name,
         json.dumps(private), home, json.dumps(list(shared)), DISK_SIZE],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    line = holder.stdout.readline() if holder.stdout else b""
    if line.strip() != b"ready":
        holder.kill()
        err = holder.communicate()[1].decode(errors="replace").strip()
        what = "its own disk, hostname and /etc/hosts" if private_disks else "its own hostname and /etc/hosts"
        raise HostsUnavailable(f"cannot give {host.name} {what}: {err}")
    if private_disks:
        host.home = home
    return holder


@contextmanager
def make_hosts(n: int, names: bool = True, private_disks: bool = False,
               shared: Sequence[str | os.PathLike[str]] = ()) -> Iterator[list[Host]]:
    """`n` test hosts h1..hn on 198.18.0.0/24, removed with every process on them at the end.

    Args:
        n: how many hosts.
        names: each host its own hostname and /etc/hosts (needed by `private_disks`).
        private_disks: each host its own /tmp, /var/tmp and home (see the module docstring).
        shared: existing directories (or files) every private-disk host sees at their own paths (results,
            configs); the network guard's log is always among them.
    """
    if not 1 <= n <= 250:
        raise ValueError("between 1 and 250 hosts")
    if (private_disks or shared) and not names:
        raise ValueError("private disks need names=True (the host's own mount namespace)")
    shared = [os.path.abspath(os.fspath(path)) for path in shared]
    for path in shared:
        if not os.path.exists(path):
            raise ValueError(f"shared directory {path} does not exist")
    guard_log = os.environ.get(GUARD_LOG_VARIABLE, "")
    if private_disks and os.path.isfile(guard_log):
        shared.append(os.path.abspath(guard_log))
    reason = unavailable_reason()
    if reason:
        raise HostsUnavailable(reason)
    sweep_stale()
    tag = f"{PREFIX}{os.getpid()}-{next(_SEQUENCE)}"
    switch = f"{tag}-sw"
    hosts = [Host(name=f"h{i}", address=f"{NETWORK}.{i}", netns=f"{tag}-h{i}", switch=switch) for i in range(1, n + 1)]
    made: list[str] = []
    tmp = tempfile.TemporaryDirectory(prefix="stratkit-hosts-")
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in hosts:
            _ip("netns", "add", host.netns)
            made.append(host.netns)
            _ip("-n", switch, "link", "add", host.name, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("-n", switch, "link", "set", host.name, "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
        if names:
            etc_hosts = Path(tmp.name) / "hosts"
            etc_hosts.write_text(hosts_file(hosts))
            etc_hosts.chmod(0o644)
            for host in hosts:
                host.holder = _hold_names(host, etc_hosts, private_disks, shared)
        yield hosts
    finally:
        for host in hosts:
            for proc in host.started:
                if proc.poll() is None:
                    proc.kill()
        for netns in reversed(made):
            kill_namespace(netns)
        for host in hosts:
            if host.holder is not None:
                host.holder.wait()
                for stream in (host.holder.stdout, host.holder.stderr):
                    if stream:
                        stream.close()
        tmp.cleanup()
