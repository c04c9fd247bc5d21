"""A real `mlflow server` on 127.0.0.1 for tests: SQLite backend, artifacts proxied to a local directory.

Started as MLflow's own CLI (`python -m mlflow server`), in a process group of its
own (it starts uvicorn), guarded by the tests' network rule like every process a test
starts: a refusal it logs while starting fails the fixture (`NetworkRefused`), since
no test's own check covers a session fixture's start. MLflow's background job runner
(several huey consumers) and its telemetry are off: the one and the other are not the
tracking server, and telemetry would leave loopback.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

#: What every process that talks to the test server gets (the training tasks too); tests/conftest.py sets it
#: for the whole suite (MLflow decides at import whether to send telemetry).
CLIENT_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true"}
#: The tests that need MLflow, the optional extra stratkit[mlflow], skip without it (found, not imported: MLflow
#: takes seconds to import, and at collection time its telemetry decision would not see the test run).
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="MLflow is not installed (pip install 'stratkit[mlflow]')")


class NetworkRefused(AssertionError):
    """The MLflow server tried to reach something other than loopback while it started."""


@dataclass
class MlflowServer:
    uri: str
    port: int
    directory: Path
    proc: subprocess.Popen[bytes]

    def log(self) -> str:
        return (self.directory / "server.log").read_text(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(directory: Path, timeout: float = 180.0) -> MlflowServer:
    """Start the server in `directory` (mlflow.db, artifacts/, server.log); return once /health answers."""
    directory.mkdir(parents=True, exist_ok=True)
    guard_log = Path(os.environ["TESTS_NETGUARD_LOG"]) if os.environ.get("TESTS_NETGUARD_LOG") else None
    guarded_from = guard_log.stat().st_size if guard_log is not None and guard_log.exists() else 0
    port = _free_port()
    env = {**os.environ, **CLIENT_ENV, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(directory / "server.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
             "--artifacts-destination", str(directory / "artifacts"), "--workers", "1"],
            cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = MlflowServer(f"http://127.0.0.1:{port}", port, directory, proc)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"mlflow server exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(server)
            raise AssertionError(f"mlflow server did not answer within {timeout:g} s:\n{server.log()}")
        time.sleep(0.5)
    if guard_log is not None and guard_log.exists() and guard_log.stat().st_size > guarded_from:
        with open(guard_log) as handle:
            handle.seek(guarded_from)
            refused = handle.read().strip()
        stop(server)
        raise NetworkRefused(f"the mlflow server tried to leave loopback while starting:\n{refused}")
    return server


def stop(server: MlflowServer) -> None:
    """Stop the server and what it started (its process group)."""
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.proc.wait()
