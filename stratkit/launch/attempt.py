"""One attempt of a local launch: start every task, watch them, stop them, record how each ended.

In order:

1. hold one port per serving task (in the private network when there is one)
   and give every task its TF_CONFIG (`LaunchPlan.task_env`);
2. start each task in its own process group, dying with the launcher, known
   to the reaper (`stratkit.process.children`, `stratkit.process.reaper`);
   pump its output, prefixed, to our console and its log (`stratkit.process.pump`),
   less TensorFlow's start-up noise (`stratkit.tf_logging`, as on Spark);
3. watch, every 0.1 s, until one of five endings (`_Watch.verdict`): a signal
   to the launcher; a failure (weighed for `SETTLE` s, see `root_cause_rank`);
   every task done; the chief done and the rest past --exit-grace; --timeout;
4. stop whatever still runs (SIGTERM to each group, SIGKILL after
   --stop-grace), drain the output, close the logs, let the ports go.

Imports no TensorFlow.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import IO

from stratkit import tf_logging, timeline
from stratkit.cluster.layout import build_cluster, format_address
from stratkit.errors import ConfigError
from stratkit.launch.console import Console
from stratkit.launch.isolation import PrivateNetwork
from stratkit.launch.plan import LaunchPlan, Task, family_of, reserve_ports
from stratkit.launch.results import Attempt, TaskExit
from stratkit.process.children import kill_group, start_child, stop_groups
from stratkit.process.ports import is_listening, listening_ports
from stratkit.process.pump import OutputPump
from stratkit.process.reaper import Reaper
from stratkit.process.report import TaskFailure, describe_returncode, is_preempted
from stratkit.tuning import environment as tune_env

_POLL = 0.1
#: After the first failure, how long other tasks' own failures are still weighed for the root cause.
SETTLE = 1.0
#: How often held ports are checked for their task's server.
_PORT_CHECK = 0.25


class TaskProcess:
    """A task of one attempt: its process, output pump, log file, held port, and how it ended."""

    def __init__(self, task: Task, attempt: int, address: str | None, hold: socket.socket | None) -> None:
        self.task = task
        self.attempt = attempt
        self.address = address
        self.hold = hold
        self.proc: subprocess.Popen[bytes] | None = None
        self.pump: OutputPump | None = None
        self.log: IO[bytes] | None = None
        self.log_path: str | None = None
        self.returncode: int | None = None
        self.stopped: str | None = None  # why the launcher stopped it, if it did
        self.failed_order = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def release_port(self) -> None:
        if self.hold is not None:
            self.hold.close()
            self.hold = None

    def join_output(self, timeout: float = 2.0) -> None:
        """Wait (a little) for the last of its output: it belongs in the report."""
        if self.pump is not None:
            self.pump.join(timeout)

    def failure(self, attempt: int, timed_out_after: float | None, timeout_setting: str = "--timeout") -> TaskFailure:
        tail = self.pump.tail.lines() if self.pump is not None else ()
        exception = self.pump.scanner.exception if self.pump is not None else ()
        return TaskFailure(self.task.name, self.returncode if timed_out_after is None else None, tail, self.pid,
                           self.address, attempt, self.log_path, timed_out_after, exception, timeout_setting)

    def exit_record(self) -> TaskExit:
        assert self.proc is not None and self.returncode is not None
        return TaskExit(self.task.name, self.proc.pid, self.returncode, self.address, self.stopped)


@dataclass
class _Watch:
    """What the watch loop has seen so far in one attempt."""

    started: float
    primary_done: float | None = None  # when the chief (worker 0) exited 0
    settle_until: float = 0.0  # failures seen before this time compete for the root cause
    next_port_check: float = 0.0


@dataclass
class AttemptRunner:
    """Runs attempt number `number` (0-based) of `plan`; `run()` returns its `Attempt`.

    `signals` is the supervisor's list of signals received: a new one ends the
    attempt ("interrupted"), and while stopping, a further one skips the grace.
    """

    plan: LaunchPlan
    number: int
    console: Console
    reaper: Reaper
    network: PrivateNetwork | None
    signals: list[int]
    failed: list[TaskProcess] = field(default_factory=list)  # in the order their failures were seen
    lost: list[TaskProcess] = field(default_factory=list)  # a tune run's tuners that died after the search started
    service_hold: socket.socket | None = None  # a tune run of trial groups: the search service's port

    @property
    def primary(self) -> Task:
        return self.plan.primary

    def run(self) -> Attempt:
        children = self._place_tasks()
        started = time.monotonic()
        outcome, culprit, after_success = "failed", None, False
        try:
            cluster = self._cluster(children)
            for child in children:
                self._spawn(child, self.plan.task_env(cluster, child.task, self.number))
            outcome, culprit, after_success = self._watch(children, _Watch(started))
        finally:
            # Nothing still runs after "succeeded"; on an exception (e.g. a task that cannot start) stop the rest.
            self._stop(children, {"timed_out": "timeout", "interrupted": "interrupt",
                                  "preempted": "preempted"}.get(outcome, "failure"))
            self._finish(children)
        seconds = time.monotonic() - started
        failure = None
        if culprit is not None:
            failure = culprit.failure(self.number, self.plan.timeout_told if outcome == "timed_out" else None,
                                      self.plan.timeout_setting)
        exits = tuple(c.exit_record() for c in children if c.proc is not None)
        self.console.event("attempt_end", attempt=self.number, outcome=outcome, seconds=round(seconds, 2),
                           tasks=[asdict(e) for e in exits])
        return Attempt(self.number, outcome, exits, seconds, failure, after_success)

    # -- start ------------------------------------------------------------------------------------
    def _place_tasks(self) -> list[TaskProcess]:
        """One TaskProcess per task, each serving task with its held port and address (a tune run of trial
        groups: one more port, the search service's, held here until the attempt ends)."""
        plan, serving = self.plan, self.plan.serving
        extra = int(self._groups and plan.tune is not None and plan.tune.host_task is not None)
        if self.network is not None:
            holds = self.network.reserve_ports(plan.host.strip("[]"), family_of(plan.host), len(serving) + extra,
                                               plan.base_port)
        else:
            holds = reserve_ports(plan.host, len(serving) + extra, plan.base_port)
        if extra:
            self.service_hold = holds.pop()
        by_task = {t: (format_address(plan.host, h.getsockname()[1]), h) for t, h in zip(serving, holds)}
        return [TaskProcess(t, self.number, *by_task.get(t, (None, None))) for t in plan.tasks]

    @property
    def _groups(self) -> bool:
        return self.plan.tune is not None and self.plan.tune.workers_per_trial > 1

    def _cluster(self, children: list[TaskProcess]) -> dict[str, list[str]]:
        """This attempt's TF_CONFIG cluster: every task's held address (on a node of several: the rendezvous');
        a tune run's: the search service's address (its host task's held port, or with trial groups the
        attempt's own), and with trial groups every worker's, whose groups are clusters of their own."""
        addresses = [c.address for c in children if c.address is not None]
        if self.plan.tune is not None and self._groups:
            service = [] if self.service_hold is None else [
                format_address(self.plan.host, self.service_hold.getsockname()[1])]
            return {"worker": addresses, "service": service}
        if self.plan.tune is not None:
            return {"service": addresses}
        return build_cluster(self.plan.tasks, addresses)

    def _spawn(self, child: TaskProcess, env: dict[str, str]) -> None:
        plan, total = self.plan, self.plan.attempts
        if plan.log_dir:
            child.log_path = os.path.join(plan.log_dir, child.task.log_name)
            child.log = open(child.log_path, "ab", buffering=0)  # noqa: SIM115 - open for the task's lifetime
        try:
            child.proc = self._start_process(env)
        except OSError as exc:
            raise ConfigError(f"could not start {child.task.name} with {plan.command[0]!r}: {exc}. Fix: check "
                              "the command after --") from None
        self.reaper.add(child.pid)
        timeline.mark("task started")
        where = f" at {child.address}" if child.address else ""
        gpu = self.plan.gpu_assignments()[child.task.name]
        devices = f", {gpu.describe()}" if gpu.visible is not None else ""  # nothing said (or set) on a CPU host
        forked = " (forked from the node's standby: TensorFlow already imported)" if getattr(
            child.proc, "forked", False) else ""
        self.console.say(f"attempt {self.number + 1} of {total}: {child.task.name} started: pid {child.pid}{where}"
                         f"{devices}{forked}")
        self.console.event("start", attempt=self.number, task=child.task.name, pid=child.pid, address=child.address,
                           **({"gpus": gpu.visible} if gpu.visible is not None else {}),
                           **({"forked": True} if forked else {}))
        if child.log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            child.log.write(f"===== stratkit launch: {child.task.name}, attempt {self.number + 1} of {total}, "
                            f"pid {child.pid}{where}, {stamp} =====\n".encode())
        assert child.proc.stdout is not None and child.proc.stderr is not None
        name = child.task.name
        noise = tf_logging.StartupNoise(env)  # TensorFlow's start-up lines, as on Spark (console and log alike)
        child.pump = OutputPump({"stdout": child.proc.stdout, "stderr": child.proc.stderr},
                                lambda line: self.console.task_line(name, line, child.log),
                                name=f"stratkit-{name}", keep=noise.keep).start()

    def _start_process(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The task's process, a new one (`NodeAttemptRunner` forks it from its node's standby when it can)."""
        return start_child(self.plan.command, env, enter=self.network.enter if self.network is not None else None)

    # -- watch ------------------------------------------------------------------------------------
    def _watch(self, children: list[TaskProcess], watch: _Watch) -> tuple[str, TaskProcess | None, bool]:
        """Poll until one of the five endings; returns (outcome, culprit, whether the chief had finished)."""
        while True:
            if self.signals:
                return "interrupted", None, watch.primary_done is not None
            now = time.monotonic()
            self._collect_exits(children, watch, now)
            running = [c for c in children if c.returncode is None]
            verdict = self._verdict(running, watch, now)
            if verdict is not None:
                return verdict
            if watch.primary_done == now and not self.failed:  # it just finished; others still run
                self.console.say(f"{self.primary.name} finished; waiting up to {self.plan.exit_grace:g} s "
                                 f"(--exit-grace) for {', '.join(c.task.name for c in running)} to exit")
            if now >= watch.next_port_check and any(c.hold is not None for c in children):
                watch.next_port_check = now + _PORT_CHECK
                self._release_listening(children)
            time.sleep(_POLL)

    def _collect_exits(self, children: list[TaskProcess], watch: _Watch, now: float) -> None:
        """Record the tasks that exited since the last poll: failures in order, the chief's success."""
        for child in children:
            assert child.proc is not None
            if child.returncode is not None or child.proc.poll() is None:
                continue
            child.returncode = child.proc.returncode
            child.release_port()
            self.console.event("exit", attempt=self.number, task=child.task.name, pid=child.pid,
                               returncode=child.returncode)
            if child.returncode != 0 and self._lost_tuner(child, children):
                self.lost.append(child)
            elif child.returncode != 0:
                child.failed_order = len(self.failed)
                self.failed.append(child)
                watch.settle_until = watch.settle_until or now + SETTLE
            elif child.task == self.primary:
                watch.primary_done = now

    def _verdict(self, running: list[TaskProcess], watch: _Watch,
                 now: float) -> tuple[str, TaskProcess | None, bool] | None:
        """The attempt's ending, once there is one; None: keep watching."""
        chief_done = watch.primary_done is not None
        if self.failed:  # 1. a failure: wait out the settle time (or the last task), then name the root cause
            if now < watch.settle_until and running:
                return None
            culprit = min(self.failed, key=self.root_cause_rank)
            culprit.join_output()  # its last lines belong in the report
            # A task that saved its backup on a preemption notice and exited 75: the cluster's tasks stop at the
            # same step, so every other one is saving and exiting too (a crash among them ranks first).
            return ("preempted" if is_preempted(culprit.returncode) else "failed"), culprit, chief_done
        if not running and self.lost and not tune_env.ended(self._markers):
            culprit = self.lost[0]  # a tune run whose tuners all died before the search ended
            culprit.join_output()
            return "failed", culprit, chief_done
        if not running:  # 2. every task exited 0 (a tune run: or died as lost tuners of a search that ended)
            return "succeeded", None, True
        if watch.primary_done is not None and now - watch.primary_done > self.plan.exit_grace:  # 3. --exit-grace over
            names = ", ".join(c.task.name for c in running)
            self.console.say(f"{names} still running {self.plan.exit_grace:g} s after {self.primary.name} "
                             "finished: stopping them (not a failure: training is done; raise --exit-grace to "
                             "wait longer)")
            self._stop(running, "after_success")
            return "succeeded", None, True
        if self.plan.out_of_time(now, watch.started):  # 4. --timeout (or a runner's timeout for the whole run)
            culprit = next((c for c in running if c.task == self.primary), running[0])
            return "timed_out", culprit, chief_done
        return None  # (5. a signal to the launcher is checked first, in `_watch`)

    @property
    def _markers(self) -> str | None:
        return self.plan.tune.markers_for(self.number) if self.plan.tune is not None else None

    def _lost_tuner(self, child: TaskProcess, children: list[TaskProcess]) -> bool:
        """A tune run's tuner (not the service's host) that died after the search started: its lease expires and
        its trial runs again on another tuner, so the run goes on (said once, in events.jsonl too). Before the
        start, a tuner that cannot run is the run's failure (its bad configuration, its missing module). A
        worker of a multi-worker trial group takes its group with it (the others would wait in a collective):
        they are stopped, and their tuner is lost; the host's group is the host's."""
        tune = self.plan.tune
        if tune is None or not tune_env.started(self._markers):
            return False
        per = tune.workers_per_trial
        group = [c for c in children if c.task.index // per == child.task.index // per]
        if any(c.task.name == tune.host_task for c in group):
            return False
        self.console.say(f"{child.task.name} (a tuner) {describe_returncode(child.returncode)}: the search goes on "
                         "without it (its trial's lease expires and the trial runs again on another tuner)")
        self.console.event("tuner_lost", attempt=self.number, task=child.task.name, returncode=child.returncode)
        for other in group:
            if other is not child and other.proc is not None and other.returncode is None and other.stopped is None:
                other.stopped = f"its trial group lost {child.task.name}"
                kill_group(other.pid, signal.SIGKILL)
        return True

    def root_cause_rank(self, child: TaskProcess) -> tuple[bool, bool, bool, int]:
        """Order failures seen within `SETTLE` s of the first one: the smallest is the root cause.

        A death by signal (OOM kill, segfault) beats an exit code: a crash is a
        cause, while an exception is often a peer's reaction to it (an MWMS
        worker's collective aborting). In a parameter-server cluster the chief
        beats the servers, which exit 1 as soon as the chief reports its own
        failure -- possibly before the chief's process has finished exiting.
        A preemption (exit 75, the task saved its backup) ranks after any
        other failure: it is not counted, a failure beside it is.
        Then: the first observed.
        """
        code = child.returncode or 0
        crashed = code < 0 or 128 < code < 160
        ps_chief = child.task.role == "chief" and any(t.role == "ps" for t in self.plan.tasks)
        return not crashed, is_preempted(code), not ps_chief, child.failed_order

    def _release_listening(self, children: list[TaskProcess]) -> None:
        """Close each held port whose task's server now listens on it."""
        table = listening_ports() if self.network is None else self.network.listening_ports()
        for child in children:
            if child.hold is not None:
                port = child.hold.getsockname()[1]
                if is_listening(self.plan.host, port, table):
                    child.release_port()
                    self.console.event("port_released", attempt=self.number, task=child.task.name, port=port,
                                       reason="listening")

    # -- stop -------------------------------------------------------------------------------------
    def _stop(self, children: list[TaskProcess], why: str, grace: float | None = None) -> None:
        """SIGTERM every running task's group; SIGKILL what is left after --stop-grace (or `grace` s, or a
        second signal).

        Note that in MultiWorkerMirrored tasks TensorFlow's coordination agent
        catches SIGTERM as a preemption notice ("SIGTERM caught at ...", tsl's
        SigtermNotifier) and keeps running until a peer's heartbeat fails, so
        there the SIGKILL after --stop-grace is what usually ends them.
        """
        started = [c for c in children if c.proc is not None]
        running = [c for c in started if c.proc is not None and c.proc.poll() is None]
        for child in running:
            child.stopped = why
        signals_before = len(self.signals)
        stop_groups([c.proc for c in running if c.proc is not None],
                    self.plan.stop_grace if grace is None else grace,
                    hurry=lambda: len(self.signals) != signals_before)
        for child in started:
            if child.returncode is None:
                assert child.proc is not None
                child.returncode = child.proc.wait()
                kind = "stopped" if child.stopped is not None else "exit"
                extra = {"why": why} if child.stopped is not None else {}
                self.console.event(kind, attempt=self.number, task=child.task.name, pid=child.pid,
                                   returncode=child.returncode, **extra)

    def _finish(self, children: list[TaskProcess]) -> None:
        """Kill leftovers in each task's group (its own children), drain its output, close its log and port."""
        for child in children:
            if child.proc is not None:
                kill_group(child.pid, signal.SIGKILL)
        for child in children:
            child.join_output()
            if child.proc is not None:
                self.reaper.remove(child.pid)
            if child.log is not None:
                with self.console.lock:
                    child.log.close()
                    child.log = None
            child.release_port()
        if self.service_hold is not None:
            self.service_hold.close()
            self.service_hold = None
