"""What a local launch runs: its tasks, each task's TF_CONFIG and environment, the ports, the checked settings.

`plan_launch` turns `launch()`'s arguments into a `LaunchPlan`, checking
everything that can be checked before a process starts: the layout, the
limits of this machine, the command, and every task's TF_CONFIG -- decided by
`stratkit.detect()` through `stratkit.cluster.layout`, the rule every task
applies to itself, so a layout the tasks would reject fails here, once.

Imports no TensorFlow.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from stratkit import status, tf_logging
from stratkit.cluster import gpus, layout
from stratkit.cluster.detect import LAUNCHER_VAR
from stratkit.cluster.layout import primary_task
from stratkit.errors import ConfigError
from stratkit.launch.checks import (
    check_command,
    check_count,
    check_log_dir,
    check_not_in_slurm_step,
    check_seconds,
    check_task_limit,
)
from stratkit.launch.isolation import is_loopback
from stratkit.process.ports import address_family, hold_port
from stratkit.launch.tune import TunePlan, check_groups, check_tune, check_tuner_gpus

#: Value of STRATKIT_LAUNCHER that makes `detect()` report source "launch".
LAUNCHER = "launch"
#: 0 on the first attempt, 1 after the first restart, ... (like torchrun's TORCHELASTIC_RESTART_COUNT).
RESTART_VAR = "STRATKIT_RESTART_COUNT"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_EXIT_GRACE = 30.0
DEFAULT_STOP_GRACE = 10.0
#: What a cluster across machines cannot be protected from (the printed plan and --nnodes say it, once).
GRPC_EXPOSED = ("each task's TensorFlow gRPC server listens on all interfaces of its host, with no authentication "
                "or TLS, and runs any graph a client sends")
NETWORK_MUST_BE_PRIVATE = ("the network between the hosts must be private to the cluster (a firewall that admits "
                           "only the cluster's hosts to these ports).")
CROSS_HOST_SECURITY = f"{GRPC_EXPOSED}: {NETWORK_MUST_BE_PRIVATE}"


class Task(layout.Task):
    """One process of a local launch: a TF_CONFIG role and index (`stratkit.cluster.layout.Task`), and its log file."""

    @property
    def log_name(self) -> str:
        """`worker-1.log`: the task's file in `log_dir`."""
        return f"{self.role}-{self.index}.log"


#: How `stratkit launch` writes the layout settings in its messages.
FLAGS = layout.Spelling(workers="--workers", ps="--ps", chief="--chief", assign=" ")
#: What to change when a launched task would not see its place: its environment comes from the launcher's.
_FIX = "unset STRATKIT_CLUSTER_ENV (or set it to auto or tf_config) for stratkit launch"


def plan_tasks(workers: int = 1, chief: bool = False, ps: int = 0, evaluator: bool = False) -> list[Task]:
    """The tasks of a layout, in TF_CONFIG order: chief, workers, ps, evaluator (`stratkit.cluster.layout`).

    Raises:
        ConfigError: naming the flag, when the layout cannot train.
    """
    check_count(workers, "--workers", 0, "2")
    check_count(ps, "--ps", 0, "1")
    return [Task(t.role, t.index) for t in layout.plan_tasks(workers, chief, ps, evaluator, spelling=FLAGS)]


def task_tf_config(cluster: Mapping[str, Sequence[str]], task: layout.Task,
                   environ: Mapping[str, str] | None = None) -> str:
    """This task's TF_CONFIG string, decided by `stratkit.detect()` -- not re-derived here.

    `environ` is the task's environment without TF_CONFIG (default: empty), so
    a contradiction such as `STRATKIT_STRATEGY=mirrored` with 2 workers fails
    now, in the launcher, instead of in every task.

    Raises:
        ConfigError: when detection rejects the layout or would not see a cluster.
    """
    return layout.check_task(cluster, task, launcher=LAUNCHER, fix=_FIX, environ=environ).to_tf_config()


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



def family_of(host: str) -> int:
    """The address family of `--host`; a host that does not resolve is a ConfigError naming the flag."""
    try:
        return address_family(host)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} does not resolve ({exc}). Fix: use an address of this machine, "
                          "e.g. --host 127.0.0.1") from None


def reserve_ports(host: str, count: int, base_port: int | None = None) -> list[socket.socket]:
    """`count` ports on `host`, held by `stratkit.process.ports.hold_port` until each task listens.

    Held, not closed: a port closed before the child binds it can be taken by
    anyone in between (the race every bind-then-close launcher has). The
    launcher closes each socket as soon as its task's port is listening, or
    the task exits. With `base_port`, ports are base_port, base_port + 1, ...
    (each must be free: nothing listening there).

    Raises:
        ConfigError: naming --host or --base-port, when a port cannot be held.
    """
    family = family_of(host)
    held: list[socket.socket] = []
    try:
        for offset in range(count):
            port = 0 if base_port is None else base_port + offset
            try:
                held.append(hold_port(host, port, family))
            except OSError as exc:
                if base_port is not None and exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"--base-port {base_port}: port {port} on {host.strip('[]')} is in use "
                                      f"({exc.strerror}). Fix: choose another --base-port, or omit it to get free "
                                      "ports") from None
                raise ConfigError(f"could not reserve {count} port(s) on --host {host!r}: {exc}. Fix: use an "
                                  "address of this machine (e.g. --host 127.0.0.1)"
                                  + (" or another --base-port" if base_port is not None else "")) from None
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held


#: `--workers gpu`: one worker per visible GPU (torchrun's `--nproc-per-node gpu`).
GPU_WORKERS = "gpu"


def resolve_workers(workers: int | str, env: Mapping[str, str], flag: str = "--workers", others: int = 0) -> int:
    """`--workers N`, or `gpu`: one per GPU visible here, less `others` (the chief and evaluator take one each).

    Raises:
        ConfigError: naming the flag, when no GPU is left for a worker.
    """
    if isinstance(workers, str) and workers.strip().lower() == GPU_WORKERS:
        count = len(gpus.visible_gpus(env))
        if count - others < 1:
            also = f" ({others} of them for the chief/evaluator)" if others else ""
            raise ConfigError(f"{flag} gpu starts one worker per visible GPU{also}, but this host has {count} "
                              f"(CUDA_VISIBLE_DEVICES and the NVIDIA driver show {count}). Fix: {flag} N to run N "
                              "workers on CPU, or run where the GPUs are visible")
        return count - others
    return workers  # type: ignore[return-value]  # checked by plan_tasks


#: How the GPU refusals read under --nnodes (each node splits its own GPUs among its own tasks).
NODE_GPU_FLAGS = gpus.Spelling(tasks="--workers-per-node", where="this node")


@dataclass(frozen=True)
class GpuRequest:
    """The GPU flags, checked, with the GPUs this host shows (`stratkit.cluster.gpus`)."""

    visible: tuple[str, ...] = ()
    per_worker: int | None = None
    per_ps: int | None = None
    share: bool = False
    spelling: gpus.Spelling = gpus.FLAGS

    def assign(self, tasks: Sequence[layout.Task]) -> list[gpus.Assignment]:
        """Each of this host's `tasks`' GPUs (a ConfigError naming the flags when they cannot be split so)."""
        return gpus.assign(self.visible, [t.role for t in tasks], per_task=self.per_worker, per_ps=self.per_ps,
                           share=self.share, spelling=self.spelling)


@dataclass
class LaunchPlan:
    """`launch()`'s arguments, checked: what the supervisor runs (see `launch()` for each field)."""

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
    #: Defaults the tasks get unless `env` sets them (thread shares, unbuffered Python).
    extra_env: dict[str, str] = field(default_factory=dict)
    private_network: bool | None = None
    #: Which GPUs each task of this host gets (`GpuRequest.assign` over `tasks`).
    gpu: GpuRequest = field(default_factory=GpuRequest)
    #: A signal besides SIGTERM that means "preempted" (`--preemption-signal`), or None.
    preemption_signal: int | None = None
    #: How the failure report names its reporter and the timeout (`stratkit.LocalRunner` speaks of its own
    #: `timeout=` argument), and whether the supervisor prints it (a runner raises it in its error instead).
    report_title: str = "stratkit launch"
    timeout_setting: str = "--timeout"
    print_report: bool = True
    #: Seconds for the whole launch, restarts included (a runner's `timeout=`; `timeout` is per attempt), and
    #: the monotonic time it ends at (the supervisor sets it when the launch starts).
    run_timeout: float | None = None
    run_deadline: float | None = None
    #: A tune run: tuners of one search instead of a TF_CONFIG cluster (`TunePlan`).
    tune: TunePlan | None = None

    def out_of_time(self, now: float, attempt_started: float) -> bool:
        """True when the attempt outlived `timeout`, or the launch `run_timeout`."""
        return ((self.timeout is not None and now - attempt_started > self.timeout)
                or (self.run_deadline is not None and now > self.run_deadline))

    @property
    def timeout_told(self) -> float | None:
        """The timeout a timed-out attempt's report names: the attempt's, else the whole launch's."""
        return self.timeout if self.timeout is not None else self.run_timeout

    @property
    def preemption_signals(self) -> tuple[int, ...]:
        """The signals that tell the launcher its job is preempted: SIGTERM, and `--preemption-signal`."""
        extra = () if self.preemption_signal in (None, signal.SIGTERM) else (self.preemption_signal,)
        return (int(signal.SIGTERM), *extra)

    def gpu_assignments(self) -> dict[str, gpus.Assignment]:
        """Each task's GPUs, by task name."""
        return dict(zip((t.name for t in self.tasks), self.gpu.assign(self.tasks)))

    @property
    def attempts(self) -> int:
        """How many times the cluster may start: the first attempt plus the restarts."""
        return self.max_restarts + 1

    @property
    def primary(self) -> layout.Task:
        return primary_task(self.tasks)

    @property
    def serving(self) -> list[Task]:
        """The tasks that need a port, in task order (a tune run of one worker per trial: the task hosting the
        search service; of groups: every worker, the service's port is the attempt's own)."""
        if self.tune is not None and self.tune.workers_per_trial == 1:
            return [t for t in self.tasks if t.name == self.tune.host_task]
        return [t for t in self.tasks if t.serves]

    def task_env(self, cluster: Mapping[str, Sequence[str]], task: Task, attempt: int) -> dict[str, str]:
        """The complete environment of `task` in attempt number `attempt` (0-based) of `cluster`."""
        env = dict(self.env)
        env.pop("TF_CONFIG", None)
        if self.tune is not None:  # each tuner trains alone on its own devices (a group: on its own cluster)
            env.update(self.tune.task_env(cluster, task, attempt, len(self.tasks)))
        else:
            env["TF_CONFIG"] = task_tf_config(cluster, task, env)
        env[LAUNCHER_VAR] = LAUNCHER
        env[RESTART_VAR] = str(attempt)
        env.update(self.extra_env)
        assignment = self.gpu_assignments()[task.name]
        for key, value in assignment.env().items():
            if key != gpus.GROWTH_VAR or key not in self.env:  # the user's own memory setting wins
                env[key] = value
        return env


def plan_launch(command: Sequence[str], *, workers: int, chief: bool, ps: int, evaluator: bool, max_restarts: int,
                log_dir: str | os.PathLike[str] | None, host: str, base_port: int | None, timeout: float | None,
                exit_grace: float, stop_grace: float, env: Mapping[str, str] | None, stdout: IO[str] | None,
                stderr: IO[str] | None, handle_signals: bool, private_network: bool | None,
                gpus_per_worker: int | None = None, gpus_per_ps: int | None = None, share_gpus: bool = False,
                machines: Sequence[Sequence[layout.Task]] | None = None,
                preemption_signal: str | int | None = None, tune: TunePlan | None = None) -> LaunchPlan:
    """Check `launch()`'s arguments and every task's TF_CONFIG; the plan to run, or a ConfigError naming the flag.

    `machines`: the tasks each machine runs (`--nnodes`), whose GPUs are split per machine; default: all here.
    `tune`: a tune run (`--tune`): N tuners of one search, no TF_CONFIG (`check_tune`).
    """
    base_env = dict(os.environ if env is None else env)
    if tune is not None:
        check_tune(chief=chief, ps=ps, evaluator=evaluator, share_gpus=share_gpus, machines=machines)
    if machines is None:  # (--nnodes resolved it per node)
        workers = resolve_workers(workers, base_env, others=int(bool(chief)) + int(bool(evaluator)))
    if tune is not None:
        check_groups(workers, tune.workers_per_trial)
    tasks = plan_tasks(workers, chief, ps, evaluator)
    gpu = GpuRequest(tuple(gpus.visible_gpus(base_env)), gpus_per_worker, gpus_per_ps, bool(share_gpus),
                     gpus.FLAGS if machines is None else NODE_GPU_FLAGS)
    if tune is not None:
        check_tuner_gpus(len(tasks), gpu.visible, gpus_per_worker)
    for group in machines or [tasks]:
        gpu.assign(group)  # refused now, before any process starts
    serving = sum(t.serves for t in tasks)
    log_dir = check_log_dir(log_dir)
    check_task_limit(len(tasks), serving, workers, ps, base_port, log_dir is not None)
    check_count(max_restarts, "--max-restarts", 0, "3")
    if timeout is not None:
        check_seconds(timeout, "--timeout", 600, positive=True)
    check_seconds(exit_grace, "--exit-grace", DEFAULT_EXIT_GRACE)
    check_seconds(stop_grace, "--stop-grace", DEFAULT_STOP_GRACE)
    if private_network and not is_loopback(host):
        raise ConfigError(f"--private-network gives the tasks a network with loopback only, where --host {host} does "
                          f"not exist. Fix: drop --host (the default is {DEFAULT_HOST}), or drop --private-network")
    if base_port is not None and (isinstance(base_port, bool) or not isinstance(base_port, int)
                                  or not 1 <= base_port <= 65536 - serving):
        raise ConfigError(f"--base-port must leave room for {serving} port(s) within 1..65535: got "
                          f"{base_port!r}. Fix: e.g. --base-port 2222, or omit it to get free ports")
    argv = check_command(command, path=base_env.get("PATH"))
    check_not_in_slurm_step(base_env)
    # The user's own settings win; unbuffered Python makes the prefixed output live; TensorFlow's start-up
    # noise is hidden as on Spark (`stratkit.tf_logging`; attempt.py drops the lines TF prints regardless).
    defaults = {**thread_env(len(tasks)), "PYTHONUNBUFFERED": "1", **tf_logging.quiet_defaults(base_env)}
    extra = {k: v for k, v in defaults.items() if k not in base_env}
    extra_signal = None
    if preemption_signal is not None:  # the tasks treat it as a notice too (the flag wins over their variable)
        extra_signal = status.parse_signal(str(preemption_signal), "--preemption-signal")
        extra[status.PREEMPTION_SIGNAL_VAR] = signal.Signals(extra_signal).name
    elif base_env.get(status.PREEMPTION_SIGNAL_VAR, "").strip():
        extra_signal = status.parse_signal(base_env[status.PREEMPTION_SIGNAL_VAR])
    # Validate every TF_CONFIG before starting anything (ports do not change validity).
    if tune is None:
        layout.check_plan(tasks, launcher=LAUNCHER, fix=_FIX, host=host,
                          environ={k: v for k, v in base_env.items() if k != "TF_CONFIG"})
    return LaunchPlan(
        command=argv, tasks=tasks, max_restarts=max_restarts, log_dir=log_dir,
        host=host, base_port=base_port, timeout=timeout, exit_grace=float(exit_grace), stop_grace=float(stop_grace),
        env=base_env, stdout=stdout or sys.stdout, stderr=stderr or sys.stderr, handle_signals=handle_signals,
        extra_env=extra, private_network=private_network, gpu=gpu, preemption_signal=extra_signal, tune=tune)
