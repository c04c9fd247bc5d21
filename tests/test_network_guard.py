"""The suite's network rule holds in the pytest process and in every Python process a test starts.

Each forbidden dial below is made where, should the guard fail, it could not leave
this machine anyway: in a child inside an empty network namespace (only a down
`lo`), where connect() to anything but loopback fails with ENETUNREACH. The guard
must raise its own error first, before the system call.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stratkit_tests_netguard as netguard  # loaded by tests/conftest.py
from procs import child_env

#: TEST-NET-3 (RFC 5737): documentation only, routed nowhere.
FORBIDDEN = "203.0.113.9"


def _can_unshare_net() -> bool:
    return bool(shutil.which("unshare")) and subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True).returncode == 0


DIAL = f"""
import socket, sys
print("guarded", getattr(sys, "_stratkit_netguard", False), flush=True)
for dial in (lambda: socket.socket().connect(({FORBIDDEN!r}, 443)),
             lambda: socket.create_connection(({FORBIDDEN!r}, 443), timeout=2)):
    try:
        dial()
    except Exception as exc:
        print(type(exc).__name__, exc, flush=True)
"""


@pytest.mark.skipif(not _can_unshare_net(), reason="no user+network namespaces to dial from safely")
def test_a_child_process_is_guarded_and_its_refusal_fails_the_test(tmp_path):
    log = tmp_path / "refusals.log"
    env = child_env(None, {netguard.LOG_VARIABLE: str(log)})      # its own log: this test must not fail
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c", DIAL],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "guarded True" in result.stdout
    # refused by the guard before connect(): not ENETUNREACH from the kernel
    assert result.stdout.count(f"NetworkRuleError network rule: socket.connect to {FORBIDDEN}:443 refused") == 2, \
        result.stdout
    assert "unreachable" not in result.stdout
    assert f"{FORBIDDEN}:443" in log.read_text()                   # what the conftest fixture reads after a test


def test_the_pytest_process_is_guarded(tmp_path, monkeypatch):
    """sys.audit raises the event a connect() would raise, through every hook, without any system call."""
    import socket

    log = tmp_path / "refusals.log"
    monkeypatch.setenv(netguard.LOG_VARIABLE, str(log))            # keep this refusal out of the suite's log
    with socket.socket() as sock:
        with pytest.raises(netguard.NetworkRuleError, match=f"socket.connect to {FORBIDDEN}:443 refused"):
            sys.audit("socket.connect", sock, (FORBIDDEN, 443))
        sys.audit("socket.connect", sock, ("127.0.0.1", 443))      # loopback passes
    with pytest.raises(netguard.NetworkRuleError, match="name lookup of 'h1.invalid'"):
        sys.audit("socket.getaddrinfo", "h1.invalid", 443, 0, 0, 0)
    assert log.read_text().count("refused") == 2


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("198.18.0.7", True), ("198.19.255.1", True), ("localhost", True), ("0.0.0.0", True),
    ("vm.invalid", False), ("h1.test", False),          # reserved names still go to the resolver
    ("198.20.0.1", False), ("10.0.0.1", False), ("192.168.1.1", False), ("8.8.8.8", False),
    ("fd00::2", False), ("2001:db8::1", False), ("h9.invalid", False),
])
def test_what_the_rule_allows(host, allowed):
    assert netguard.name_allowed(host) is allowed


def test_names_from_etc_hosts_count_by_their_addresses(tmp_path, monkeypatch):
    monkeypatch.setattr(netguard, "_hosts_file_names", lambda: {"h1": ["198.18.0.1"], "lan": ["192.0.2.2"]})
    assert netguard.name_allowed("h1") and not netguard.name_allowed("lan")
