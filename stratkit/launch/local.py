"""The local process supervisor behind `stratkit launch`.

One attempt, in the order it happens:

1. Plan the tasks (chief, workers, ps, evaluator) and reserve one port per
   task that serves gRPC, on `host`.
2. Build every task's TF_CONFIG and check it with `stratkit.detect()` -- the
   same rule every task applies to itself -- so a layout the tasks would
   reject fails here, once, with a flag-named error.
3. Start one process per task, each in its own session (its own process
   group), with its TF_CONFIG, `STRATKIT_LAUNCHER=launch`,
   `STRATKIT_RESTART_COUNT` and a share of the CPU threads.
4. Pump every line the tasks print to our stdout/stderr with a `[worker:1] `
   prefix (and to one log file per task), keeping each task's last lines.
5. Watch: the first task to fail (non-zero exit, a signal, or the attempt
   outliving `timeout`) stops the others -- SIGTERM to each process group, then
   SIGKILL after `stop_grace` -- and becomes the root cause in the report
   (failures within the next second are weighed too: a crash beats an
   exception, which is often a peer's reaction to it).

Then restart the whole cluster (fresh ports) up to `max_restarts` times; a
script that trains with `Trainer.fit(backup_dir=...)` resumes at the epoch
reached.

No orphans: children run in their own process groups, which are killed as
groups; SIGINT/SIGTERM/SIGHUP to the launcher stop the cluster; each child
gets PR_SET_PDEATHSIG=SIGKILL, so it dies with the launcher even when the
launcher is SIGKILLed; and a tiny reaper process kills the remaining process
groups (grandchildren included, which PDEATHSIG does not reach) when the
launcher's pipe to it closes, however the launcher ended.

Imports no TensorFlow.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Callable, Mapping, Sequence

from stratkit.cluster.detect import LAUNCHER_VAR
from stratkit.cluster.layout import detect_task, group_by_role
from stratkit.errors import ConfigError
from stratkit.strategy.server import RUN_DIR_VAR

#: 0 on the first attempt, 1 after the first restart, ... (like torchrun's TORCHELASTIC_RESTART_COUNT).
RESTART_VAR = "STRATKIT_RESTART_COUNT"
#: How many of each task's last output lines the failure report shows.
TAIL_LINES = 50
DEFAULT_HOST = "127.0.0.1"
DEFAULT_EXIT_GRACE = 30.0
DEFAULT_STOP_GRACE = 10.0
#: Longest line kept whole; longer output (a progress bar without newlines) is split.
_MAX_LINE = 64 * 1024
_POLL = 0.1
#: After the first failure, how long other tasks' own failures are still weighed for the root cause.
_SETTLE = 1.0
_TAG = "[stratkit launch]"


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    """One process of the cluster: a TF_CONFIG role and index."""

    role: str
    index: int

    @property
    def name(self) -> str:
        """`worker:1`: how the task is named in prefixes and reports."""
        return f"{self.role}:{self.index}"

    @property
    def log_name(self) -> str:
        """`worker-1.log`: the task's file in `log_dir`."""
        return f"{self.role}-{self.index}.log"

    @property
    def serves(self) -> bool:
        """True when the task runs a gRPC server and so needs a port in the cluster.

        The evaluator is left out of `cluster` (as TensorFlow's estimator rule
        and Google AI Platform do): it only reads checkpoints, and no training
        task ever waits for it or dials it.
        """
        return self.role != "evaluator"


def _check_count(value: Any, flag: str, minimum: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{flag} must be a whole number >= {minimum}: got {value!r}. Fix: e.g. {flag} {example}")
    return value


def plan_tasks(workers: int = 1, chief: bool = False, ps: int = 0, evaluator: bool = False) -> list[Task]:
    """The tasks of a layout, in TF_CONFIG order: chief, workers, ps, evaluator.

    Raises:
        ConfigError: naming the flag, when the layout cannot train.
    """
    _check_count(workers, "--workers", 0, "2")
    _check_count(ps, "--ps", 0, "1")
    if workers == 0 and not chief:
        raise ConfigError("--workers 0 without --chief leaves no task to train. Fix: --workers 1 or more "
                          "(or add --chief)")
    if ps and not chief:
        raise ConfigError(f"--ps {ps} needs a coordinator: parameter-server training is driven from a chief. "
                          "Fix: add --chief (e.g. --chief --workers 2 --ps 1), or drop --ps for synchronous "
                          "multi-worker training")
    if ps and workers == 0:
        raise ConfigError(f"--ps {ps} with --workers 0 leaves no worker to run the steps. Fix: --workers 1 or more")
    tasks = [Task("chief", 0)] if chief else []
    tasks += [Task("worker", i) for i in range(workers)]
    tasks += [Task("ps", i) for i in range(ps)]
    if evaluator:
        tasks.append(Task("evaluator", 0))
    return tasks


def primary_task(tasks: Sequence[Task]) -> Task:
    """The task whose success ends training: the chief, else worker 0 (TensorFlow's rule)."""
    for task in tasks:
        if task.role == "chief":
            return task
    return Task("worker", 0)


def format_address(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed as TF_CONFIG needs."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def build_cluster(tasks: Sequence[Task], addresses: Sequence[str]) -> dict[str, list[str]]:
    """The TF_CONFIG `cluster` dict: one address per serving task, in task order."""
    serving = [t for t in tasks if t.serves]
    if len(serving) != len(addresses):
        raise ValueError(f"{len(serving)} serving tasks but {len(addresses)} addresses")
    return group_by_role((t.role for t in serving), addresses)


def task_tf_config(cluster: Mapping[str, Sequence[str]], task: Task, environ: Mapping[str, str] | None = None) -> str:
    """This task's TF_CONFIG string, decided by `stratkit.detect()` -- not re-derived here.

    `environ` is the task's environment without TF_CONFIG (default: empty), so
    a contradiction such as `STRATKIT_STRATEGY=mirrored` with 2 workers fails
    now, in the launcher, instead of in every task.

    Raises:
        ConfigError: when detection rejects the layout or would not see a cluster.
    """
    spec = detect_task(cluster, task.role, task.index, launcher="launch", environ=environ)
    if spec.task_type != task.role or spec.task_index != task.index or dict(spec.cluster) != dict(cluster):
        raise ConfigError(f"the launched {task.name} would not see its cluster: detection chose source "
                          f"{spec.source!r} ({'; '.join(spec.reasons)}). Fix: unset STRATKIT_CLUSTER_ENV "
                          "(or set it to auto or tf_config) for stratkit launch")
    return spec.to_tf_config()


def thread_env(num_tasks: int, cores: int | None = None) -> dict[str, str]:
    """Per-task thread settings so N processes on one host do not oversubscribe its cores.

    Sets the compute pools -- TensorFlow's intra-op pool (TF_NUM_INTRAOP_THREADS)
    and OpenMP/BLAS (OMP_NUM_THREADS, used by numpy and oneDNN) -- to
    cores // tasks, at least 1: each TF process otherwise starts one compute
    thread per core, and N of them thrash the caches and the scheduler.

    The inter-op pool is left to TensorFlow on purpose: its threads block while
    a collective or a parameter-server closure waits for a peer, and too few of
    them deadlock (measured: a PS loop on 2 cores hung after step 1 until
    inter-op threads were raised to num_workers + 1; stratkit sizes it itself
    for PS tasks).
    """
    if cores is None:
        cores = available_cores()
    per_task = str(max(1, cores // max(1, num_tasks)))
    return {"TF_NUM_INTRAOP_THREADS": per_task, "OMP_NUM_THREADS": per_task}


def available_cores() -> int:
    """Cores this process may run on (CPU affinity, e.g. taskset/cgroup cpusets), else cpu_count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_command(command: Sequence[str], path: str | None = None) -> list[str]:
    """The command to run, with a leading `--` dropped; clear errors when empty or not found."""
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("missing the command to run. Fix: put it after --, e.g. "
                          "`stratkit launch --workers 2 -- python train.py`")
    program = argv[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ConfigError(f"the command {program!r} is not an executable file. Fix: check the path "
                              "(or run a script through its interpreter: -- python train.py)")
    elif shutil.which(program, path=path) is None:
        raise ConfigError(f"the command {program!r} was not found on PATH. Fix: check the spelling, activate "
                          f"the environment that has it, or give its full path (e.g. {sys.executable})")
    return argv


# ---------------------------------------------------------------------------------------------
# Ports
# ---------------------------------------------------------------------------------------------
def _family(host: str) -> int:
    try:
        return socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} does not resolve ({exc}). Fix: use an address of this machine, "
                          "e.g. --host 127.0.0.1") from None


def reserve_ports(host: str, count: int, base_port: int | None = None) -> list[socket.socket]:
    """Bind `count` sockets on `host` and return them, still bound, to be held until each task listens.

    Held, not closed: a port closed before the child binds it can be taken by
    anyone in between (the race every bind-then-close launcher has). Each
    socket is bound but never listens, with SO_REUSEADDR and SO_REUSEPORT: the
    kernel then never hands the port out as an ephemeral port, a plain bind by
    another program fails with EADDRINUSE, yet TensorFlow's gRPC server (which
    binds with SO_REUSEPORT and SO_REUSEADDR on Linux) binds and listens on it,
    and connections go to that listener only (ours does not listen). Verified
    with a real `tf.distribute.Server` on TF 2.21; the launcher closes each
    socket as soon as its task's port is listening, or the task exits.

    With `base_port`, ports are base_port, base_port + 1, ... and each is first
    checked free (bind fails if anything listens there).
    """
    family = _family(host)
    bind_host = host.strip("[]")
    held: list[socket.socket] = []
    try:
        for offset in range(count):
            port = 0 if base_port is None else base_port + offset
            if base_port is not None:
                _check_free(bind_host, family, port, base_port)
            sock = socket.socket(family, socket.SOCK_STREAM)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((bind_host, port))
    except ConfigError:
        _close_all(held)
        raise
    except OSError as exc:
        _close_all(held)
        raise ConfigError(f"could not reserve {count} port(s) on --host {host!r}: {exc}. Fix: use an address "
                          "of this machine (e.g. --host 127.0.0.1)"
                          + (" or another --base-port" if base_port is not None else "")) from None
    return held


def _check_free(host: str, family: int, port: int, base_port: int) -> None:
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        probe.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"--base-port {base_port}: port {port} on {host} is in use ({exc.strerror}). Fix: choose "
                          "another --base-port, or omit it to get free ports") from None
    finally:
        probe.close()


def _close_all(socks: Sequence[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def listening_ports() -> set[int] | None:
    """TCP ports in LISTEN state on this host (from /proc/net/tcp*), or None when /proc is not there."""
    found: set[int] | None = None
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        found = found or set()
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # 0A = TCP_LISTEN
                found.add(int(fields[1].rsplit(":", 1)[1], 16))
    return found


def _is_listening(host: str, port: int, table: set[int] | None) -> bool:
    if table is not None:
        return port in table
    try:  # no /proc (macOS): our held socket refuses connections, only the task's server accepts
        with socket.create_connection((host.strip("[]"), port), timeout=0.2):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Exit codes and the failure report (shared with the Spark runner)
# ---------------------------------------------------------------------------------------------
_SIGNAL_HINTS = {
    "SIGKILL": "often out of memory (the kernel's OOM killer sends SIGKILL): check `dmesg` or the container's "
               "memory limit, or lower the batch size",
    "SIGSEGV": "a crash in native code (TensorFlow or an extension module)",
    "SIGABRT": "an abort in native code (e.g. a TensorFlow CHECK failure)",
    "SIGBUS": "a crash in native code, or /dev/shm is full",
    "SIGTERM": "stopped from outside (a scheduler's preemption, or `kill`)",
    "SIGINT": "interrupted (Ctrl-C)",
}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_returncode(returncode: int) -> str:
    """A subprocess return code in words: "exited with code 3", "killed by SIGKILL (signal 9) -- often ...".

    Negative codes are signals (Popen's convention). 129..159 from a shell
    wrapper usually mean the program it ran died of signal code - 128.
    """
    if returncode < 0:
        name = _signal_name(-returncode)
        hint = _SIGNAL_HINTS.get(name)
        return f"killed by {name} (signal {-returncode})" + (f" -- {hint}" if hint else "")
    text = f"exited with code {returncode}"
    if 128 < returncode < 160:
        name = _signal_name(returncode - 128)
        hint = _SIGNAL_HINTS.get(name)
        text += f" (128 + {returncode - 128}: a program it ran was killed by {name}" + (f" -- {hint})" if hint else ")")
    return text


@dataclass(frozen=True)
class TaskFailure:
    """The first observed failure of an attempt: which task, how it ended, what it printed last.

    Attributes:
        task: "worker:1" (the Spark runner uses its own names, e.g. "partition 3").
        returncode: the exit code (negative: the signal), or None when the task was still
            running at the timeout.
        last_lines: the task's last output lines, stdout and stderr interleaved.
        pid: the process id, when known.
        address: the task's "host:port" in the cluster, when it has one.
        attempt: 0 for the first attempt, 1 after the first restart, ...
        log_file: the task's full log, when one was written.
        timed_out_after: the timeout in seconds, when the attempt ran out of time.
    """

    task: str
    returncode: int | None
    last_lines: tuple[str, ...] = ()
    pid: int | None = None
    address: str | None = None
    attempt: int = 0
    log_file: str | None = None
    timed_out_after: float | None = None

    @property
    def reason(self) -> str:
        """How the task ended, in words."""
        if self.timed_out_after is not None:
            return (f"still running after --timeout {self.timed_out_after:g} s (hung? e.g. a collective "
                    "waiting for a peer that is gone)")
        return describe_returncode(self.returncode if self.returncode is not None else 0)


def format_failure_report(failure: TaskFailure, other_tasks: Sequence[str] = (), attempts: int | None = None,
                          title: str = "stratkit launch") -> str:
    """The root-cause report: the failed task, how it ended, its last lines, what happened to the rest.

    Args:
        failure: the first observed failure.
        other_tasks: one line per other task (e.g. "worker:0 (pid 12): stopped by the launcher").
        attempts: total attempts allowed, to print "attempt 2 of 3".
        title: who reports (the Spark runner passes its own).
    """
    rule = "=" * 78
    where = ", ".join(x for x in (f"pid {failure.pid}" if failure.pid else "", failure.address or "") if x)
    attempt = f"attempt {failure.attempt + 1}" + (f" of {attempts}" if attempts else "")
    lines = [rule, f"{title}: root cause (first observed failure)", rule,
             f"task:    {failure.task}" + (f" ({where})" if where else "") + f", {attempt}",
             f"failure: {failure.reason}"]
    if failure.log_file:
        lines.append(f"log:     {failure.log_file}")
    if failure.last_lines:
        lines.append(f"last {len(failure.last_lines)} line(s) of {failure.task}:")
        lines.extend(f"  | {line}" for line in failure.last_lines)
    else:
        lines.append(f"{failure.task} printed nothing.")
    if other_tasks:
        lines.append("other tasks:")
        lines.extend(f"  {line}" for line in other_tasks)
    lines.append(rule)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskExit:
    """How one task of one attempt ended.

    `stopped` says why the launcher stopped it ("failure", "timeout",
    "interrupt", "after_success"), or is None when it exited on its own.
    """

    task: str
    pid: int
    returncode: int
    address: str | None = None
    stopped: str | None = None


@dataclass(frozen=True)
class Attempt:
    """One start of the whole cluster. `outcome`: "succeeded", "failed", "timed_out" or "interrupted"."""

    number: int
    outcome: str
    tasks: tuple[TaskExit, ...]
    seconds: float
    failure: TaskFailure | None = None
    after_success: bool = False


@dataclass(frozen=True)
class LaunchResult:
    """What `launch()` returns: the launcher's exit code and every attempt.

    `report` is the printed root-cause report when the launch failed;
    `interrupted_by` the signal that stopped the launcher, if one did.
    """

    returncode: int
    attempts: tuple[Attempt, ...]
    report: str = ""
    interrupted_by: int | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def root_cause(self) -> TaskFailure | None:
        """The last attempt's first failure (None on success or interrupt)."""
        return self.attempts[-1].failure if self.attempts else None

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)


# ---------------------------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------------------------
def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once in the parent so the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - Linux always has it
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL this child when the launcher's thread that forked it dies.

    PDEATHSIG follows the forking *thread*, so the supervisor forks from the
    thread that lives for the whole launch. If the launcher died before prctl
    took effect, the child kills itself instead of running orphaned.
    """
    sigkill = int(signal.SIGKILL)

    def setup() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, sigkill)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sigkill)

    return setup


# The reaper: a separate tiny process that learns each task's process group over a pipe and, when the
# pipe closes (the launcher exited, crashed or was SIGKILLed), kills the groups still listed. PDEATHSIG
# only reaches the direct child; this also reaches whatever the task started in its group.
_REAPER = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


class _Reaper:
    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
        except OSError:  # pragma: no cover - PDEATHSIG and our own killpg still hold
            self._proc = None

    def _send(self, text: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def remove(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self._proc.kill()
            self._proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Child:
    """A running task: its process, its output pumps, its log file, its held port."""

    def __init__(self, task: Task, attempt: int, address: str | None, hold: socket.socket | None) -> None:
        self.task = task
        self.attempt = attempt
        self.address = address
        self.hold = hold
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None
        self.log_path: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.pumps: list[threading.Thread] = []
        self.returncode: int | None = None
        self.stopped: str | None = None
        self.failed_order = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def release_port(self) -> None:
        if self.hold is not None:
            self.hold.close()
            self.hold = None

    def join_pumps(self, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        for pump in self.pumps:
            pump.join(max(0.0, deadline - time.monotonic()))

    def exit_record(self) -> TaskExit:
        assert self.proc is not None and self.returncode is not None
        return TaskExit(self.task.name, self.proc.pid, self.returncode, self.address, self.stopped)


# ---------------------------------------------------------------------------------------------
# The supervisor
# ---------------------------------------------------------------------------------------------
@dataclass
class _Settings:
    command: list[str]
    tasks: list[Task]
    max_restarts: int
    log_dir: str | None
    host: str
    base_port: int | None
    timeout: float | None
    exit_grace: float
    stop_grace: float
    env: dict[str, str]
    stdout: IO[str]
    stderr: IO[str]
    handle_signals: bool
    extra_env: dict[str, str] = field(default_factory=dict)


class _Supervisor:
    def __init__(self, settings: _Settings) -> None:
        self.s = settings
        self.primary = primary_task(settings.tasks)
        self.lock = threading.Lock()  # one line at a time on our stdout/stderr, events and logs
        self.signals: list[int] = []
        self.reaper: _Reaper | None = None
        self.events: IO[str] | None = None
        self.started = time.monotonic()

    # -- messages -------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        with self.lock:
            try:
                for line in text.splitlines():
                    self.s.stderr.write(f"{_TAG} {line}\n")
                self.s.stderr.flush()
            except (OSError, ValueError):
                pass

    def event(self, kind: str, **fields: Any) -> None:
        if self.events is None:
            return
        record = {"time": round(time.time(), 3), "event": kind, **fields}
        with self.lock:
            self.events.write(json.dumps(record) + "\n")
            self.events.flush()

    # -- signals --------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if not self.s.handle_signals or threading.current_thread() is not threading.main_thread():
            return previous
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            current = signal.getsignal(sig)
            if current == signal.SIG_IGN:  # e.g. nohup: the user asked us to ignore it
                continue
            previous[sig] = current
            signal.signal(sig, self._on_signal)
        return previous

    # -- run ------------------------------------------------------------------------------------
    def run(self) -> LaunchResult:
        if self.s.log_dir:
            try:
                os.makedirs(self.s.log_dir, exist_ok=True)
                self.events = open(os.path.join(self.s.log_dir, "events.jsonl"), "a")
            except OSError as exc:
                raise ConfigError(f"--log-dir {self.s.log_dir!r} cannot be written: {exc.strerror}. Fix: choose a "
                                  "directory you can write to, or omit --log-dir") from None
        previous = self._install_signals()
        attempts: list[Attempt] = []
        self.reaper = _Reaper()
        try:
            total = self.s.max_restarts + 1
            for number in range(total):
                if self.signals:  # e.g. Ctrl-C while a failed attempt was being stopped: no restart
                    break
                attempt = self._attempt(number)
                attempts.append(attempt)
                if attempt.outcome in ("succeeded", "interrupted") or attempt.after_success or self.signals:
                    break
                if number + 1 < total:
                    failure = attempt.failure
                    assert failure is not None
                    self.say(f"attempt {number + 1} of {total} failed: {failure.task} {failure.reason}")
                    self.say(f"restarting the whole cluster (restart {number + 1} of {self.s.max_restarts}); "
                             "a script using Trainer.fit(backup_dir=...) resumes at the epoch reached")
                    time.sleep(0.5)
            return self._result(attempts)
        finally:
            self.reaper.close()
            if self.events is not None:
                self.events.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _result(self, attempts: list[Attempt]) -> LaunchResult:
        seconds = time.monotonic() - self.started
        total = self.s.max_restarts + 1
        if attempts and attempts[-1].outcome == "succeeded":
            self.say(f"done: every task succeeded (attempt {attempts[-1].number + 1} of {total}, {seconds:.1f} s)")
            self.event("done", returncode=0)
            return LaunchResult(0, tuple(attempts))
        if self.signals:
            signum = self.signals[0]
            self.say(f"stopped every task after {_signal_name(signum)} ({seconds:.1f} s)")
            self.event("done", returncode=128 + signum, signal=_signal_name(signum))
            return LaunchResult(128 + signum, tuple(attempts), interrupted_by=signum)
        last = attempts[-1]
        failure = last.failure
        assert failure is not None
        others = [self._describe_other(t, failure.task) for t in last.tasks if t.task != failure.task]
        report = format_failure_report(failure, others, attempts=total)
        if last.after_success:
            report += f"\n{self.primary.name} had finished training: not restarted (a restart would train again)."
        if len(attempts) > 1:
            earlier = "; ".join(f"attempt {a.number + 1}: {a.failure.task} {a.failure.reason}"
                                for a in attempts[:-1] if a.failure is not None)
            report += f"\nearlier attempts: {earlier}"
        with self.lock:
            try:
                self.s.stderr.write(report + "\n")
                self.s.stderr.flush()
            except (OSError, ValueError):
                pass
        if self.s.log_dir:
            with open(os.path.join(self.s.log_dir, "root-cause.txt"), "w") as handle:
                handle.write(report + "\n")
        if last.outcome == "timed_out":
            code = 124  # as timeout(1)
        elif failure.returncode is not None and failure.returncode < 0:
            code = 128 - failure.returncode  # as a shell reports a death by signal
        else:
            code = failure.returncode or 1
        self.event("done", returncode=code, root_cause=failure.task, reason=failure.reason)
        return LaunchResult(min(code, 255), tuple(attempts), report=report)

    def _describe_other(self, exit_: TaskExit, failed: str) -> str:
        head = f"{exit_.task} (pid {exit_.pid}): "
        if exit_.stopped in ("failure", "timeout"):
            why = f"after {failed} failed" if exit_.stopped == "failure" else "at the timeout"
            if exit_.returncode == -signal.SIGKILL:
                how = f"SIGTERM, then SIGKILL after --stop-grace {self.s.stop_grace:g} s"
            elif exit_.returncode == -signal.SIGTERM:
                how = "SIGTERM"
            else:  # e.g. a TF task that handles SIGTERM as a preemption notice and exits on its own
                how = f"SIGTERM; it then {describe_returncode(exit_.returncode)}"
            return head + f"stopped by the launcher {why} ({how})"
        if exit_.stopped == "after_success":
            return head + "stopped by the launcher after the chief finished"
        return head + describe_returncode(exit_.returncode)

    # -- one attempt ----------------------------------------------------------------------------
    def _attempt(self, number: int) -> Attempt:
        tasks = self.s.tasks
        serving = [t for t in tasks if t.serves]
        holds = reserve_ports(self.s.host, len(serving), self.s.base_port)
        addresses = [format_address(self.s.host, h.getsockname()[1]) for h in holds]
        cluster = build_cluster(tasks, addresses)
        by_task = dict(zip(serving, zip(addresses, holds)))
        children = [_Child(t, number, *by_task.get(t, (None, None))) for t in tasks]
        total = self.s.max_restarts + 1
        started = time.monotonic()
        outcome, culprit, after_success = "failed", None, False
        try:
            for child in children:
                env = dict(self.s.env)
                env.pop("TF_CONFIG", None)
                env["TF_CONFIG"] = task_tf_config(cluster, child.task, env)
                env[LAUNCHER_VAR] = "launch"
                env[RESTART_VAR] = str(number)
                env.update(self.s.extra_env)
                self._spawn(child, env, number, total)
            outcome, culprit, after_success = self._watch(children, started)
        finally:
            # Nothing still runs after "succeeded"; on an exception (e.g. a task that cannot start) stop the rest.
            reason = {"timed_out": "timeout", "interrupted": "interrupt"}.get(outcome, "failure")
            self._stop([c for c in children if c.proc is not None], reason)
            self._finish(children)
            _close_all([c.hold for c in children if c.hold is not None])
        seconds = time.monotonic() - started
        failure = None
        if culprit is not None:
            failure = TaskFailure(culprit.task.name, culprit.returncode if outcome == "failed" else None,
                                  tuple(culprit.tail), culprit.pid, culprit.address, number, culprit.log_path,
                                  self.s.timeout if outcome == "timed_out" else None)
        exits = tuple(c.exit_record() for c in children if c.proc is not None)
        self.event("attempt_end", attempt=number, outcome=outcome, seconds=round(seconds, 2),
                   tasks=[asdict(e) for e in exits])
        return Attempt(number, outcome, exits, seconds, failure, after_success)

    def _spawn(self, child: _Child, env: dict[str, str], number: int, total: int) -> None:
        if self.s.log_dir:
            child.log_path = os.path.join(self.s.log_dir, child.task.log_name)
            child.log = open(child.log_path, "ab", buffering=0)
        try:
            child.proc = subprocess.Popen(
                self.s.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                start_new_session=True,  # its own process group: killed as a group, deaf to our terminal's ^C
                preexec_fn=_die_with(os.getpid()),  # noqa: PLW1509 - one preloaded C call, no locks
            )
        except OSError as exc:
            raise ConfigError(f"could not start {child.task.name} with {self.s.command[0]!r}: {exc}. Fix: check "
                              "the command after --") from None
        assert self.reaper is not None
        self.reaper.add(child.pid)
        where = f" at {child.address}" if child.address else ""
        self.say(f"attempt {number + 1} of {total}: {child.task.name} started: pid {child.pid}{where}")
        self.event("start", attempt=number, task=child.task.name, pid=child.pid, address=child.address)
        if child.log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            child.log.write(f"===== stratkit launch: {child.task.name}, attempt {number + 1} of {total}, "
                            f"pid {child.pid}{where}, {stamp} =====\n".encode())
        pump = threading.Thread(target=self._pump, args=(child,), daemon=True, name=f"stratkit-{child.task.name}")
        pump.start()
        child.pumps.append(pump)

    def _pump(self, child: _Child) -> None:
        """Copy a task's stdout and stderr line by line: prefixed to our console, raw to its log.

        One thread reads both pipes, stdout first when both have data waiting:
        two threads racing would often put a crash's traceback (stderr, written
        last) before the prints that preceded it, and out of the report's tail.
        """
        assert child.proc is not None and child.proc.stdout is not None and child.proc.stderr is not None
        consoles = {child.proc.stdout.fileno(): self.s.stdout, child.proc.stderr.fileno(): self.s.stderr}
        order = list(consoles)  # stdout, stderr
        partial = {fd: b"" for fd in consoles}
        with selectors.DefaultSelector() as selector:
            for fd in consoles:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                ready = sorted((key.fd for key, _ in selector.select()), key=order.index)
                for fd in ready:
                    data = os.read(fd, 65536)
                    if not data:  # EOF: the task (and everything in its group) closed the stream
                        selector.unregister(fd)
                        if partial[fd]:
                            self._emit(child, partial[fd], consoles[fd])
                        continue
                    *lines, rest = (partial[fd] + data).split(b"\n")
                    for line in lines:
                        self._emit(child, line, consoles[fd])
                    if len(rest) > _MAX_LINE:  # a progress bar without newlines: do not hoard it
                        self._emit(child, rest, consoles[fd])
                        rest = b""
                    partial[fd] = rest
        child.proc.stdout.close()
        child.proc.stderr.close()

    def _emit(self, child: _Child, line: bytes, console: IO[str]) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r")
        child.tail.append(text)
        with self.lock:
            if child.log is not None:
                try:
                    child.log.write(line + b"\n")
                except (OSError, ValueError):
                    pass
            try:
                console.write(f"[{child.task.name}] {text}\n")
                console.flush()
            except (OSError, ValueError):  # our own stdout went away (e.g. `| head`): keep logging
                pass

    def _watch(self, children: list[_Child], started: float) -> tuple[str, _Child | None, bool]:
        """Poll until success, the first failure, the timeout or a signal."""
        primary_done: float | None = None
        failed: list[_Child] = []
        settle_until = 0.0
        next_port_check = 0.0
        while True:
            if self.signals:
                return "interrupted", None, primary_done is not None
            now = time.monotonic()
            for child in children:
                assert child.proc is not None
                if child.returncode is not None or child.proc.poll() is None:
                    continue
                child.returncode = child.proc.returncode
                child.release_port()
                self.event("exit", attempt=child.attempt, task=child.task.name, pid=child.pid,
                           returncode=child.returncode)
                if child.returncode != 0:
                    child.failed_order = len(failed)
                    failed.append(child)
                    settle_until = settle_until or now + _SETTLE
                elif child.task == self.primary:
                    primary_done = now
            running = [c for c in children if c.returncode is None]
            if failed:
                if now >= settle_until or not running:
                    culprit = min(failed, key=self._root_cause_rank)
                    culprit.join_pumps()  # its last lines belong in the report
                    return "failed", culprit, primary_done is not None
                time.sleep(_POLL)
                continue
            if not running:
                return "succeeded", None, True
            if primary_done == now:
                self.say(f"{self.primary.name} finished; waiting up to {self.s.exit_grace:g} s (--exit-grace) for "
                         f"{', '.join(c.task.name for c in running)} to exit")
            if primary_done is not None and now - primary_done > self.s.exit_grace:
                names = ", ".join(c.task.name for c in running)
                self.say(f"{names} still running {self.s.exit_grace:g} s after {self.primary.name} finished: "
                         "stopping them (not a failure: training is done; raise --exit-grace to wait longer)")
                self._stop(running, "after_success")
                return "succeeded", None, True
            if self.s.timeout is not None and now - started > self.s.timeout:
                culprit = next((c for c in running if c.task == self.primary), running[0])
                return "timed_out", culprit, primary_done is not None
            if now >= next_port_check and any(c.hold is not None for c in children):
                next_port_check = now + 0.25
                self._release_listening(children)
            time.sleep(_POLL)

    def _root_cause_rank(self, child: _Child) -> tuple[bool, bool, int]:
        """Order failures seen within `_SETTLE` s of the first one: the smallest is the root cause.

        A death by signal (OOM kill, segfault) beats an exit code: a crash is a
        cause, while an exception is often a peer's reaction to it (an MWMS
        worker's collective aborting). In a parameter-server cluster the chief
        beats the servers, which exit 1 as soon as the chief reports its own
        failure -- possibly before the chief's process has finished exiting.
        Then: the first observed.
        """
        code = child.returncode or 0
        crashed = code < 0 or 128 < code < 160
        ps_chief = child.task.role == "chief" and any(t.role == "ps" for t in self.s.tasks)
        return not crashed, not ps_chief, child.failed_order

    def _release_listening(self, children: list[_Child]) -> None:
        table = listening_ports()
        for child in children:
            if child.hold is not None:
                port = child.hold.getsockname()[1]
                if _is_listening(self.s.host, port, table):
                    child.release_port()
                    self.event("port_released", attempt=child.attempt, task=child.task.name, port=port,
                               reason="listening")

    def _stop(self, children: list[_Child], why: str) -> None:
        """SIGTERM every running task's group; SIGKILL what is left after stop_grace (or a second signal).

        SIGTERM first, so a script can save or clean up. Note that in
        MultiWorkerMirrored tasks TensorFlow's coordination agent catches
        SIGTERM as a preemption notice ("SIGTERM caught at ...", tsl's
        SigtermNotifier) and keeps running until a peer's heartbeat fails, so
        there the SIGKILL after stop_grace is what usually ends them.
        """
        running = [c for c in children if c.proc is not None and c.proc.poll() is None]
        signals_before = len(self.signals)
        for child in running:
            child.stopped = why
            _killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.s.stop_grace
        # A further signal while stopping (a second Ctrl-C) means: do not wait, SIGKILL now.
        while (any(c.proc is not None and c.proc.poll() is None for c in running)
               and time.monotonic() < deadline and len(self.signals) == signals_before):
            time.sleep(0.05)
        for child in running:
            assert child.proc is not None
            if child.proc.poll() is None:
                _killpg(child.pid, signal.SIGKILL)
            child.proc.wait()
        for child in children:
            if child.proc is not None and child.returncode is None:
                child.returncode = child.proc.wait()
                if child.stopped is not None:
                    self.event("stopped", attempt=child.attempt, task=child.task.name, pid=child.pid,
                               returncode=child.returncode, why=why)
                else:
                    self.event("exit", attempt=child.attempt, task=child.task.name, pid=child.pid,
                               returncode=child.returncode)

    def _finish(self, children: list[_Child]) -> None:
        """Kill leftovers in each task's group (its own children), drain its output, close its log."""
        for child in children:
            if child.proc is not None:
                _killpg(child.pid, signal.SIGKILL)
        for child in children:
            child.join_pumps()
            if child.proc is not None and self.reaper is not None:
                self.reaper.remove(child.pid)
            if child.log is not None:
                with self.lock:
                    child.log.close()
                    child.log = None


def launch(command: Sequence[str], *, workers: int = 1, chief: bool = False, ps: int = 0, evaluator: bool = False,
           max_restarts: int = 0, log_dir: str | os.PathLike[str] | None = None, host: str = DEFAULT_HOST,
           base_port: int | None = None, timeout: float | None = None, exit_grace: float = DEFAULT_EXIT_GRACE,
           stop_grace: float = DEFAULT_STOP_GRACE, env: Mapping[str, str] | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None, handle_signals: bool = True) -> LaunchResult:
    """Run `command` as every task of a local TF_CONFIG cluster and supervise it.

    Args:
        command: the program and its arguments, e.g. `["python", "train.py"]`.
        workers, chief, ps, evaluator: the layout (as `stratkit launch --workers ...`).
        max_restarts: restart the whole cluster up to this many times after a failure.
        log_dir: also write each task's output to `log_dir/<role>-<index>.log` (appended per
            attempt), plus `events.jsonl` (starts, pids, exits) and, on failure, `root-cause.txt`.
        host: the address every task binds and is reached at.
        base_port: use consecutive ports from here instead of free ones.
        timeout: seconds an attempt may run; then it counts as a failure (exit code 124 if final).
        exit_grace: seconds the other tasks get to exit after the chief (worker 0) finished; those
            still running are then stopped, which is not a failure (ps tasks and PS-cluster workers
            only serve, and nothing else can still be needed once the chief is done).
        stop_grace: seconds between SIGTERM and SIGKILL when stopping tasks.
        env: the tasks' base environment (default `os.environ`).
        stdout, stderr: where the prefixed output goes (default `sys.stdout`, `sys.stderr`).
        handle_signals: stop the cluster on SIGINT/SIGTERM/SIGHUP (main thread only).

    Returns:
        A `LaunchResult`: `returncode` 0 only when every task succeeded; else the failed task's
        exit code, 128 + N for a death by signal N, 124 for the timeout, 128 + N after the
        launcher received signal N.

    Raises:
        ConfigError: on a bad layout, command, host or port, naming the flag and the fix.
    """
    tasks = plan_tasks(workers, chief, ps, evaluator)
    _check_count(max_restarts, "--max-restarts", 0, "3")
    for value, flag in ((timeout, "--timeout"), (exit_grace, "--exit-grace"), (stop_grace, "--stop-grace")):
        if value is None and flag == "--timeout":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
                (flag == "--timeout" and value == 0):
            raise ConfigError(f"{flag} must be a positive number of seconds: got {value!r}. Fix: e.g. {flag} 600")
    serving = sum(t.serves for t in tasks)
    if base_port is not None:
        if isinstance(base_port, bool) or not isinstance(base_port, int) or not 1 <= base_port <= 65536 - serving:
            raise ConfigError(f"--base-port must leave room for {serving} port(s) within 1..65535: got "
                              f"{base_port!r}. Fix: e.g. --base-port 2222, or omit it to get free ports")
    base_env = dict(os.environ if env is None else env)
    argv = check_command(command, path=base_env.get("PATH"))
    _check_not_in_slurm_step(base_env)
    # The user's own settings win; unbuffered Python makes the prefixed output live.
    defaults = {**thread_env(len(tasks)), "PYTHONUNBUFFERED": "1"}
    extra = {k: v for k, v in defaults.items() if k not in base_env}
    # Validate every TF_CONFIG before starting anything (ports do not change validity).
    probe = build_cluster(tasks, [format_address(host, 1 + i) for i in range(serving)])
    for task in tasks:
        task_tf_config(probe, task, {k: v for k, v in base_env.items() if k != "TF_CONFIG"})
    # A private directory (0700) every task agrees on: the chief's "done" markers for ps/worker tasks.
    extra[RUN_DIR_VAR] = run_dir = tempfile.mkdtemp(prefix="stratkit-run-")
    settings = _Settings(
        command=argv, tasks=tasks, max_restarts=max_restarts, log_dir=os.fspath(log_dir) if log_dir else None,
        host=host, base_port=base_port, timeout=timeout, exit_grace=float(exit_grace), stop_grace=float(stop_grace),
        env=base_env, stdout=stdout or sys.stdout, stderr=stderr or sys.stderr, handle_signals=handle_signals,
        extra_env=extra)
    try:
        return _Supervisor(settings).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _check_not_in_slurm_step(env: Mapping[str, str]) -> None:
    from stratkit.cluster import slurm

    if slurm.is_slurm_step(env):
        raise ConfigError(
            f"stratkit launch is running inside an srun step of SLURM_STEP_NUM_TASKS="
            f"{env.get('SLURM_STEP_NUM_TASKS')} tasks: each of them would start its own local cluster and train "
            "separately. Fix: let Slurm start the tasks, `srun --ntasks=N python train.py` (stratkit.detect() "
            "builds the cluster from the Slurm step), or run the launcher in a one-task step "
            "(`srun --ntasks=1 stratkit launch --workers N -- python train.py`) for a one-node cluster")
