"""Process helpers shared by the benchmarks: start jobs, hold them at a barrier, never leave one behind."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tasks"
REPO = HERE.parent

#: Every benchmark process: quiet TensorFlow, no GPU, loopback Spark.
BASE_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
            "SPARK_LOCAL_IP": "127.0.0.1"}


def thread_vars(intra: int | None, inter: int | None) -> dict[str, str]:
    """TensorFlow's thread pools as `stratkit launch` sets them (intra also drives OpenMP); None = TF default."""
    env = {}
    if intra:
        env["TF_NUM_INTRAOP_THREADS"] = str(intra)
        env["OMP_NUM_THREADS"] = str(intra)
    if inter:
        env["TF_NUM_INTEROP_THREADS"] = str(inter)
    return env


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without settings a benchmark controls itself, plus BASE_ENV and `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CONFIG", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS",
                        "STRATKIT_STRATEGY", "STRATKIT_CLUSTER_ENV")}
    env.update(BASE_ENV)
    env.update(extra)
    return env


class JobFailed(RuntimeError):
    pass


def run_barrier_group(argv: list[str], envs: list[dict[str, str]], timeout: float, logs: list[Path]) -> float:
    """Start len(envs) processes of `argv`; when every one has printed READY, write GO to all; wait for all.

    The processes' measured work starts at the same moment, so each sees the
    others' contention for the whole measured window. Returns the wall-clock
    time GO was sent. Raises JobFailed (after killing the group) on a non-zero
    exit or when `timeout` seconds pass.
    """
    procs: list[subprocess.Popen] = []
    ready: queue.Queue = queue.Queue()
    deadline = time.monotonic() + timeout
    for log in logs:
        log.write_text("")
    # Append mode: the child's stderr and our copy of its stdout share the file without overwriting.
    handles = [open(log, "a") for log in logs]  # noqa: SIM115 - closed in finally
    try:
        for env, handle in zip(envs, handles):
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=handle, text=True, start_new_session=True)
            procs.append(proc)
            threading.Thread(target=_pump, args=(proc, handle, ready, len(procs) - 1), daemon=True).start()
        waiting = set(range(len(procs)))
        while waiting:
            try:
                index = ready.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                waiting.discard(index)
            except queue.Empty:
                pass
            dead = [i for i in waiting if procs[i].poll() is not None]
            if dead or time.monotonic() > deadline:
                raise JobFailed(_why(procs, logs, "before the barrier", timeout))
        go = time.time()
        for proc in procs:
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if any(p.returncode != 0 for p in procs):
            raise JobFailed(_why(procs, logs, "after the barrier", timeout))
        return go
    except subprocess.TimeoutExpired:
        raise JobFailed(_why(procs, logs, "after the barrier", timeout)) from None
    finally:
        kill_all(procs)
        for handle in handles:
            handle.close()


def _pump(proc: subprocess.Popen, handle, ready: queue.Queue, index: int) -> None:
    for line in proc.stdout:
        if line.strip() == "READY":
            ready.put(index)
        else:
            handle.write(line)
            handle.flush()


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each still-running process's group (its own session), then reap it."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
            pass


def tail(path: Path, chars: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _why(procs: list[subprocess.Popen], logs: list[Path], when: str, timeout: float) -> str:
    states = []
    for i, proc in enumerate(procs):
        code = proc.poll()
        states.append(f"--- job {i}: " + ("still running" if code is None else f"exit {code}") + f"\n{tail(logs[i])}")
    return f"a job failed or timed out ({timeout:.0f}s) {when}:\n" + "\n".join(states)


def python() -> str:
    return sys.executable


def loopback_ports(n: int) -> list[int]:
    """`n` ports free on 127.0.0.1 now (for a 2-worker cluster's TF_CONFIG)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
