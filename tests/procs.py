"""Run small TensorFlow clusters as real local processes, for tests.

Multi-worker tf.distribute behaviour can only be observed with several real
processes talking gRPC on loopback: one process cannot host two MWMS workers
(collective ops are configured once per process). These helpers start N Python
processes, each with its own ``TF_CONFIG``, collect their output, and make sure
none of them outlives the call (a hung collective must not leave orphans that
hold ports or CPU for the next test).

Typical use::

    ports = free_ports(2)
    results = run_cluster(code, worker_tf_configs(ports), timeout=60)
    assert all(r.returncode == 0 for r in results), describe(results)

Fork servers. Importing TensorFlow and Keras costs a child 3 s of CPU on a quiet machine (6-7 s measured
under this suite's load), more than many tests' training. So each pytest process keeps two fork servers:
the standby of `stratkit launch --nnodes` (`stratkit.launch.standby`), an interpreter that imported
TensorFlow and Keras and created no TensorFlow context. A child is forked from one instead of started, with
its own environment, argv, working directory, stdout/stderr files, process group, `__main__` and exit status
as `python script.py` gives them (tests/launch/test_standby.py compares the two), and its own TensorFlow
context: TF_CONFIG, CUDA_VISIBLE_DEVICES and what `tf.config` sets are read when it starts, in the child. Two
servers, so that a cluster's workers hash strings with different seeds as started ones do (:data:`SERVERS`).

What differs is what happens before the script runs, so a child is a new interpreter when that matters:
when its environment differs from the servers' in a variable read at import (:data:`IMPORT_TIME`: the
interpreter's, TF_* but TF_CONFIG, KERAS_*, the BLAS/OpenMP libraries', ...), and for every test that
passes ``fork=False``: a test of process start-up itself (what a fresh process imports, prints while
importing or takes to start). STRATKIT_TEST_FORK=0 turns the servers off for a whole run.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from stratkit.launch.standby import ForkedTask, TaskStandby
from stratkit.process.children import kill_group, start_child

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent

#: Environment every child gets (quiet TF logs, never touch a GPU).
BASE_ENV: dict[str, str] = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "CUDA_VISIBLE_DEVICES": "",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class Result:
    """Outcome of one child process.

    ``returncode`` is negative when the process died of a signal (e.g. -9 after
    we killed it on timeout); ``killed`` says whether *we* killed it.
    """

    index: int
    returncode: int
    stdout: str
    stderr: str
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed

    def last_json(self) -> Any:
        """Parse the last stdout line that is a JSON object (the script's report)."""
        for line in reversed(self.stdout.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise ValueError(f"process {self.index} printed no JSON line; stdout={self.stdout!r}")


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its reaper, or a dead task, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``n`` distinct TCP ports that were free a moment ago, below the ephemeral range.

    All sockets are held open until every port is picked, so the ports are distinct. They are drawn below the
    kernel's ephemeral range (ip_local_port_range), so no outgoing connection of any process (a store client,
    Spark, gRPC) can take one between now and the child's bind: ports from bind(0) come from that range, and on
    a busy suite a parameter server's port was taken that way ("Could not start gRPC server", CI). What remains
    is another test drawing the same port in the same instant: one in thousands of ports.
    """
    low = _ephemeral_low()
    socks: list[socket.socket] = []
    tries = 0
    try:
        while len(socks) < n:
            tries += 1
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)   # no SO_REUSEADDR: held ports stay distinct
            try:
                s.bind((host, random.randrange(10000, low) if low > 12000 and tries < 200 else 0))
            except OSError as error:
                s.close()
                if error.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise                                           # not a taken port: the address itself
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def cluster_tf_configs(cluster: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """One TF_CONFIG dict per task of ``cluster``, in role order then index order.

    ``cluster`` is a TF cluster spec such as
    ``{"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}``.
    """
    spec = {role: list(addrs) for role, addrs in cluster.items()}
    configs = []
    for role, addrs in spec.items():
        for i in range(len(addrs)):
            configs.append({"cluster": spec, "task": {"type": role, "index": i}})
    return configs


def worker_tf_configs(ports: Sequence[int], host: str = "127.0.0.1") -> list[dict[str, Any]]:
    """TF_CONFIGs for a cluster of ``len(ports)`` plain workers on ``host``."""
    return cluster_tf_configs({"worker": [f"{host}:{p}" for p in ports]})


def child_env(
    tf_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """The environment for one child.

    Starts from ``os.environ``, drops any inherited ``TF_CONFIG``, adds
    :data:`BASE_ENV`, puts the repository root and ``tests/`` first on
    ``PYTHONPATH``, sets ``TF_CONFIG`` from ``tf_config`` (if not None), then
    applies ``env`` (a value of None removes the variable).
    """
    out = dict(os.environ)
    out.pop("TF_CONFIG", None)
    out.update(BASE_ENV)
    paths = [str(REPO_ROOT), str(TESTS_DIR)]
    if out.get("PYTHONPATH"):
        paths.append(out["PYTHONPATH"])
    out["PYTHONPATH"] = os.pathsep.join(paths)
    if tf_config is not None:
        out["TF_CONFIG"] = json.dumps(tf_config)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def _script_argv(script: str | os.PathLike[str], workdir: Path) -> list[str]:
    """argv for the script: a path to a file, or Python code written to a temp file.

    A ``str`` naming an existing file is treated as a path; any other ``str``
    is code (written to a file so tracebacks show real line numbers).
    """
    if isinstance(script, os.PathLike) or (
        isinstance(script, str) and "\n" not in script and os.path.isfile(script)
    ):
        return [sys.executable, os.fspath(script)]
    path = workdir / "child_script.py"
    path.write_text(str(script))
    return [sys.executable, str(path)]


#: "0": no fork server; every child is a new interpreter.
FORK_VAR = "STRATKIT_TEST_FORK"

#: Variables read before or while TensorFlow, Keras and stratkit are imported: by the interpreter (PYTHON*,
#: locale, PATH, HOME, temp dirs), TensorFlow's and XLA's C++ (TF_CPP_MIN_LOG_LEVEL, TF_ENABLE_ONEDNN_OPTS, ...),
#: the BLAS/OpenMP/CUDA libraries, Keras and the packages it imports (found with an LD_PRELOAD getenv logger
#: and a watched os.environ around those imports; prefixes where a family reads more than was seen).
IMPORT_TIME = re.compile(
    r"_?PYTHON\w*|PY_\w+|PATH|HOME|TERM|TMPDIR|TEMP|TMP|LANG|LANGUAGE|SOURCE_DATE_EPOCH|SSLKEYLOGFILE|MPL\w*"
    r"|MATPLOTLIB\w*|TEST_(RANDOM_SEED|SRCDIR|TMPDIR)|STRATKIT_TEST_IMPORT_LOG|__PYVENV_LAUNCHER__|IN_SPHINX_RUN"
    r"|ENABLE_RUNTIME_UPTIME_TELEMETRY|DISABLE_HOST_SEND_RECV_REGISTRATION|TEMPORARILY_DISABLE_PROTOBUF_VERSION_CHECK"
    r"|(LC|LD|XDG|TF|XLA|KERAS|CUDA|NVIDIA|OMP|GOMP|KMP|MKL|OPENBLAS|GOTO|GFORTRAN|LLVM|NPY|NUMPY|HDF5|GCS|GCSFS"
    r"|AZURE|ARROW|JE|PILLOW|FREETYPE|SKLEARN|SCIPY|JOBLIB|LOKY|PANDAS|ABSL|PROTOCOL_BUFFERS|GRPC|WRAPT|OPENSSL"
    r"|PSUTIL|IPYTHON|TRAITLETS|ACC|TF2)_\w*")
#: What importing TensorFlow and Keras itself sets in os.environ (tensorflow/__init__.py, scikit-learn and joblib
#: through keras.wrappers): a child that inherited these values from a pytest process that imported TensorFlow
#: is as one without them, whose own import sets them (the servers' import did).
SET_BY_IMPORT = {"TF2_BEHAVIOR": "1", "ENABLE_RUNTIME_UPTIME_TELEMETRY": "1", "HDF5_PLUGIN_PATH": "disable",
                 "KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}
#: ... but read when a TensorFlow context starts, which only the forked child does.
_CONTEXT_TIME = frozenset({"TF_CONFIG", "CUDA_VISIBLE_DEVICES"})

#: What the fork servers import: TensorFlow and Keras (the cost), not stratkit (0.07 s): a child imports stratkit
#: itself, after whatever its script does first, as a new interpreter would.
SERVER_PRELOAD = ("tensorflow", "keras")
#: Fork servers per pytest process. Each interpreter draws its own string-hash seed at start and a forked child
#: keeps its server's; child i of a cluster is forked from server i % 2, so a cluster's workers 0 and 1 hash
#: strings differently, as separately started workers do (an order that depends on it must not pass a test
#: only because two workers shared a seed).
SERVERS = 2

_servers: list[TaskStandby] = []
_server_env: dict[str, str] = {}
_servers_off = False


def _import_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if IMPORT_TIME.fullmatch(k) and k not in _CONTEXT_TIME and SET_BY_IMPORT.get(k) != v}


def _fork_server(env: Mapping[str, str], index: int) -> TaskStandby | None:
    """The fork server for a cluster's child `index` (started on first use), if a child with environment `env`
    may be forked from it; else None: start the child as a new interpreter."""
    global _server_env, _servers_off
    if _servers_off or os.environ.get(FORK_VAR, "1") == "0":
        return None
    if not _servers:
        if threading.current_thread() is not threading.main_thread():
            return None  # a server dies with the thread that starts it: only the main thread outlives every test
        _server_env = child_env()
        for _ in range(SERVERS):     # both import at once
            _servers.append(TaskStandby([sys.executable], None, _server_env, preload=SERVER_PRELOAD))
        atexit.register(stop_fork_servers)
    server = _servers[index % len(_servers)]
    if not server.wait_ready(600):
        sys.stderr.write(f"tests/procs.py: a fork server is gone ({server.error}); children start as processes\n")
        _servers_off = True
        return None
    ours, theirs = _import_env(env), _import_env(_server_env)
    if ours != theirs:
        _log_run({"started": sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))})
        return None
    return server


def stop_fork_servers() -> None:
    """End this process's fork servers (a child still running dies with its server); the next child starts
    them again."""
    while _servers:
        _servers.pop().close()


def _start(argv: list[str], env: dict[str, str], out: IO[bytes], err: IO[bytes], cwd: str, fork: bool,
           index: int) -> subprocess.Popen[bytes] | ForkedTask:
    """Child `index` of a cluster: forked from a fork server when it can be, else a new interpreter."""
    server = _fork_server(env, index) if fork else None
    if server is not None:
        task = server.fork(env, run=("path", argv[1], argv[2:]), cwd=cwd, output=(out.fileno(), err.fileno()))
        if task is not None:
            _log_run({"forked": True, "argv": argv[1:3]})
            return task
    return start_child(argv, env, stdout=out, stderr=err, cwd=cwd)


def _log_run(line: dict[str, Any]) -> None:
    """In a measuring run (tests/cpu_times.py), a line beside the imports' lines: a child forked, or started
    because of the variables named."""
    log = os.environ.get("STRATKIT_TEST_IMPORT_LOG")
    if log:
        line.update(pid=os.getpid(), time=time.time(), test=os.environ.get("PYTEST_CURRENT_TEST", ""),
                    worker=os.environ.get("PYTEST_XDIST_WORKER", ""))
        with open(log, "a") as handle:
            handle.write(json.dumps(line) + "\n")


def _kill(proc: subprocess.Popen[bytes] | ForkedTask) -> None:
    """SIGKILL the child's process group (it was started as a group leader).

    The group is killed even if the child itself already exited, so anything it
    spawned goes too.
    """
    kill_group(proc.pid)  # start_child made it the leader: while it lives, its group exists


def run_cluster(
    script: str | os.PathLike[str],
    tf_configs: Sequence[Mapping[str, Any] | None],
    env: Mapping[str, str | None] | None = None,
    timeout: float = 120.0,
    args: Sequence[str] = (),
    per_process_env: Sequence[Mapping[str, str | None]] | None = None,
    grace_after_failure: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
    fork: bool = True,
) -> list[Result]:
    """Start one process per entry of ``tf_configs`` and wait for all of them.

    Args:
        script: a path to a Python file, or Python source code.
        tf_configs: one TF_CONFIG dict per process (None: no TF_CONFIG).
        env: extra environment for every process (None values unset a variable).
        timeout: overall seconds for the whole cluster; then every process still
            running is SIGKILLed (its whole process group) and marked ``killed``.
        args: extra command-line arguments for every process.
        per_process_env: optional extra environment per process (same length
            as ``tf_configs``), applied after ``env``.
        grace_after_failure: if set, once any process exits non-zero the others
            get this many seconds to finish, then are killed. Peers of a dead
            MWMS worker otherwise block in a collective until the heartbeat
            timeout.
        cwd: working directory of the children (default: repository root).
        fork: False: every child is a new interpreter, never forked from the fork server (see the module
            docstring): for a test of process start-up itself.

    Returns:
        One :class:`Result` per process, in ``tf_configs`` order. Never leaves a
        child running, also when interrupted (KeyboardInterrupt, test timeout).
    """
    if per_process_env is not None and len(per_process_env) != len(tf_configs):
        raise ValueError("per_process_env must have one entry per tf_config")
    procs: list[subprocess.Popen[bytes] | ForkedTask] = []
    files: list[tuple[IO[bytes], IO[bytes]]] = []
    killed: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="stratkit-procs-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        argv = _script_argv(script, workdir) + list(args)
        try:
            for i, cfg in enumerate(tf_configs):
                extra = dict(env or {})
                if per_process_env is not None:
                    extra.update(per_process_env[i])
                # Files, not pipes: a chatty child can never block on a full pipe.
                out = stack.enter_context(open(workdir / f"{i}.out", "w+b"))
                err = stack.enter_context(open(workdir / f"{i}.err", "w+b"))
                files.append((out, err))
                # Own session (its group is killed as one) and die-with-parent: no child outlives a killed
                # test runner either (stratkit's own guarantee for launched tasks).
                procs.append(_start(argv, child_env(cfg, extra), out, err,
                                    os.fspath(cwd) if cwd is not None else str(REPO_ROOT), fork, i))
            deadline = time.monotonic() + timeout
            grace = grace_after_failure
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if grace is not None and any(c not in (None, 0) for c in codes):
                    deadline = min(deadline, now + grace)
                    grace = None  # start the grace period only once
                if now >= deadline:
                    for i, p in enumerate(procs):
                        if p.poll() is None:
                            killed.add(i)
                            _kill(p)
                    break
                time.sleep(0.05)
        finally:
            # Also on KeyboardInterrupt / an exception above: no orphans.
            for p in procs:
                _kill(p)
                p.wait()
        results = []
        for i, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
            out.seek(0)
            err.seek(0)
            results.append(
                Result(
                    index=i,
                    returncode=p.returncode,
                    stdout=out.read().decode(errors="replace"),
                    stderr=err.read().decode(errors="replace"),
                    killed=i in killed,
                )
            )
        return results


def start_process(argv: Sequence[str], env: Mapping[str, str], stdout: IO[bytes], stderr: IO[bytes],
                  cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes] | ForkedTask:
    """Start `argv` (``[python, script, *args]``) in the background with the whole environment `env` (see
    :func:`child_env`) and its output to `stdout`/`stderr` (files, or pipes' write ends): forked from a fork
    server when :func:`run_cluster` would fork it, else a new interpreter. The caller waits for it (`poll`,
    `wait`, `returncode`, as :class:`subprocess.Popen` has them) and kills its group (`pid`) if need be."""
    return _start(list(argv), dict(env), stdout, stderr, os.fspath(cwd) if cwd is not None else str(REPO_ROOT),
                  True, 0)


def run_process(
    script: str | os.PathLike[str],
    env: Mapping[str, str | None] | None = None,
    timeout: float = 120.0,
    args: Sequence[str] = (),
    tf_config: Mapping[str, Any] | None = None,
    fork: bool = True,
) -> Result:
    """Run a single child process (same environment rules as :func:`run_cluster`)."""
    return run_cluster(script, [tf_config], env=env, timeout=timeout, args=args, fork=fork)[0]


def describe(results: Sequence[Result], tail: int = 3000) -> str:
    """Human-readable dump of results for assertion messages (stderr tails)."""
    parts = []
    for r in results:
        parts.append(
            f"--- process {r.index}: returncode={r.returncode} killed={r.killed}\n"
            f"stdout (tail):\n{r.stdout[-tail:]}\nstderr (tail):\n{r.stderr[-tail:]}"
        )
    return "\n".join(parts)
