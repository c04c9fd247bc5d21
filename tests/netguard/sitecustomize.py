"""The tests' network rule, enforced in every Python process a test starts.

Tests may send traffic only to loopback (127.0.0.0/8, ::1) and to the test hosts
they make in network namespaces (198.18.0.0/15, RFC 2544's benchmarking range,
never a real network). Nothing else is a target: not this machine's LAN address,
not its DNS resolver, not a public name, not even to prove it is unreachable.

An audit hook (PEP 578) sees every ``socket.connect``/``sendto``/``sendmsg`` and
every name lookup *before* the system call, so a forbidden one raises
:class:`NetworkRuleError` and no packet leaves. Each refusal is also appended to
the file named by ``TESTS_NETGUARD_LOG``, so a refusal swallowed by a
library's ``except OSError`` still fails the test (``tests/conftest.py`` reads
that file after every test).

``tests/conftest.py`` installs it in the pytest process and puts this folder
first on ``PYTHONPATH``, so every Python process a test starts (launcher tasks,
Spark executors, ...) imports this file as its ``sitecustomize`` and is guarded
too. Python only: TensorFlow's gRPC (C++) and the JVM are not seen here; their
addresses come from TF_CONFIG and SPARK_LOCAL_IP, which the tests set to
loopback or test hosts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

#: Not STRATKIT_*: many tests clear those variables.
LOG_VARIABLE = "TESTS_NETGUARD_LOG"
ALLOWED_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128", "198.18.0.0/15"))


class NetworkRuleError(PermissionError):
    """A test process tried to reach something other than loopback or a test host."""


def address_allowed(host: str) -> bool:
    """True for a literal address in loopback or the test hosts' range (and the unspecified address:
    Linux sends a connect to 0.0.0.0 or :: to this host over loopback)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if getattr(address, "ipv4_mapped", None):
        address = address.ipv4_mapped
    return address.is_unspecified or any(address in network for network in ALLOWED_NETWORKS)


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


def _hosts_file_names() -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    try:
        with open("/etc/hosts") as handle:
            for line in handle:
                fields = line.split("#", 1)[0].split()
                for name in fields[1:]:
                    names.setdefault(name.lower(), []).append(fields[0])
    except OSError:
        pass
    return names


def name_allowed(host: str) -> bool:
    """True when looking `host` up sends no packet outside the rule: a literal allowed address,
    localhost, or a name /etc/hosts maps to allowed addresses (a test host's own /etc/hosts included).
    Any other name, reserved ones like ``x.invalid`` too, would go to the DNS resolver."""
    host = host.rstrip(".").lower()
    if not host or address_allowed(host) or host == "localhost":
        return True
    if _is_literal(host):
        return False
    listed = _hosts_file_names().get(host)
    return bool(listed) and all(address_allowed(a) for a in listed)


def _check(event: str, args: tuple) -> None:
    target = None
    if event in ("socket.connect", "socket.sendto"):
        address = args[1]
        if isinstance(address, tuple) and len(address) >= 2 and isinstance(address[0], (str, bytes)):
            host = address[0].decode() if isinstance(address[0], bytes) else address[0]
            family = getattr(args[0], "family", None)
            if family in (socket.AF_INET, socket.AF_INET6) and not name_allowed(host):
                target = f"{host}:{address[1]}"
    elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex"):
        host = args[0]
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        # a literal address is parsed, not looked up: no packet (its connect() is checked on its own)
        if isinstance(host, str) and not _is_literal(host) and not name_allowed(host):
            target = f"name lookup of {host!r}"
    if target is None:
        return
    import traceback

    caller = " < ".join(f"{os.path.basename(frame.filename)}:{frame.lineno}"
                        for frame in reversed(traceback.extract_stack(limit=8)[:-3]))
    message = (f"network rule: {event} to {target} refused before any packet was sent (pid {os.getpid()}: "
               f"{' '.join(sys.argv)[:160]!r}, from {caller}). "
               "Tests may reach only 127.0.0.0/8, ::1 and test hosts in 198.18.0.0/15 "
               "(tests/netguard/sitecustomize.py).")
    log = os.environ.get(LOG_VARIABLE)
    if log:
        try:
            with open(log, "a") as handle:
                handle.write(message + "\n")
        except OSError:
            pass
    raise NetworkRuleError(message)


def install() -> None:
    """Guard this process (once; audit hooks cannot be removed)."""
    if getattr(sys, "_stratkit_netguard", False):
        return
    sys._stratkit_netguard = True

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            _check(event, args)

    sys.addaudithook(hook)


install()

# A measuring run (`pytest --times`, tests/cpu_times.py) also counts who imports TensorFlow: only then.
if os.environ.get("STRATKIT_TEST_IMPORT_LOG"):
    import stratkit_import_probe

    stratkit_import_probe.install()
